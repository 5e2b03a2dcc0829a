"""Clustered FedAvg under DP-FedAvg: K private means, one Gaussian release per round.

Clustered FedAvg (:mod:`strategies.clustered`) runs k-means over the individual uploads,
which couples every client's update to every other's and which no noised sum can
protect. Under DP-FedAvg the clustering step is dropped, as in IFCA (Ghosh et al. 2020,
"An Efficient Framework for Clustered Federated Learning"): each sampled client is
assigned one of the K released models, by its own data only (``cluster.assign``:
``loss``, the lowest loss of the K models on its data, or ``l2``, the model closest to
its own last upload), trains from it, and each model k moves by the private mean of
the clipped updates of the clients assigned to it:

    model_k += (sum_{i in S, c(i) = k} clip_C(Δ_i) + N(0, (zC)² I)) / m

for every k, an empty cluster included (it gets the noise alone), divided by the fixed
m as DP-FedAvg divides its one sum.

Why this is one Gaussian mechanism with multiplier z. Client i's contribution to the
K sums is the vector g(i) = e_{c(i)} ⊗ clip_C(Δ_i): its update placed in the block of
its cluster, zero elsewhere. c(i) is a function of client i's data and the released
models only, so ‖g(i)‖ <= C whatever the assignment, and the K noised sums are the sum
of the g(i) plus N(0, (zC)² I) on the concatenated vector: sensitivity C under
add-or-remove-one (2C under replace-one), multiplier z, amplified by the secret
Poisson (or fixed-size) sample like DP-FedAvg's one model. The assignments themselves
(the query scores, ``clusters.csv``, cluster sizes) are seen only by the trusted server
and never released (they go to ``curator/``); the K models and central evaluation are.

Threat model: the trusted server (central DP), as DP-FedAvg with server-side noise.
The server sees each client's update and scores, so nothing holds against it; client-side
noise is refused (the loss query would show the server each client's raw scores).

The run's "global" model (``model.pt``, the round result) is model 0, a
data-independent choice (the largest cluster would release the argmax of the private
sizes); every model is in ``checkpoint/cluster-<k>.pt`` and central evaluation
reports each one and the best per metric.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from strategies import keys
from strategies.base import InvalidReply, arrays_of, to_record, weighted_metrics
from strategies.clustered import ClusteredFedAvg
from strategies.dp_fedavg import DPFedAvgFixed
from strategies.dp_fedavg_adaptive import DPFedAvgAdaptive


class ClusteredMeans:
    """The clustered half of the DP-FedAvg wrappers below (a mixin before them)."""

    strategy: ClusteredFedAvg

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """DP-FedAvg's sampling; the clustered strategy assigns each sampled node a model."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._assigned = {
            m.metadata.dst_node_id: int(m.content[keys.CONFIG][keys.CLUSTER_ID]) for m in messages
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
        by_node: dict[int, Message] = {}
        for message in replies:
            by_node.setdefault(message.metadata.src_node_id, message)
        deltas: list[list[list[np.ndarray]]] = [[] for _ in models]
        records, valid = [], {}
        for node in sent:
            k = self._assigned[node]
            reference = arrays_of(models[k])
            try:
                message = by_node.get(node)
                if message is None:
                    raise InvalidReply("no reply")
                received, metrics = self._check(message, models[k])
            except InvalidReply as err:
                log(WARNING, "DP clustered: node %d counts as a zero update: %s", node, err)
                continue
            delta = [r - c for r, c in zip(received, reference, strict=True)]
            deltas[k].append(self._released(delta))
            metrics[keys.NUM_EXAMPLES] = 1.0
            records.append(metrics)
            valid[node] = (k, received)
        new_models = []
        for k, model in enumerate(models):
            reference = arrays_of(model)
            mean = self._private_mean(deltas[k], 0, self._released(reference))
            merged = self._merge(mean, reference)
            moved = [c + d for c, d in zip(reference, merged, strict=True)]
            new_models.append(to_record(model, moved))
        self.strategy.take_private_models(server_round, new_models, valid)
        self.ledger.charge(self.release(server_round, population))
        aggregated = dict(weighted_metrics(records))
        aggregated.update(self.round_metrics(records))
        aggregated |= {f"cluster-{k}-size": len(d) for k, d in enumerate(deltas)}  # curator
        aggregated[keys.DP_FAILED_CLIENTS] = float(len(sent) - len(valid))
        aggregated[keys.DP_EPSILON] = self.ledger.epsilon()
        log(INFO, "aggregate_train: %d private cluster means released", len(models))
        return new_models[0], MetricRecord(self.mark(aggregated))


class ClusteredDPFedAvgFixed(ClusteredMeans, DPFedAvgFixed):
    """DP-FedAvg (fixed clip) around clustered FedAvg (module docstring)."""


class ClusteredDPFedAvgAdaptive(ClusteredMeans, DPFedAvgAdaptive):
    """DP-FedAvg with adaptive clipping around clustered FedAvg: one clip norm for all
    clusters, moved by the noised count of all sampled clients' bits."""
