"""Clustered FedAvg: K global models, updated by k-means over the clients' uploads or
by each client's assignment (IFCA).

The clustered FL of the federated-RL study ("Clustered Federated Learning",
``cluster_and_average_models`` and ``find_closest_model``), with the loss-based
assignment of IFCA (Ghosh et al. 2020, "An Efficient Framework for Clustered Federated
Learning", arXiv:2006.04088).

Design notes: ``docs/notes.md``, ``strategies.algorithms.clustered``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from config.settings import Choice, Settings, SettingsError, listed, setting
from protocol import keys
from protocol.keys import cluster_model_key, cluster_score_key
from protocol.records import InvalidReply, arrays_of, copy_record, to_record
from protocol.replies import checked_metrics, metrics_of
from strategies.mechanisms.base import DPSettings
from strategies.runtime.aggregation import weighted_metrics
from strategies.runtime.evaluation import PartitionOrderedEvaluation
from strategies.runtime.messaging import send_and_receive, size_screen
from strategies.runtime.nodes import nodes_for_round
from strategies.runtime.partitions import PartitionMap
from strategies.runtime.sampling import seeded_sample

_STREAM = 0xC1  # the strategy's generator: sampling and random assignment
_KMEANS_STREAM = 0xC2  # k-means initialisation, one seed per round
_INIT_STREAM = 0xC3  # init="distinct": the weight seeds of models 1..K-1

ASSIGN_RULES = ("l2", "loss")
SPACES = ("weights", "directions")
UPDATE_RULES = ("kmeans", "assignment")
INIT_RULES = ("shared", "distinct")
QUERY_TYPE = f"{MessageType.EVALUATE}.{keys.CLUSTER_QUERY}"  # "evaluate.cluster"
# One history row per sampled client per round: the model it trained from, the
# cluster its upload fell into (-1: invalid reply), how it was assigned and the
# distance or score that decided it (NaN when drawn at random).
HISTORY_COLUMNS = ("round", "node-id", "assigned", "cluster", "how", "score")


def flatten(arrays: list[np.ndarray]) -> np.ndarray:
    """All arrays, in order, as one float64 vector."""
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def pick_lowest(scores: np.ndarray, rng: np.random.Generator) -> tuple[int, str | None]:
    """The index of the lowest score; ties are drawn uniformly from ``rng``.

    Returns (index, None) for a unique minimum and (index, "random") for a tie.
    """
    tied = np.flatnonzero(scores == scores.min())
    if len(tied) == 1:
        return int(tied[0]), None
    return int(rng.choice(tied)), "random"


def query_scores(reply: Message | None, k: int) -> np.ndarray:
    """The K scores of a query reply, or InvalidReply (none, error, missing, non-finite)."""
    if reply is None:
        raise InvalidReply("no reply to the cluster query")
    if reply.has_error():
        raise InvalidReply(f"error reply: {reply.error.reason}")
    metrics = metrics_of(reply)
    scores = []
    for i in range(k):
        value = metrics.get(cluster_score_key(i))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidReply(f"'{cluster_score_key(i)}' missing or not a number")
        if not math.isfinite(value):
            raise InvalidReply(f"'{cluster_score_key(i)}' = {value} is not finite")
        scores.append(float(value))
    return np.asarray(scores)


def kmeans_labels(points: np.ndarray, n_clusters: int, random_state: int) -> np.ndarray:
    """k-means labels of ``points`` (rows), n_init=10; a cluster may come out empty."""
    # Imported on use: every ServerApp imports this module through the strategy
    # registry, and sklearn.cluster costs ~0.1 s (bench/BENCHMARKS.md, start-up).
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():  # fewer distinct points than clusters: handled below
        warnings.simplefilter("ignore", ConvergenceWarning)
        kmeans = KMeans(n_clusters=n_clusters, n_init=10, random_state=random_state)
        return kmeans.fit_predict(points)


def match_to_models(points: np.ndarray, labels: np.ndarray, models: np.ndarray) -> np.ndarray:
    """The global model index of every point: each non-empty cluster is matched to one
    model (rows of ``models``), minimising the total squared centroid-model distance."""
    present = np.unique(labels)
    centroids = np.stack([points[labels == c].mean(axis=0) for c in present])
    cost = np.stack([((centroids - m) ** 2).sum(axis=1) for m in models], axis=1)
    return _matched(labels, present, cost)


def unit_rows(points: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm; a zero row (a client that did not move) stays 0."""
    norms = np.linalg.norm(points, axis=1, keepdims=True)
    return np.divide(points, norms, out=np.zeros_like(points), where=norms > 0)


def match_by_members(labels: np.ndarray, assigned: np.ndarray, k: int) -> np.ndarray:
    """The global model index of every point: each non-empty cluster is matched to one
    of the ``k`` models, maximising how many points keep the model they trained from
    (``assigned``). Ties are broken by scipy's solver, the same way for the same input."""
    present = np.unique(labels)
    counts = np.stack([np.bincount(assigned[labels == c], minlength=k) for c in present])
    return _matched(labels, present, -counts)


def _matched(labels: np.ndarray, present: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Each label's model under the Hungarian assignment of minimum total ``cost``
    (rows: the ``present`` labels, columns: the models)."""
    from scipy.optimize import linear_sum_assignment  # on use, as KMeans above

    rows, cols = linear_sum_assignment(cost)
    to_model = {int(present[r]): int(c) for r, c in zip(rows, cols, strict=True)}
    return np.asarray([to_model[int(label)] for label in labels])


def model_seeds(seed: int, k: int) -> list[int]:
    """The weight seeds of models 1..K-1 under ``init="distinct"`` (model 0 is the run's
    initial model, drawn from ``seed`` itself): one stream per run seed, so a run and
    its rerun start from the same K models."""
    states = np.random.SeedSequence([seed, _INIT_STREAM]).generate_state(k - 1)
    return [int(s) for s in states]


def mean_arrays(uploads: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The unweighted float64 mean of the uploads, array by array."""
    return [
        np.mean(np.stack([np.asarray(a, dtype=np.float64) for a in parts]), axis=0)
        for parts in zip(*uploads, strict=True)
    ]


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
        ``"kmeans"`` (the seed's rule) or ``"assignment"`` (IFCA: each model the mean
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
        if k < 1:
            raise ValueError(f"k = {k} must be at least 1")
        if assign not in ASSIGN_RULES:
            raise ValueError(f"assign = {assign!r}; valid values: {ASSIGN_RULES}")
        if space not in SPACES:
            raise ValueError(f"space = {space!r}; valid values: {SPACES}")
        if update not in UPDATE_RULES:
            raise ValueError(f"update = {update!r}; valid values: {UPDATE_RULES}")
        if init not in INIT_RULES:
            raise ValueError(f"init = {init!r}; valid values: {INIT_RULES}")
        if update == "assignment" and space != "weights":
            raise ValueError(
                f"space = {space!r} has no effect with update = 'assignment' (no k-means "
                "runs); valid value: 'weights'"
            )
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
        self.history: list[dict] = []
        self._uploads: dict[int, np.ndarray] = {}  # node -> its last valid upload, flat
        self._clusters: dict[int, int] = {}  # node -> its last (matched) cluster
        self._sizes = [0] * k  # cluster sizes of the last aggregated round
        self._round = 0  # the last aggregated round
        self._pending: dict[int, tuple[int, str, float]] | None = None  # node -> choice

    # -- public helpers -------------------------------------------------------------
    def tables(self) -> dict[str, list[dict]]:
        """Per-client records for the run directory: every assignment, every round."""
        return {"clusters.csv": self.history}

    def largest_cluster(self) -> int:
        """Index of the largest cluster of the last aggregated round (ties: lowest)."""
        return int(np.argmax(self._sizes))

    def state(self) -> dict:
        """Everything but the models, JSON-serialisable (NaN scores become null)."""
        history = [
            {**row, "score": None if math.isnan(row["score"]) else row["score"]}
            for row in self.history
        ]
        return {
            "k": self.k,
            "assign": self.assign,
            "space": self.space,
            "update": self.update,
            "init": self.init,
            "seed": self.seed,
            "round": self._round,
            "cluster-sizes": list(self._sizes),
            "largest-cluster": self.largest_cluster(),
            "node-clusters": {str(n): c for n, c in sorted(self._clusters.items())},
            "history": history,
            "rng": self.rng.bit_generator.state,
        }

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generator, the K models, their history and the last round's sizes."""
        return {
            "rng": self.rng.bit_generator.state,
            "models": self.models,
            "history": self.history,
            "sizes": self._sizes,
            "round": self._round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.models, self.history = state["models"], state["history"]
        self._sizes, self._round = state["sizes"], state["round"]

    def client_state_dict(self) -> dict[str, dict[int, Any]]:
        """Each client's last upload and cluster, by node id."""
        return {"uploads": self._uploads, "clusters": self._clusters}

    def load_client_state_dict(self, state: Mapping[str, dict[int, Any]]) -> None:
        """Restore :meth:`client_state_dict` (keyed by this run's node ids)."""
        self._uploads, self._clusters = state["uploads"], state["clusters"]

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        log(INFO, "\t├──> Clustered FedAvg: K = %d global models", self.k)
        start = {"shared": "one initial model", "distinct": "K distinct initial models"}
        log(INFO, "\t├──> Start: %s", start[self.init])
        rule = {"l2": "closest to last upload (L2)", "loss": "lowest client score (IFCA)"}
        log(INFO, "\t├──> Assignment: %s; ties and unseen clients at random", rule[self.assign])
        if self.update == "assignment":
            log(INFO, "\t├──> Update: each model the mean of its assignees' uploads (IFCA)")
        else:
            space = {"weights": "the uploads", "directions": "unit update directions"}
            log(
                INFO,
                "\t├──> Update: k-means (n_init=10) on %s, clusters matched to models, mean",
                space[self.space],
            )
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
        if self.assign == "l2":
            choices = self._assign_l2(nodes)
        else:
            choices = self._assign_loss(server_round, nodes, grid)
        self._pending = choices
        counts = np.bincount([c[0] for c in choices.values()], minlength=self.k)
        log(INFO, "configure_train: %d nodes, per model %s", len(nodes), counts.tolist())
        return [
            self._message(node, k, self.models[k], config, server_round, True)
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
            self._record(server_round, pending, {})
            return None, None
        nodes = sorted(valid)
        points = np.stack([flatten(valid[n][0]) for n in nodes])
        assigned = [pending[n][0] for n in nodes]
        if self.update == "assignment":
            to_model = np.asarray(assigned)
        else:
            to_model = self._cluster(server_round, points, assigned)
        matched = dict(zip(nodes, to_model.tolist(), strict=True))
        for k in set(matched.values()):
            members = [valid[n][0] for n in nodes if matched[n] == k]
            self.models[k] = to_record(self.models[k], mean_arrays(members))
        for node, point in zip(nodes, points, strict=True):
            self._uploads[node], self._clusters[node] = point, matched[node]
        self._sizes = np.bincount(list(matched.values()), minlength=self.k).tolist()
        self._round = server_round
        self._record(server_round, pending, matched)
        metrics = weighted_metrics([valid[n][1] for n in nodes])
        metrics.update(self._round_metrics(pending, matched))
        log(INFO, "aggregate_train: cluster sizes %s", self._sizes)
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
        for node, (k, upload) in valid.items():
            self._uploads[node], self._clusters[node] = flatten(upload), k
        self._sizes = np.bincount(list(matched.values()), minlength=self.k).tolist()
        self._round = server_round
        self._record(server_round, pending or {}, matched)

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
            k = self._clusters.get(node, largest) if self.models else 0
            messages.append(self._message(node, k, models[k], config, server_round, False))
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

    def _random(self) -> tuple[int, str, float]:
        return int(self.rng.integers(self.k)), "random", math.nan

    def _assign_l2(self, nodes: list[int]) -> dict[int, tuple[int, str, float]]:
        models_flat = self._flat_models()
        choices = {}
        for node in nodes:
            if node not in self._uploads:
                choices[node] = self._random()
                continue
            distances = np.linalg.norm(models_flat - self._uploads[node], axis=1)
            k, tie = pick_lowest(distances, self.rng)
            choices[node] = (k, "random", math.nan) if tie else (k, "l2", float(distances[k]))
        return choices

    def _assign_loss(
        self, server_round: int, nodes: list[int], grid: Grid
    ) -> dict[int, tuple[int, str, float]]:
        models_flat = self._flat_models()
        if (models_flat == models_flat[0]).all():
            return {node: self._random() for node in nodes}  # nothing to tell apart
        models = self.models
        assert models is not None  # started by configure_train
        config = {keys.SERVER_ROUND: server_round, keys.CLUSTER_K: self.k}
        queries = [
            Message(
                content=RecordDict(
                    {
                        keys.CONFIG: ConfigRecord({**config}),
                        **{cluster_model_key(k): m for k, m in enumerate(models)},
                    }
                ),
                dst_node_id=node,
                message_type=QUERY_TYPE,
                group_id=str(server_round),
            )
            for node in nodes
        ]
        replies = {
            m.metadata.src_node_id: m
            for m in send_and_receive(
                grid, queries, timeout=self.query_timeout, screen=size_screen(queries)
            )
        }
        choices = {}
        for node in nodes:
            try:
                scores = query_scores(replies.get(node), self.k)
            except InvalidReply as err:
                log(WARNING, "Clustered: node %d gets a random model: %s", node, err)
                choices[node] = self._random()
                continue
            k, tie = pick_lowest(scores, self.rng)
            choices[node] = (k, "random", math.nan) if tie else (k, "loss", float(scores[k]))
        return choices

    @staticmethod
    def _message(
        node: int, k: int, model: ArrayRecord, config: ConfigRecord, server_round: int, train: bool
    ) -> Message:
        """A train or evaluate message with its own copy of ``model`` and config."""
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

    def _cluster(self, server_round: int, points: np.ndarray, assigned: list[int]) -> np.ndarray:
        """The model index each upload (a row of ``points``) is averaged into."""
        n_clusters, seed = min(self.k, len(points)), self._kmeans_seed(server_round)
        models_flat = self._flat_models()
        if self.space == "weights":
            return match_to_models(points, kmeans_labels(points, n_clusters, seed), models_flat)
        assigned_ = np.asarray(assigned)
        directions = unit_rows(points - models_flat[assigned_])
        # k-means on unit vectors: the Euclidean distance between two of them is
        # sqrt(2 - 2 cos), so it splits on the cosine (scikit-learn has no spherical k-means).
        return match_by_members(kmeans_labels(directions, n_clusters, seed), assigned_, self.k)

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

    def _record(self, server_round: int, pending: dict, matched: dict[int, int]) -> None:
        for node, (k, how, score) in sorted(pending.items()):
            row = (server_round, int(node), k, matched.get(node, -1), how, score)
            self.history.append(dict(zip(HISTORY_COLUMNS, row, strict=True)))

    def _round_metrics(self, pending: dict, matched: dict[int, int]) -> dict[str, int]:
        assigned = np.bincount([k for k, _, _ in pending.values()], minlength=self.k)
        metrics = {f"cluster-{k}-size": self._sizes[k] for k in range(self.k)}
        metrics |= {f"assigned-{k}": int(assigned[k]) for k in range(self.k)}
        metrics["clusters-changed"] = sum(matched[n] != pending[n][0] for n in matched)
        return metrics

    def _flat_models(self) -> np.ndarray:
        assert self.models is not None
        return np.stack([flatten(arrays_of(m)) for m in self.models])

    def _kmeans_seed(self, server_round: int) -> int:
        sequence = np.random.SeedSequence([self.seed, _KMEANS_STREAM, server_round])
        return int(sequence.generate_state(1)[0])


# Privacy under which clustered FedAvg stays sound: under local noise every client's
# upload is itself private, so k-means over uploads is post-processing; under DP-FedAvg
# there is no k-means: each client's update enters the private mean of the model it
# was assigned by its own data (strategies.mechanisms.clustered_dp), one Gaussian per round.
CLUSTERED_PRIVACY = ("none", "laplace", "dp-sgd", "dp-fedavg-fixed", "dp-fedavg-adaptive")
CENTRAL_CLUSTERED = ("dp-fedavg-fixed", "dp-fedavg-adaptive")


@dataclass(frozen=True)
class ClusterSettings(Settings):
    """Clustered FedAvg's run-config keys (``cluster.*``)."""

    PREFIX: ClassVar[str] = "cluster"
    k: int = setting(
        3,
        "Clustered FedAvg: number K of global models.",
        low=1,
    )
    assign: str = setting(
        "l2",
        "Clustered FedAvg: how a client picks its model: `l2` (closest weights to its"
        " last upload, the seed's rule) or `loss` (best local evaluation, IFCA).",
        choices=ASSIGN_RULES,
    )
    space: str = setting(
        "weights",
        "Clustered FedAvg: what k-means clusters each round: `weights` (the uploaded"
        " weights, the seed's rule) or `directions` (each update's unit direction, the"
        " cosine of clustered FL; clients that move farther in the same direction, e.g."
        " with more local steps, stay together).",
        choices=SPACES,
    )
    update: str = setting(
        "kmeans",
        "Clustered FedAvg: how the K models are updated each round: `kmeans` (k-means"
        " over the uploads, clusters matched to the models, the seed's rule) or"
        " `assignment` (each model the mean of the uploads of the clients assigned to it,"
        " IFCA). Under DP-FedAvg no k-means runs: always by assignment.",
        choices=UPDATE_RULES,
    )
    init: str = setting(
        "shared",
        "Clustered FedAvg: what the K models start as: `shared` (K copies of the run's"
        " initial model, the seed's rule) or `distinct` (model 0 the run's initial model,"
        " model k the task's model drawn from its own seed, derived from `seed`; IFCA's"
        " random initialisation, so a loss-based assignment can tell them apart in"
        " round 1).",
        choices=INIT_RULES,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """The privacy settings under which clustering stays sound."""
        if choice.strategy != "clustered":
            return
        cluster = choice.part(ClusterSettings)
        if choice.privacy not in CLUSTERED_PRIVACY:
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} cannot protect 'strategy' = 'clustered': "
                "valid values with clustered: " + listed(CLUSTERED_PRIVACY)
            )
        if cluster.update == "assignment" and cluster.space != "weights":
            raise SettingsError(
                f"'cluster.space' = {cluster.space!r} has no effect with "
                "'cluster.update' = 'assignment': no k-means runs there (each model is the "
                "mean of its assignees' uploads); valid value: 'weights'"
            )
        if cluster.init == "distinct" and choice.warm_start > 0:
            raise SettingsError(
                "'cluster.init' = 'distinct' draws models 1..K-1 afresh, which would skip "
                f"'subspace.warm-start' = {choice.warm_start}; valid "
                "values with a warm start: 'shared'"
            )
        if choice.privacy in CENTRAL_CLUSTERED:
            if cluster.space != "weights":
                raise SettingsError(
                    f"'cluster.space' = {cluster.space!r} has no effect with "
                    f"'privacy' = {choice.privacy!r}: no k-means runs there (each client's "
                    "update enters the private mean of the model it was assigned); "
                    "valid value: 'weights'"
                )
            if choice.part(DPSettings).noise_site != "server":
                raise SettingsError(
                    f"'strategy' = 'clustered' with 'privacy' = {choice.privacy!r} needs "
                    "'dp.noise-site' = 'server': the server assigns each client a model from "
                    "its raw scores or upload, so no guarantee could hold against it"
                )
            return
        if choice.privacy != "none" and cluster.assign == "loss":
            raise SettingsError(
                "'cluster.assign' = 'loss' lets each client release which model fits its data "
                f"best, which no mechanism protects; with 'privacy' = {choice.privacy!r} use "
                "'cluster.assign' = 'l2' (assignment from the already private uploads)"
            )
