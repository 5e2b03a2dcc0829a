"""Clustered FedAvg under DP-FedAvg: K private means, one Gaussian release per round.

Clustered FedAvg (:mod:`strategies.algorithms.clustered`) runs k-means over the individual uploads,
which couples every client's update to every other's and which no noised sum can
protect. Under DP-FedAvg the clustering step is dropped, as in IFCA (Ghosh et al. 2020,
"An Efficient Framework for Clustered Federated Learning"): each sampled client is
assigned one of the K released models, by its own data only (``cluster.assign``:
``loss``, the lowest loss of the K models on its data, or ``l2``, the model closest to
its own last upload), trains from it, and each model k moves by the private mean of
the clipped updates of the clients assigned to it:

    model_k += (sum_{i in S, c(i) = k} clip_C(Δ_i) + N(0, (zC)² I)) / m

Design notes: ``docs/notes.md``, ``strategies.mechanisms.clustered_dp``.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from protocol import keys
from protocol.records import arrays_of, as_int, to_record
from strategies.algorithms.clustered import ClusteredFedAvg
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive

# The mixin is checked as the DP-FedAvg wrapper it always precedes.
if TYPE_CHECKING:
    _DPFedAvg = DPFedAvgFixed
else:
    _DPFedAvg = object


class ClusteredMeans(_DPFedAvg):
    """The clustered half of the DP-FedAvg wrappers below (a mixin before them)."""

    strategy: ClusteredFedAvg
    _assigned: dict[int, int]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """DP-FedAvg's sampling; the clustered strategy assigns each sampled node a model."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._assigned = {
            m.metadata.dst_node_id: as_int(m.content[keys.CONFIG][keys.CLUSTER_ID])
            for m in messages
        }
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Release K private means (noise on every one) and charge one Gaussian release."""
        if self._round_state is None:
            return None, None
        current, sent, population = self._round_state
        self._round_state = None
        self.strategy.start_models(current)  # an empty first cohort never asked it
        models = self.strategy.models
        assert models is not None
        references = [(model, arrays_of(model)) for model in models]
        deltas, records, failed = self._contributions(
            replies, sent, lambda node: references[self._assigned[node]]
        )
        new_models = []
        for k, (model, reference) in enumerate(references):
            members = [delta for node, delta in deltas.items() if self._assigned[node] == k]
            mean = self._private_mean(members, 0, self.head.select(reference))
            merged = self.head.merge(mean, reference)
            moved = [c + d for c, d in zip(reference, merged, strict=True)]
            new_models.append(to_record(model, moved))
        uploads = {}  # node -> (its model, its upload): the next l2 assignment reads it
        for node, delta in deltas.items():
            k = self._assigned[node]
            reference = references[k][1]
            merged = self.head.merge(delta, reference)
            uploads[node] = (k, [c + d for c, d in zip(reference, merged, strict=True)])
        self.strategy.take_private_models(server_round, new_models, uploads)
        self.ledger.charge(self.release(server_round, population))
        sizes = {f"cluster-{k}-size": 0 for k in range(len(models))}
        for k, _ in uploads.values():
            sizes[f"cluster-{k}-size"] += 1
        log(INFO, "aggregate_train: %d private cluster means released", len(models))
        return new_models[0], self.released_metrics(records, failed, **sizes)  # sizes: curator


class ClusteredDPFedAvgFixed(ClusteredMeans, DPFedAvgFixed):
    """DP-FedAvg (fixed clip) around clustered FedAvg (module docstring)."""


class ClusteredDPFedAvgAdaptive(ClusteredMeans, DPFedAvgAdaptive):
    """DP-FedAvg with adaptive clipping around clustered FedAvg: one clip norm for all
    clusters, moved by the noised count of all sampled clients' bits."""
