"""SmartFedProx: FedProx with divergence-aware client selection and adaptive mu.

"FedProx with Smart Client Selection", sections 1-3, on Flower's Message
API. The server keeps, per node, the model divergences ``||w_local - w_global||`` it
reported and their exponential moving average (section 3.3); it selects clients at
random (cold start, exploration, or ``selection="random"``) or by the hybrid rule of
section 1.4 (30 % high, 50 % middle, 20 % low smoothed divergence), and sends each
client the inputs of the adaptive-mu formula of section 3.2, which the client
evaluates (``tasks.adaptive_mu``). Aggregation is FedAvg's, over the valid replies.

Design notes: ``docs/notes.md``, ``strategies.algorithms.smart_fedprox.strategy``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedProx

from config.settings import Choice, Settings, SettingsError, listed, setting
from protocol import keys
from protocol.records import InvalidReply, arrays_of, as_float, to_record
from protocol.replies import checked_metrics, is_number
from strategies.algorithms.smart_fedprox.hybrid_selection import (
    fill_unknown,
    sample_hybrid_groups,
    smoothed_divergence,
)
from strategies.runtime.evaluation import PartitionOrderedEvaluation
from strategies.runtime.partitions import (
    PartitionMap,
    fedavg_sample_size,
    nodes_for_round,
    sample_uniform,
)

_STREAM = 0x5F  # the strategy's one generator: sampling, exploration coin, ties, fills

SELECTIONS = ("random", "hybrid")
# One row per (round, selected node). mode: random | cold-start | exploration | hybrid;
# group: high | middle | low | fill (hybrid), "" otherwise; smoothed-divergence: the value
# ranked (NaN when drawn at random); the last five columns are filled on aggregation.
HISTORY_COLUMNS: tuple[str, ...]
HISTORY_COLUMNS = ("round", "node-id", "mode", "group", "smoothed-divergence", "replied-ok")
HISTORY_COLUMNS += ("divergence", "effective-mu", "train-loss", "reason")


def finite_metric(metrics: MetricRecord, key: str) -> float:
    """``metrics[key]`` as a finite float, or InvalidReply naming the key."""
    value = metrics.get(key)
    if not is_number(value) or not math.isfinite(value):
        raise InvalidReply(f"'{key}' = {value!r} is missing or not a finite number")
    return float(value)


class SmartFedProx(PartitionOrderedEvaluation, FedProx):
    r"""FedProx with hybrid divergence-based selection and per-client adaptive mu (the
    client contract: ``docs/notes.md``, ``strategies.algorithms.smart_fedprox.strategy``).

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, \
    min_available_nodes :
        FedAvg's sampling, drawn with the generator seeded from ``seed``.
    proximal_mu, selection, adaptive_mu
        The base mu (seed: 0.1); ``"random"`` (uniform) or ``"hybrid"`` selection
        (section 1.4); whether clients adapt mu (section 3.2).
    cold_start_rounds, exploration_rate : int, float
        Rounds 1..cold_start_rounds, then with this probability, select at random.
    mu_min, mu_max, local_epochs, ema_alpha : float, float, int, float
        Inputs of the client's adaptive mu and EMA (seed: alpha 0.3).
    seed, connect_timeout
        The run seed (one generator drives every random choice); seconds to wait for
        enough nodes before ending the run (StopTraining).
    sample_size : int, optional
        Exactly this many nodes per training round instead of ``fraction_train``: the m
        a DP wrapper fixes (it divides the clipped sum by m).
    partitions : PartitionMap, optional
        The run's node -> partition map (default: a new one, owned by this strategy).
    """

    # What a client must report under a privacy mechanism (strategies.mechanisms.base): the
    # divergence drives selection and mu, the example count the weighted average.
    REPORTED_METRICS = (keys.NUM_EXAMPLES, keys.DIVERGENCE)

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        proximal_mu: float = 0.1,
        *,
        selection: str,
        adaptive_mu: bool,
        cold_start_rounds: int = 3,
        exploration_rate: float = 0.15,
        mu_min: float,
        mu_max: float,
        local_epochs: int,
        ema_alpha: float = 0.3,
        seed: int,
        sample_size: int | None = None,
        connect_timeout: float = 600.0,
        partitions: PartitionMap | None = None,
    ) -> None:
        settings = dict(selection=selection, cold_start_rounds=cold_start_rounds)
        settings |= dict(exploration_rate=exploration_rate, proximal_mu=proximal_mu)
        settings |= dict(mu_min=mu_min, mu_max=mu_max, local_epochs=local_epochs)
        _validate(**settings, ema_alpha=ema_alpha)
        sampling = (fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes)
        super().__init__(*sampling, min_available_nodes, proximal_mu=proximal_mu)
        self.selection, self.adaptive_mu = selection, adaptive_mu
        self.cold_start_rounds, self.exploration_rate = cold_start_rounds, exploration_rate
        self.mu_min, self.mu_max, self.local_epochs = mu_min, mu_max, local_epochs
        self.ema_alpha, self.seed, self.connect_timeout = ema_alpha, seed, connect_timeout
        if sample_size is not None and sample_size < 1:
            raise ValueError(f"sample_size = {sample_size!r}; valid values: >= 1 or None")
        self.sample_size = sample_size
        self.partitions = partitions if partitions is not None else PartitionMap()
        self.rng = np.random.default_rng([seed, _STREAM])
        self.history: list[dict] = []
        self.divergences: dict[int, list[float]] = {}  # node -> its valid reports, oldest first
        self.historical: dict[int, float] = {}  # node -> EMA of its reports (starts at 0.0)
        self.faults: dict[int, int] = {}  # node -> invalid or missing replies so far
        self._pending: dict[int, dict] | None = None  # node -> its history row, this round
        self._current: ArrayRecord | None = None  # the global arrays sent this round

    # -- public helpers -------------------------------------------------------------
    def global_divergence(self) -> float:
        """Mean of the server's EMAs over the nodes that have reported (0.0 if none)."""
        return float(np.mean(list(self.historical.values()))) if self.historical else 0.0

    def smoothed(self) -> dict[int, float]:
        """The smoothed divergence of every node that has reported."""
        return {n: smoothed_divergence(d) for n, d in sorted(self.divergences.items())}

    def selection_counts(self) -> dict[int, int]:
        """How many rounds each node was selected for training."""
        return dict(sorted(Counter(row["node-id"] for row in self.history).items()))

    def tables(self) -> dict[str, list[dict]]:
        """Tables for the run directory: one selection row per round and node."""
        return {"selection.csv": self.history}

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generator and the selection history."""
        return {"rng": self.rng.bit_generator.state, "history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.history = state["history"]

    def client_state_dict(self) -> dict[str, dict[int, Any]]:
        """Each client's smoothed and historical divergence and its faults, by node id."""
        return {
            "divergences": self.divergences,
            "historical": self.historical,
            "faults": self.faults,
        }

    def load_client_state_dict(self, state: Mapping[str, dict[int, Any]]) -> None:
        """Restore :meth:`client_state_dict` (keyed by this run's node ids)."""
        self.divergences, self.historical = state["divergences"], state["historical"]
        self.faults = state["faults"]

    def summary(self) -> None:
        """Log the SmartFedProx settings, then FedProx's summary."""
        log(INFO, "\t├──> SmartFedProx settings (seed %d):", self.seed)
        log(INFO, "\t│\t├── Selection: %s", self.selection)
        if self.selection == "hybrid":
            log(INFO, "\t│\t│\t├── Cold start: %d random rounds", self.cold_start_rounds)
            log(INFO, "\t│\t│\t├── Exploration rate: %.2f", self.exploration_rate)
            log(INFO, "\t│\t│\t└── Groups high / middle / low: 30 / 50 / 20 %")
        log(INFO, "\t│\t├── Adaptive mu: %s", self.adaptive_mu)
        log(INFO, "\t│\t├── mu range: [%g, %g]", self.mu_min, self.mu_max)
        log(INFO, "\t│\t├── Local epochs: %d", self.local_epochs)
        log(INFO, "\t│\t└── Divergence EMA alpha: %g", self.ema_alpha)
        super().summary()

    # -- training -------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Select nodes (random or hybrid) and send each its own adaptive-mu inputs."""
        self._pending, self._current = None, None
        if self.fraction_train == 0.0:
            return []
        nodes = self._connected(grid, self.min_train_nodes)
        n = fedavg_sample_size(len(nodes), self.fraction_train, self.min_train_nodes)
        if self.sample_size is not None:
            n = min(len(nodes), self.sample_size)
        mode, values = self._mode(server_round), {}
        if mode == "hybrid":
            values = fill_unknown(nodes, self.smoothed())
            groups = sample_hybrid_groups(nodes, values, n, self.rng, self.partitions)
        else:
            groups = dict.fromkeys(sample_uniform(nodes, n, self.rng, self.partitions), "")
        rows = {
            node: _row(server_round, node, mode, group, values.get(node, math.nan))
            for node, group in groups.items()
        }
        self.history.extend(rows.values())
        self._pending, self._current = rows, arrays
        log(INFO, "configure_train: %s selection of %d of %d nodes", mode, n, len(nodes))
        return [
            _message(node, arrays, config, server_round, MessageType.TRAIN, self._config(node))
            for node in rows
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg over the valid replies; update the nodes' divergence histories."""
        current = self._current
        valid, failed = self.observe_train(server_round, replies)
        if not valid or current is None:
            return None, None
        aggregate, metrics = super().aggregate_train(server_round, [m for m, _ in valid.values()])
        divergences = [as_float(m[keys.DIVERGENCE]) for _, m in valid.values()]
        assert metrics is not None  # FedAvg's metrics of a non-empty round
        metrics["divergence-std"] = float(np.std(divergences))
        metrics["failed-replies"] = failed
        return to_record(current, arrays_of(aggregate)), metrics

    def observe_train(
        self, server_round: int, replies: Iterable[Message], *, arrays_checked: bool = False
    ) -> tuple[dict[int, tuple[Message, MetricRecord]], int]:
        """Take in the round's replies without aggregating them: validate them, add each
        valid reply's divergence to its node's history, and end the round. Returns (node
        -> (reply, metrics) of the valid replies, number of selected nodes left out).

        A DP wrapper calls this instead of :meth:`aggregate_train` (it releases the
        model itself); the divergences it sees are then the clients' noised releases,
        and everything selection and mu read afterwards is computed from them. It hands
        over only the replies whose arrays it accepted (``arrays_checked``: they are not
        decoded and scanned a second time)."""
        pending, current = self._pending, self._current
        self._pending, self._current = None, None
        if pending is None or current is None:
            return {}, 0
        valid = self._valid_replies(replies, pending, current, arrays_checked)
        if not valid:
            log(WARNING, "SmartFedProx round %d: no valid reply, model unchanged", server_round)
        for node, (_, metrics) in valid.items():
            self._observe(node, finite_metric(metrics, keys.DIVERGENCE))
        return valid, len(pending) - len(valid)

    # -- evaluation -----------------------------------------------------------------
    def evaluation_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes FedAvg's evaluation round samples (seeded, run's generator)."""
        return self._connected(grid, self.min_evaluate_nodes)

    # -- internals ------------------------------------------------------------------
    def _connected(self, grid: Grid, minimum: int) -> list[int]:
        """The connected nodes; StopTraining if fewer than ``minimum`` connected in time."""
        return nodes_for_round(
            grid,
            self.partitions,
            min_available=self.min_available_nodes,
            min_sample=minimum,
            timeout=self.connect_timeout,
        )

    def _mode(self, server_round: int) -> str:
        if self.selection == "random":
            return "random"
        if server_round <= self.cold_start_rounds:
            return "cold-start"
        return "exploration" if self.rng.random() < self.exploration_rate else "hybrid"

    def _config(self, node: int) -> dict:
        """The train config entries of ``node``: base mu and its adaptive-mu inputs."""
        return {
            keys.PROXIMAL_MU: float(self.proximal_mu),
            keys.SMART_ADAPTIVE_MU: bool(self.adaptive_mu),
            keys.SMART_CLIENT_DIVERGENCE: float(self.historical.get(node, 0.0)),
            keys.SMART_GLOBAL_DIVERGENCE: self.global_divergence(),
            keys.SMART_LOCAL_EPOCHS: int(self.local_epochs),
            keys.SMART_MU_MIN: float(self.mu_min),
            keys.SMART_MU_MAX: float(self.mu_max),
            keys.SMART_EMA_ALPHA: float(self.ema_alpha),
        }

    def _check(
        self, message: Message, current: ArrayRecord, arrays_checked: bool = False
    ) -> MetricRecord:
        """The reply's metrics if it may enter the aggregate, else InvalidReply."""
        metrics = checked_metrics(message)
        if finite_metric(metrics, keys.NUM_EXAMPLES) <= 0:
            raise InvalidReply(f"'{keys.NUM_EXAMPLES}' = 0: nothing to weight")
        content = message.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            raise InvalidReply(f"expected one ArrayRecord '{keys.ARRAYS}' and one MetricRecord")
        if not arrays_checked:
            arrays_of(content.get(keys.ARRAYS), current)
        finite_metric(metrics, keys.DIVERGENCE)
        return metrics

    def _valid_replies(
        self,
        replies: Iterable[Message],
        pending: dict[int, dict],
        current: ArrayRecord,
        arrays_checked: bool = False,
    ) -> dict[int, tuple[Message, MetricRecord]]:
        """node -> (reply, metrics) of the valid replies; the others are marked faulty."""
        valid: dict[int, tuple[Message, MetricRecord]] = {}
        seen: set[int] = set()
        for message in self.partitions.sort_replies(replies):
            node = message.metadata.src_node_id
            if node not in pending or node in seen:
                self._fault(node, None, "not selected this round, or a second reply")
                continue
            seen.add(node)
            try:
                valid[node] = (message, self._check(message, current, arrays_checked))
            except InvalidReply as err:
                self._fault(node, pending[node], str(err))
        # FedAvg aggregates only replies with equal metric keys: keep the most common set.
        key_sets = Counter(frozenset(m.keys()) for _, m in valid.values())
        common = key_sets.most_common(1)[0][0] if key_sets else frozenset()
        for node in [n for n, (_, m) in valid.items() if frozenset(m.keys()) != common]:
            got = sorted(valid.pop(node)[1].keys())
            self._fault(node, pending[node], f"metric keys {got} differ from {sorted(common)}")
        for node in set(pending) - seen:
            self._fault(node, pending[node], "no reply")
        for node, (_, metrics) in valid.items():
            _fill(pending[node], metrics)
        return valid

    def _fault(self, node: int, row: dict | None, reason: str) -> None:
        self.faults[node] = self.faults.get(node, 0) + 1
        if row is not None:
            row.update({"replied-ok": False, "reason": reason})
        count = self.faults[node]
        log(WARNING, "SmartFedProx: node %d faulty (%d so far): %s", node, count, reason)

    def _observe(self, node: int, divergence: float) -> None:
        """Append a valid report; the EMA is the client's (seed 3.3, tasks.adaptive_mu.ema)."""
        self.divergences.setdefault(node, []).append(divergence)
        previous = self.historical.get(node, 0.0)
        self.historical[node] = self.ema_alpha * divergence + (1.0 - self.ema_alpha) * previous


def _validate(**s) -> None:
    """ValueError naming the first setting out of range and its valid values."""
    checks = {
        "selection": (s["selection"] in SELECTIONS, f"one of {SELECTIONS}"),
        "cold_start_rounds": (s["cold_start_rounds"] >= 0, ">= 0"),
        "exploration_rate": (0.0 <= s["exploration_rate"] <= 1.0, "in [0, 1]"),
        "proximal_mu": (s["proximal_mu"] >= 0.0, ">= 0"),
        "mu_min": (0.0 <= s["mu_min"] <= s["mu_max"], f"in [0, mu_max = {s['mu_max']}]"),
        "local_epochs": (s["local_epochs"] >= 1, ">= 1"),
        "ema_alpha": (0.0 < s["ema_alpha"] <= 1.0, "in (0, 1]"),
    }
    for name, (ok, valid) in checks.items():
        if not ok:
            raise ValueError(f"{name} = {s[name]!r}; valid values: {valid}")


def _message(
    node: int, arrays: ArrayRecord, config: ConfigRecord, server_round: int, kind: str, extra: dict
) -> Message:
    """A message for ``node`` with its own ConfigRecord: ``config`` + round + ``extra``."""
    own = ConfigRecord({**config, keys.SERVER_ROUND: server_round, **extra})
    return Message(
        content=RecordDict({keys.ARRAYS: arrays, keys.CONFIG: own}),
        message_type=kind,
        dst_node_id=node,
        group_id=str(server_round),
    )


def _row(server_round: int, node: int, mode: str, group: str, smoothed: float) -> dict:
    """A history row at selection time; the reply's columns are filled on aggregation."""
    row: dict[str, Any] = dict.fromkeys(HISTORY_COLUMNS, math.nan)
    row.update({"round": server_round, "node-id": int(node), "mode": mode, "group": group})
    row.update({"smoothed-divergence": smoothed, "replied-ok": False, "reason": "pending"})
    return row


def _fill(row: dict, metrics: MetricRecord) -> None:
    """A valid reply's signals in its history row (NaN where not reported)."""
    row.update({"replied-ok": True, "reason": ""})
    for key in (keys.DIVERGENCE, keys.EFFECTIVE_MU, keys.TRAIN_LOSS):
        value = metrics.get(key)
        row[key] = float(value) if isinstance(value, int | float) else math.nan


# SmartFedProx selects clients by the divergence each one reports. Under DP-SGD that
# report is post-processing of an already private model; under DP-FedAvg each client
# releases it clipped and noised, and the ledger charges it (strategies.mechanisms.dp_fedavg).
# Laplace and subspace-dp have no divergence release, hierarchical modes no selection.
SMART_PRIVACY = ("none", "dp-sgd", "dp-fedavg-fixed", "dp-fedavg-adaptive")


@dataclass(frozen=True)
class SmartSettings(Settings):
    """SmartFedProx's run-config keys (``smart.*``; its base mu is ``fedprox.mu``; the
    divergence release under DP: ``DivergenceSettings``), each a constructor argument
    of :class:`SmartFedProx` of the same name."""

    PREFIX: ClassVar[str] = "smart"
    selection: str = setting(
        "hybrid",
        "SmartFedProx client selection: `hybrid` (30/50/20 % from the high/middle/low"
        " smoothed-divergence thirds) or `random`.",
        choices=("hybrid", "random"),
    )
    adaptive_mu: bool = setting(
        True,
        "SmartFedProx: clients scale `fedprox.mu` by their divergence history and epochs.",
    )
    cold_start_rounds: int = setting(
        3,
        "SmartFedProx: first rounds sampled at random.",
        low=0,
    )
    exploration_rate: float = setting(
        0.15,
        "SmartFedProx: probability that a round after the cold start samples at random.",
        low=0.0,
        high=1.0,
    )
    mu_min: float = setting(
        0.0,
        "SmartFedProx: lower clamp of the adaptive mu.",
        low=0.0,
    )
    mu_max: float = setting(
        1.0,
        "SmartFedProx: upper clamp of the adaptive mu.",
        low=0.0,
    )
    ema_alpha: float = setting(
        0.3,
        "SmartFedProx: weight of the newest divergence in the clients' EMA.",
        low=0.0,
        high=1.0,
        low_open=True,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """The privacy settings that make the divergence reports private."""
        if choice.strategy != "smart-fedprox":
            return
        smart = choice.part(SmartSettings)
        if choice.privacy not in SMART_PRIVACY:
            raise SettingsError(
                f"'privacy' = {choice.privacy!r} cannot protect 'strategy' = 'smart-fedprox': "
                "it selects clients by the divergence ||w_local - w_global|| each reports, "
                "which only DP-SGD and the DP-FedAvg family make private; valid values with "
                "smart-fedprox: " + listed(SMART_PRIVACY)
            )
        low, high = smart.mu_min, smart.mu_max
        if low > high:
            raise SettingsError(
                f"'smart.mu-min' = {low:g} must not exceed 'smart.mu-max' = {high:g}"
            )
