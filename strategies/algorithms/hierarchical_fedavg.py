"""Hierarchical FedAvg (HierFAVG): client -> edge -> cloud on Flower's Message API.

The topology of front-loaded DP for hierarchical FL ("Aggregation", "Topology /
Participation"), after HierFL (Liu et al. 2020, "Client-Edge-Cloud Hierarchical
Federated Learning", arXiv:1905.06641). Edges are logical groups of SuperNodes kept by
the server. One cloud round is ``tau_2`` edge aggregations (each: a fresh sample of every
participating edge's clients trains ``tau_1`` local updates from the edge model), then a
weighted FedAvg of the edge models. In CP-NP the clients send noisy deltas and an edge
adds their weighted mean, scaled by the edge learning rate ``eta``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.app.typing import MetricRecordValues
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from config.settings import Choice, Settings, SettingsError, listed, setting
from privacy.mechanisms import FRONT_LOADED_MODES
from protocol import keys
from protocol.records import InvalidReply, arrays_of, as_float, copy_record, to_record
from protocol.replies import checked_metrics, is_number
from strategies.algorithms.edge_membership import (  # noqa: F401 (QUERY_TYPE: the tests)
    QUERY_TYPE,
    EdgeMembership,
)
from strategies.mechanisms.base import DPSettings
from strategies.runtime.aggregation import weighted_metrics
from strategies.runtime.evaluation import PartitionOrderedEvaluation
from strategies.runtime.messaging import send_and_receive, size_screen
from strategies.runtime.partitions import (
    PartitionMap,
    nodes_for_round,
    sample_uniform,
    wait_for_nodes,
)

_STREAM = 0x4E  # edge and client sampling
_EVAL_STREAM = 0x4F  # federated evaluation sampling (independent of training's)

# One row per (cloud round, edge aggregation, node sent a train message).
TABLE_COLUMNS: tuple[str, ...] = ("round", "edge-round", "edge-id", "node-id", "partition-id")
TABLE_COLUMNS += ("num-examples", "replied-ok", "train-loss", "reason")

EdgeHook = Callable[[int, int, dict[int, tuple[int, int]]], None]
Sample = dict[int, tuple[list[int], int]]  # edge -> (sampled nodes, edge size)


# -- pure helpers ----------------------------------------------------------------------
def weighted_average(arrays_list: list[list[np.ndarray]], weights: list[float]) -> list:
    """``sum_i w_i a_i / sum_i w_i`` array by array, in float64 (weights sum > 0)."""
    w = np.asarray(weights, dtype=np.float64)
    if not w.sum() > 0:
        raise ValueError(f"weights {weights} must sum to a positive number")
    parts = zip(*arrays_list, strict=True)
    stacks = (np.stack([np.asarray(a, np.float64) for a in arrays]) for arrays in parts)
    return [np.tensordot(w, stack, axes=1) / w.sum() for stack in stacks]


def apply_deltas(
    model: list[np.ndarray], deltas: list[list[np.ndarray]], weights: list[float], eta: float
) -> list[np.ndarray]:
    """frontloaded-dp-hfl's CP-NP edge update ``w + eta * sum_i n_i dw_i / sum_i n_i`` (float64);
    non-floating arrays (e.g. BatchNorm's step counter) are kept, as in its
    ``average_weights_edge``."""
    mean = weighted_average(deltas, weights)
    return [
        np.asarray(w, dtype=np.float64) + eta * d
        if np.issubdtype(np.asarray(w).dtype, np.floating)
        else np.asarray(w)
        for w, d in zip(model, mean, strict=True)
    ]


def sample_size(population: int, fraction: float) -> int:
    """``int(population * fraction)``, at least 1 and at most ``population``."""
    return max(1, min(population, int(population * fraction + 1e-9)))


def sample_edges(edges: list[int], fraction: float, rng: np.random.Generator) -> list[int]:
    """``fraction`` of ``edges`` (at least one), uniform without replacement, sorted
    (edge ids are not node ids: drawn over ascending ids)."""
    return sample_uniform(edges, sample_size(len(edges), fraction), rng) if edges else []


def _message(node: int, content: RecordDict, kind: str, server_round: int) -> Message:
    return Message(content, dst_node_id=node, message_type=kind, group_id=str(server_round))


@dataclass
class _CloudRound:
    """What one cloud round accumulates between configure_train and aggregate_train."""

    server_round: int
    cloud: ArrayRecord
    config: ConfigRecord
    connected: set[int]
    edges: list[int] = field(default_factory=list)  # participating edges
    weights: dict[int, float] = field(default_factory=dict)  # edge -> sum of num-examples
    records: dict[int, list[MetricRecord]] = field(default_factory=dict)  # valid replies
    pending: Sample = field(default_factory=dict)  # the sample of edge aggregation tau_2
    failed: int = 0
    failed_queries: int = 0


class HierarchicalFedAvg(PartitionOrderedEvaluation, FedAvg):
    """HierFAVG: ``tau_2`` edge aggregations per cloud round, then FedAvg over the edges.

    The client contract and its rationale: ``docs/notes.md``,
    ``strategies.algorithms.hierarchical_fedavg``.

    Parameters
    ----------
    fraction_evaluate, min_evaluate_nodes, min_available_nodes :
        FedAvg's evaluation of the cloud model (sampled from ``seed``); nodes needed
        before a cloud round starts (else StopTraining after ``timeout``).
    num_edges, edge_rounds, local_updates, client_fraction, edge_fraction :
        E, tau_2, tau_1 (sent to the clients), cfrac (of an edge's connected nodes, per
        edge aggregation) and efrac (of the edges with members, per cloud round); at
        least one each, uniformly with the generator derived from ``seed``.
    delta_updates, eta :
        Clients send deltas (CP-NP); an edge adds ``eta`` times their weighted mean.
    timeout : float
        Seconds to wait for enough nodes and for the replies of in-round messages.
    client_config : dict
        Extra entries of every train config (e.g. the DP mode, clip and sigma).
    on_edge_aggregation, before_edge_aggregation : callable, optional
        Called as ``(server_round, k, {edge: (sampled, size)})`` after edge aggregation k,
        and before its messages are sent (a privacy ledger may refuse there: StopTraining).
    """

    MODEL_LABEL = "edge"
    # Registrations are not carried: nodes are asked again (their ids change). Edge
    # models restart from the cloud model every round, but the committed round's are
    # evaluated again when a run resumes.

    def __init__(
        self,
        fraction_evaluate: float = 1.0,
        min_evaluate_nodes: int = 2,
        *,
        num_edges: int,
        edge_rounds: int,
        local_updates: int,
        client_fraction: float,
        edge_fraction: float = 1.0,
        delta_updates: bool = False,
        eta: float = 1.0,
        seed: int,
        timeout: float = 600.0,
        client_config: dict | None = None,
        on_edge_aggregation: EdgeHook | None = None,
        before_edge_aggregation: EdgeHook | None = None,
        min_available_nodes: int = 2,
        partitions: PartitionMap | None = None,
    ) -> None:
        _validate(num_edges, edge_rounds, local_updates, client_fraction, edge_fraction, eta)
        super().__init__(
            fraction_train=client_fraction,  # only shown by FedAvg's summary
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=1,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
        )
        self.num_edges, self.edge_rounds = num_edges, edge_rounds
        self.local_updates, self.seed = local_updates, seed
        self.client_fraction, self.edge_fraction = client_fraction, edge_fraction
        self.delta_updates, self.eta = delta_updates, eta
        self.timeout, self.client_config = timeout, dict(client_config or {})
        self.on_edge_aggregation = on_edge_aggregation
        self.before_edge_aggregation = before_edge_aggregation
        self.on_replies: Callable[[int, list[Message]], None] | None = None
        # CP-NP under DP (set by strategies.mechanisms.frontloaded_clients): what a sampled
        # client that failed counts as (a noised zero delta drawn by the server); every sampled
        # client then weighs 1, and an edge averages over all it sampled.
        self.failed_upload: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None
        # The run's node -> partition map; the edge query fills it (no partition query).
        self.partitions = partitions if partitions is not None else PartitionMap()
        self.edges = EdgeMembership(num_edges, self.partitions, timeout)
        self.registrations = self.edges.registrations  # node -> its edge query answer
        self.rng = np.random.default_rng([seed, _STREAM])
        self.eval_rng = np.random.default_rng([seed, _EVAL_STREAM])
        self.models: list[ArrayRecord] = []  # edge models, index = edge id (from round 1)
        self.rows: list[dict] = []  # the edges.csv table
        self._state: _CloudRound | None = None

    # -- public helpers -----------------------------------------------------------------
    def membership(self) -> dict[int, list[int]]:
        """Edge id -> the registered node ids of that edge (sorted; every edge listed)."""
        return self.edges.members()

    def tables(self) -> dict[str, list[dict]]:
        """``edges.csv``: one row per (round, edge aggregation, node sent a train
        message); ``edge-membership.csv``: every registered node's edge, partition and
        training examples."""
        return {"edges.csv": self.rows, "edge-membership.csv": self.edges.table()}

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generators, the edges table and the committed round's edge models."""
        return {
            "rng": self.rng.bit_generator.state,
            "eval-rng": self.eval_rng.bit_generator.state,
            "rows": self.rows,
            "models": self.models,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generators in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.eval_rng.bit_generator.state = state["eval-rng"]
        self.rows, self.models = state["rows"], state["models"]

    def summary(self) -> None:
        """Log the hierarchical settings as a tree, then FedAvg's summary."""
        log(INFO, "\t├──> Hierarchical FedAvg (HierFAVG, seed %d):", self.seed)
        log(INFO, "\t│\t├── Edges: %d", self.num_edges)
        log(INFO, "\t│\t├── Cloud round: %d edge aggregations", self.edge_rounds)
        log(INFO, "\t│\t├── Local updates per edge aggregation: %d", self.local_updates)
        share = (self.edge_fraction, self.client_fraction)
        log(INFO, "\t│\t├── Fraction: edges %.2f | clients per edge %.2f (>= 1)", *share)
        update = f"w + eta * mean delta (eta = {self.eta:g})" if self.delta_updates else "FedAvg"
        log(INFO, "\t│\t├── Edge update: %s", update)
        log(INFO, "\t│\t├── Client config: %s", self.client_config or "(none)")
        log(INFO, "\t│\t└── Timeout: %g s", self.timeout)
        super().summary()

    # -- training -----------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Register new nodes, run edge aggregations 1..tau_2-1, send the last one."""
        self._state = None
        # The edge query (below) reports each node's partition id: no separate query.
        nodes = nodes_for_round(
            grid,
            self.partitions,
            min_available=self.min_available_nodes,
            min_sample=1,
            timeout=self.timeout,
            discover=False,
        )
        nodes = [int(n) for n in nodes]
        cloud = copy_record(arrays)
        state = _CloudRound(server_round, cloud, ConfigRecord(dict(config)), set(nodes))
        state.failed_queries = self.edges.register(server_round, nodes, grid)
        self.models = [cloud] * self.num_edges  # HierFL's cloud.send_to_edge
        active = [e for e, members in self.membership().items() if state.connected & set(members)]
        state.edges = sample_edges(active, self.edge_fraction, self.rng)
        self._state = state
        if not state.edges:
            log(WARNING, "Hierarchical round %d: no edge has a connected member", server_round)
            return []
        log(INFO, "configure_train: edges %s of %d with members", state.edges, len(active))
        for k in range(1, self.edge_rounds):
            sample = self._sample_clients(state)
            self._call(self.before_edge_aggregation, state, k, sample)
            messages = self._train(state, k, sample)
            screen = size_screen(messages)
            replies = send_and_receive(grid, messages, timeout=self.timeout, screen=screen)
            self._aggregate_edges(state, k, sample, replies)
        state.pending = self._sample_clients(state)
        self._call(self.before_edge_aggregation, state, self.edge_rounds, state.pending)
        return self._train(state, self.edge_rounds, state.pending)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Edge aggregation tau_2, then FedAvg of the participating edges' models."""
        state, self._state = self._state, None
        if state is None or not state.edges:
            return None, None
        self._aggregate_edges(state, self.edge_rounds, state.pending, replies)
        edges = [e for e in state.edges if state.weights.get(e, 0.0) > 0]
        if not edges:
            log(WARNING, "Hierarchical round %d: no valid edge aggregation", server_round)
            return None, None
        models = [arrays_of(self.models[e]) for e in edges]
        average = weighted_average(models, [state.weights[e] for e in edges])
        log(INFO, "aggregate_train: cloud = FedAvg of edges %s", edges)
        return to_record(state.cloud, average), self._round_metrics(state)

    def evaluation_nodes(self, grid: Grid) -> list[int] | None:
        """The connected nodes FedAvg's evaluation of the cloud model samples; None (the
        round skipped) when too few are connected."""
        needed = max(self.min_available_nodes, self.min_evaluate_nodes)
        nodes = wait_for_nodes(grid, needed, self.partitions, timeout=self.timeout, discover=False)
        if len(nodes) < needed:
            log(WARNING, "configure_evaluate: too few nodes connected, evaluation skipped")
            return None
        return nodes

    def evaluation_rng(self) -> np.random.Generator:
        """Evaluation samples with its own seeded generator (training's is untouched)."""
        return self.eval_rng

    # -- internals ------------------------------------------------------------------------
    def _sample_clients(self, state: _CloudRound) -> Sample:
        """Edge -> (its sampled connected members, its connected member count)."""
        sample, membership = {}, self.membership()
        for edge in state.edges:
            members = [n for n in membership[edge] if n in state.connected]
            size = sample_size(len(members), self.client_fraction)
            sample[edge] = (sample_uniform(members, size, self.rng, self.partitions), len(members))
        return sample

    def _train(self, state: _CloudRound, k: int, sample: Sample) -> list[Message]:
        """One train message per sampled node: its edge's model and its own config."""
        messages = []
        for edge, (nodes, _) in sample.items():
            extra = {keys.SERVER_ROUND: state.server_round, keys.EDGE_ID: edge}
            extra |= {keys.EDGE_ROUND: k, keys.LOCAL_UPDATES: self.local_updates}
            for node in nodes:
                config = ConfigRecord({**state.config, **self.client_config, **extra})
                content = RecordDict({keys.ARRAYS: self.models[edge], keys.CONFIG: config})
                messages.append(_message(node, content, MessageType.TRAIN, state.server_round))
        return messages

    def _aggregate_edges(
        self, state: _CloudRound, k: int, sample: Sample, replies: Iterable[Message]
    ) -> None:
        """Edge aggregation k of every participating edge, then the privacy hook."""
        replies = list(replies)
        if self.on_replies is not None:  # e.g. clients' reported sample-level epsilons
            self.on_replies(state.server_round, replies)
        by_node: dict[int, Message] = {}
        for reply in replies:
            by_node.setdefault(int(reply.metadata.src_node_id), reply)
        for node in set(by_node) - {n for nodes, _ in sample.values() for n in nodes}:
            log(WARNING, "Hierarchical: reply of node %d ignored: not sent edge round %d", node, k)
        for edge, (nodes, _) in sample.items():
            reference = self.models[edge]
            uploads, weights = self._valid_uploads(state, k, edge, nodes, by_node)
            if not uploads:
                log(WARNING, "Hierarchical: edge %d keeps its model (no valid reply)", edge)
                continue
            if self.delta_updates:
                new = apply_deltas(arrays_of(reference), uploads, weights, self.eta)
            else:
                new = weighted_average(uploads, weights)
            self.models[edge] = to_record(reference, new)
            state.weights[edge] = state.weights.get(edge, 0.0) + float(sum(weights))
        self._call(self.on_edge_aggregation, state, k, sample)

    @staticmethod
    def _call(hook: EdgeHook | None, state: _CloudRound, k: int, sample: Sample) -> None:
        """``hook(server_round, k, {edge: (sampled clients, edge size)})`` if set."""
        if hook is not None:
            hook(state.server_round, k, {e: (len(n), size) for e, (n, size) in sample.items()})

    def _valid_uploads(
        self, state: _CloudRound, k: int, edge: int, nodes: list[int], by_node: dict
    ) -> tuple[list[list[np.ndarray]], list[float]]:
        """The checked arrays and weights of ``nodes``' replies; a table row per node."""
        uploads, weights = [], []
        for node in nodes:
            row = dict.fromkeys(TABLE_COLUMNS, math.nan) | {"replied-ok": False, "reason": ""}
            row |= {"round": state.server_round, "edge-round": k, "edge-id": edge}
            row |= {"node-id": node, "partition-id": self.registrations[node].partition}
            self.rows.append(row)
            try:
                arrays, metrics = _checked_upload(by_node.get(node), self.models[edge])
            except InvalidReply as err:
                state.failed += 1
                row["reason"] = str(err)
                if self.failed_upload is None:
                    log(WARNING, "Hierarchical: train reply of node %d skipped: %s", node, err)
                    continue
                log(WARNING, "Hierarchical: node %d counts as a zero delta: %s", node, err)
                uploads.append(self.failed_upload(arrays_of(self.models[edge])))
                weights.append(1.0)
                continue
            uploads.append(arrays)
            weights.append(1.0 if self.failed_upload else as_float(metrics[keys.NUM_EXAMPLES]))
            state.records.setdefault(edge, []).append(metrics)
            loss = metrics.get(keys.TRAIN_LOSS)
            row |= {"num-examples": weights[-1], "replied-ok": True}
            row["train-loss"] = float(loss) if is_number(loss) else math.nan
        return uploads, weights

    def _round_metrics(self, state: _CloudRound) -> MetricRecord:
        """Weighted train metrics of the round, per-edge counts and losses, failures."""
        every = [r for e in state.edges for r in state.records.get(e, [])]
        metrics: dict[str, MetricRecordValues] = dict(weighted_metrics(every))
        for edge in range(self.num_edges):
            records = state.records.get(edge, [])
            metrics[f"edge-{edge}-clients"] = len(records)
            loss = weighted_metrics(records).get(keys.TRAIN_LOSS)
            if loss is not None:
                metrics[f"edge-{edge}-train-loss"] = loss
        metrics |= {"edges": len(state.edges), "failed-replies": state.failed}
        metrics["failed-queries"] = state.failed_queries
        return MetricRecord(metrics)


def _checked_upload(
    reply: Message | None, reference: ArrayRecord
) -> tuple[list[np.ndarray], MetricRecord]:
    """A train reply's arrays and metrics if it may enter an edge aggregate."""
    if reply is None:
        raise InvalidReply("no reply")
    metrics = checked_metrics(reply)
    if not as_float(metrics[keys.NUM_EXAMPLES]) > 0:
        raise InvalidReply(f"'{keys.NUM_EXAMPLES}' = 0: nothing to weight")
    if len(reply.content.array_records) != 1:
        raise InvalidReply(f"expected exactly one ArrayRecord '{keys.ARRAYS}'")
    return arrays_of(reply.content.get(keys.ARRAYS), reference), metrics


def _validate(*values: float) -> None:
    """ValueError naming the first run-config key out of range and its valid values."""
    num_edges, edge_rounds, local_updates, cfrac, efrac, eta = values
    checks = {
        "hier.num-edges": (num_edges, num_edges >= 1, "an integer >= 1"),
        "hier.edge-rounds": (edge_rounds, edge_rounds >= 1, "an integer >= 1"),
        "hier.local-updates": (local_updates, local_updates >= 1, "an integer >= 1"),
        "hier.client-fraction": (cfrac, 0.0 < cfrac <= 1.0, "in (0, 1]"),
        "hier.edge-fraction": (efrac, 0.0 < efrac <= 1.0, "in (0, 1]"),
        "hier.eta": (eta, 0.0 < eta < math.inf, "a finite number > 0"),
    }
    for key, (value, ok, valid) in checks.items():
        if not ok:
            raise ValueError(f"{key} = {value!r}; valid values: {valid}")


@dataclass(frozen=True)
class HierSettings(Settings):
    """Hierarchical FL's run-config keys (``hier.*``)."""

    PREFIX: ClassVar[str] = "hier"
    num_edges: int = setting(
        2,
        "Hierarchical: edges (groups of SuperNodes).",
        low=1,
    )
    edge_rounds: int = setting(
        2,
        "Hierarchical: edge aggregations per cloud round (tau_2).",
        low=1,
    )
    local_updates: int = setting(
        6,
        "Hierarchical: local iterations per edge aggregation (tau_1; CG modes: epochs"
        " of one step each).",
        low=1,
    )
    client_fraction: float = setting(
        0.2,
        "Hierarchical: share of an edge's clients in each edge aggregation (cfrac).",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    edge_fraction: float = setting(
        1.0,
        "Hierarchical: share of the edges in each cloud round (efrac).",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    eta: float = setting(
        1.0,
        "Hierarchical CP-NP: edge learning rate on the averaged deltas (1: FedAvg).",
        low=0.0,
        low_open=True,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """Front-loaded modes only in the hierarchy, and a task that counts iterations."""
        if choice.strategy != "hierarchical" and choice.privacy not in FRONT_LOADED_MODES:
            return
        if choice.strategy != "hierarchical":
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} is a client mode of hierarchical FL (seed "
                "003); use it with 'strategy' = 'hierarchical'"
            )
        if choice.privacy not in HIERARCHICAL_PRIVACY:
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} is not available with 'strategy' = "
                "'hierarchical'; valid values: " + listed(HIERARCHICAL_PRIVACY)
            )
        if "hierarchical" not in choice.traits:
            raise SettingsError(
                "'strategy' = 'hierarchical' needs a task that trains for a number of local "
                f"iterations; 'task' = {choice.task!r} does not; valid tasks: "
                + listed(choice.tasks_with.get("hierarchical", ()))
            )
        if choice.part(DPSettings).per_example and choice.privacy != "cg-ng":
            raise SettingsError(
                f"'dp.per-example' = true applies to 'privacy' = 'cg-ng' only (got "
                f"{choice.privacy!r}): noise added once to the final parameters (cg-np) has "
                "no sound per-example bound, and cp-np is already client-level"
            )


# The hierarchical strategy takes no other privacy (DP-FedAvg samples clients itself).
HIERARCHICAL_PRIVACY = ("none", *FRONT_LOADED_MODES)
