"""Clustered FedAvg's strategy: K global models, each client assigned one
(:mod:`.assignment`), each model the mean of a k-means cluster of the uploads
(:mod:`.kmeans`) or of its assignees' uploads; members and history in :mod:`.state`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from protocol import keys
from protocol.records import InvalidReply, arrays_of, copy_record, to_record
from protocol.replies import checked_metrics
from strategies.algorithms.clustered.assignment import assign_l2, assign_loss
from strategies.algorithms.clustered.kmeans import flatten, kmeans_models, kmeans_seed, mean_arrays
from strategies.algorithms.clustered.settings import check_rules, describe_rules
from strategies.algorithms.clustered.state import ClusterState
from strategies.runtime.aggregation import weighted_metrics
from strategies.runtime.evaluation import PartitionOrderedEvaluation
from strategies.runtime.partitions import PartitionMap, nodes_for_round, seeded_sample

_STREAM = 0xC1  # the strategy's generator: sampling and random assignment
_INIT_STREAM = 0xC3  # init="distinct": the weight seeds of models 1..K-1


def model_seeds(seed: int, k: int) -> list[int]:
    """The weight seeds of models 1..K-1 under ``init="distinct"`` (model 0 is the run's
    initial model, drawn from ``seed`` itself): one stream per run seed, so a run and
    its rerun start from the same K models."""
    states = np.random.SeedSequence([seed, _INIT_STREAM]).generate_state(k - 1)
    return [int(s) for s in states]


def cluster_message(
    node: int, k: int, model: ArrayRecord, config: ConfigRecord, server_round: int, train: bool
) -> Message:
    """A train or evaluate message for cluster ``k`` with its own copy of ``model``."""
    extra = {keys.SERVER_ROUND: server_round, keys.CLUSTER_ID: k}
    content = RecordDict(
        {keys.ARRAYS: copy_record(model), keys.CONFIG: ConfigRecord({**config, **extra})}
    )
    return Message(
        content=content,
        dst_node_id=node,
        message_type=MessageType.TRAIN if train else MessageType.EVALUATE,
        group_id=str(server_round),
    )


class ClusteredFedAvg(PartitionOrderedEvaluation, Strategy):
    """K global models; clients are assigned to one, and each model becomes the mean of
    a k-means cluster of the uploads, or of the uploads of the clients assigned to it.

    The client contract and its rationale: ``docs/notes.md``,
    ``strategies.algorithms.clustered``.

    Parameters
    ----------
    k, assign, space : int, str, str
        K global models; ``"l2"`` (closest to the client's last upload, ties drawn) or
        ``"loss"`` (IFCA: lowest query score); k-means over ``"weights"`` (the uploads)
        or ``"directions"`` (each update's unit direction).
    update, init : str
        ``"kmeans"`` (the PPO study's rule) or ``"assignment"`` (IFCA: each model the mean
        of its assignees' uploads; needs ``space = "weights"``); ``"shared"`` (K copies
        of the first model) or ``"distinct"`` (:meth:`set_distinct_models`).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
    min_available_nodes :
        FedAvg's sampling, drawn with a generator seeded from ``seed``.
    seed, query_timeout
        Seeds sampling, random assignment and k-means; seconds to wait for query
        replies, and for enough nodes to connect.
    partitions : PartitionMap, optional
        The run's node -> partition map (default: a new one, owned by this strategy).
    """

    MODEL_LABEL = "cluster"  # its models are written and evaluated as cluster-<k>
    AGGREGATES_UPLOADS = True  # privacy wrappers hand it the checked uploads

    def __init__(
        self,
        *,
        k: int,
        assign: str,
        space: str = "weights",
        update: str = "kmeans",
        init: str = "shared",
        fraction_train: float,
        fraction_evaluate: float,
        min_train_nodes: int,
        min_evaluate_nodes: int,
        min_available_nodes: int,
        seed: int,
        query_timeout: float,
        partitions: PartitionMap | None = None,
    ) -> None:
        check_rules(k, assign, space, update, init)
        self.k, self.assign, self.space, self.seed = k, assign, space, seed
        self.update, self.init = update, init
        self._distinct: list[ArrayRecord] | None = None  # init="distinct": models 1..K-1
        self.fraction_train, self.fraction_evaluate = fraction_train, fraction_evaluate
        self.min_train_nodes, self.min_evaluate_nodes = min_train_nodes, min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.query_timeout = query_timeout
        self.partitions = partitions if partitions is not None else PartitionMap()
        self.rng = np.random.default_rng([seed, _STREAM])
        self.models: list[ArrayRecord] | None = None
        self.book = ClusterState(k)  # members, sizes, history (the checkpoint's too)
        self._pending: dict[int, tuple[int, str, float]] | None = None  # node -> choice

    # -- public helpers -------------------------------------------------------------
    def tables(self) -> dict[str, list[dict]]:
        """Per-client records for the run directory: every assignment, every round."""
        return {"clusters.csv": self.history}

    @property
    def history(self) -> list[dict]:
        """One row per sampled client per round (:data:`state.HISTORY_COLUMNS`)."""
        return self.book.history

    def largest_cluster(self) -> int:
        """Index of the largest cluster of the last aggregated round (ties: lowest)."""
        return self.book.largest()

    def state(self) -> dict:
        """Everything but the models, JSON-serialisable (NaN scores become null)."""
        rules = {"k": self.k, "assign": self.assign, "space": self.space}
        rules |= {"update": self.update, "init": self.init, "seed": self.seed}
        return {**rules, **self.book.to_json(), "rng": self.rng.bit_generator.state}

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generator, the K models, their history and the last round's sizes."""
        return {
            "rng": self.rng.bit_generator.state,
            "models": self.models,
            **self.book.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.models = state["models"]
        self.book.load_state_dict(state)

    def client_state_dict(self) -> dict[str, dict[int, Any]]:
        """Each client's last upload and cluster, by node id."""
        return self.book.client_state_dict()

    def load_client_state_dict(self, state: Mapping[str, dict[int, Any]]) -> None:
        """Restore :meth:`client_state_dict` (keyed by this run's node ids)."""
        self.book.load_client_state_dict(state)

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        for line in describe_rules(self.k, self.assign, self.space, self.update, self.init):
            log(INFO, "\t├──> %s", line)
        log(INFO, "\t└──> Sampling (seed %d):", self.seed)
        log(
            INFO,
            "\t\t├──Fraction: train (%.2f) | evaluate (%.2f)",
            self.fraction_train,
            self.fraction_evaluate,
        )
        log(
            INFO,
            "\t\t├──Minimum nodes: train (%d) | evaluate (%d)",
            self.min_train_nodes,
            self.min_evaluate_nodes,
        )
        log(INFO, "\t\t└──Minimum available nodes: %d", self.min_available_nodes)

    # -- training -------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes, assign each one of the K models, send it that model."""
        self._pending = None
        if self.fraction_train == 0.0:
            return []
        nodes = self._sample(grid, self.fraction_train, self.min_train_nodes)
        self.start_models(arrays)
        assert self.models is not None
        models_flat = self._flat_models()
        if self.assign == "l2":
            choices = assign_l2(nodes, models_flat, self.book.uploads, self.rng)
        else:
            choices = assign_loss(
                server_round, nodes, self.models, models_flat, grid, self.rng, self.query_timeout
            )
        self._pending = choices
        counts = np.bincount([c[0] for c in choices.values()], minlength=self.k)
        log(INFO, "configure_train: %d nodes, per model %s", len(nodes), counts.tolist())
        return [
            cluster_message(node, k, self.models[k], config, server_round, True)
            for node, (k, _, _) in choices.items()
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Each model becomes the mean of its cluster of the valid uploads: a k-means
        cluster matched to it, or (``update="assignment"``) its assignees'."""
        pending, self._pending = self._pending, None
        if pending is None or self.models is None:
            return None, None
        valid = self._valid_uploads(replies, pending)
        if not valid:
            log(WARNING, "Clustered round %d: no valid reply, models unchanged", server_round)
            self.book.record(server_round, pending, {})
            return None, None
        nodes = sorted(valid)
        points = np.stack([flatten(valid[n][0]) for n in nodes])
        assigned = [pending[n][0] for n in nodes]
        if self.update == "assignment":
            to_model = np.asarray(assigned)
        else:
            seed = kmeans_seed(self.seed, server_round)
            to_model = kmeans_models(points, assigned, self._flat_models(), self.space, seed)
        matched = dict(zip(nodes, to_model.tolist(), strict=True))
        for k in set(matched.values()):
            members = [valid[n][0] for n in nodes if matched[n] == k]
            self.models[k] = to_record(self.models[k], mean_arrays(members))
        self.book.end_round(server_round, pending, matched, dict(zip(nodes, points, strict=True)))
        metrics = weighted_metrics([valid[n][1] for n in nodes])
        metrics.update(self.book.round_metrics(pending, matched))
        log(INFO, "aggregate_train: cluster sizes %s", self.book.sizes)
        return self.models[self.largest_cluster()], metrics

    def set_distinct_models(self, models: list[ArrayRecord]) -> None:
        """Models 1..K-1 to start from under ``init="distinct"`` (model 0 is the one the
        first round is given); each with the keys and shapes of the others."""
        if self.init != "distinct":
            raise ValueError(f"distinct initial models need init = 'distinct', not {self.init!r}")
        if len(models) != self.k - 1:
            raise ValueError(f"K = {self.k} needs {self.k - 1} distinct models, got {len(models)}")
        self._distinct = [copy_record(m) for m in models]

    def start_models(self, arrays: ArrayRecord) -> None:
        """The K global models, unless there are models already: K copies of ``arrays``,
        or (``init="distinct"``) ``arrays`` and the K-1 distinct models."""
        if self.models is not None:
            return
        if self.init == "shared":
            self.models = [copy_record(arrays) for _ in range(self.k)]
            return
        if self._distinct is None:
            raise ValueError(
                "init = 'distinct' needs models 1..K-1 before round 1 (set_distinct_models)"
            )
        for k, model in enumerate(self._distinct, start=1):
            try:
                arrays_of(model, arrays)  # the same keys, shapes and dtypes, all finite
            except InvalidReply as err:
                raise ValueError(f"distinct initial model {k}: {err}") from None
        self.models = [copy_record(arrays), *self._distinct]

    def take_private_models(
        self,
        server_round: int,
        models: list[ArrayRecord],
        valid: dict[int, tuple[int, list[np.ndarray]]],
    ) -> None:
        """End a round whose K models a DP wrapper released
        (:mod:`strategies.mechanisms.clustered_dp`): no k-means; ``valid`` maps each node
        whose update entered to (its assigned model, its upload), which the next ``l2``
        assignment reads."""
        pending, self._pending = self._pending, None
        self.models = list(models)
        matched = {node: k for node, (k, _) in valid.items()}
        points = {node: flatten(upload) for node, (_, upload) in valid.items()}
        self.book.end_round(server_round, pending or {}, matched, points)

    # -- evaluation -----------------------------------------------------------------
    def evaluation_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes the evaluation round samples (seeded)."""
        return self._connected(grid, self.min_evaluate_nodes)

    def evaluation_messages(
        self, nodes: list[int], arrays: ArrayRecord, config: ConfigRecord, server_round: int
    ) -> list[Message]:
        """Each sampled node evaluates the model of its last cluster (else the largest)."""
        models = self.models or [arrays]  # before round 1: the one model there is
        largest = self.largest_cluster()
        messages = []
        for node in nodes:
            k = self.book.clusters.get(node, largest) if self.models else 0
            messages.append(cluster_message(node, k, models[k], config, server_round, False))
        return messages

    def evaluation_metrics(self, server_round: int, replies: list[Message]) -> MetricRecord | None:
        """num-examples-weighted mean of the valid replies' metrics."""
        records = []
        for message in replies:
            try:
                records.append(checked_metrics(message))
            except InvalidReply as err:
                node = message.metadata.src_node_id
                log(WARNING, "Clustered: evaluate reply of node %d skipped: %s", node, err)
        return weighted_metrics(records) if records else None

    # -- internals ------------------------------------------------------------------
    def _connected(self, grid: Grid, minimum: int) -> list[int]:
        return nodes_for_round(
            grid,
            self.partitions,
            min_available=self.min_available_nodes,
            min_sample=minimum,
            timeout=self.query_timeout,
        )

    def _sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        nodes = self._connected(grid, minimum)
        return seeded_sample(nodes, fraction, minimum, self.rng, self.partitions)

    def _valid_uploads(
        self, replies: Iterable[Message], pending: dict[int, tuple[int, str, float]]
    ) -> dict[int, tuple[list[np.ndarray], MetricRecord]]:
        assert self.models is not None  # aggregate_train checked
        valid = {}
        for message in self.partitions.sort_replies(replies):
            node = message.metadata.src_node_id
            try:
                if node not in pending or node in valid:
                    raise InvalidReply("not sent a model this round, or a second reply")
                metrics = checked_metrics(message)
                reference = self.models[pending[node][0]]
                valid[node] = (arrays_of(message.content.get(keys.ARRAYS), reference), metrics)
            except InvalidReply as err:
                log(WARNING, "Clustered: train reply of node %d skipped: %s", node, err)
        return valid

    def _flat_models(self) -> np.ndarray:
        assert self.models is not None
        return np.stack([flatten(arrays_of(m)) for m in self.models])
