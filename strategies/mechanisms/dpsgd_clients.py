"""Sample-level DP-SGD on the clients (Abadi et al. 2016, via Opacus).

The wrapped strategy samples and aggregates as usual; this wrapper only tells the
clients to train with DP-SGD and records the sample-level (ε, δ) of each client in the
ledger. That guarantee protects one training example of one client; it is NOT a
client-level guarantee: the model updates themselves are released without
client-level noise, so the ledger's client-level ε stays undefined for this mode and
its summary says so.

Design notes: ``docs/notes.md``, ``strategies.mechanisms.dpsgd_clients``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger
from privacy.calibration import sampled_gaussian_epsilon
from protocol import keys
from protocol.records import InvalidReply, as_float, as_int
from protocol.replies import metrics_of
from strategies.base import add_to_config
from strategies.errors import BudgetExhausted
from strategies.mechanisms.base import PrivacyWrapper
from strategies.runtime.checkpoint import ledger_state, load_ledger
from strategies.runtime.partitions import PartitionMap

Corrector = Callable[[Message, float], float]


def record_local_epsilons(
    ledger: PrivacyLedger,
    server_round: int,
    replies: Iterable[Message],
    label: str,
    partitions: PartitionMap,
    correct: Corrector | None = None,
) -> list[float]:
    """Ledger every reply's sample-level ``local-epsilon`` (kept apart from the
    client-level epsilon), after ``correct(message, reported)`` if given; return them.
    Replies without one are logged and skipped.

    The client is named by its partition (``partition-3``), which a SuperNode keeps
    across reconnects and resumed runs, or by ``node-<id>`` when it reported none."""
    recorded = []
    for message in partitions.sort_replies(replies):  # arrival order is random
        if message.has_error():
            continue
        try:
            epsilon = as_float(metrics_of(message)[keys.LOCAL_EPSILON])
        except (InvalidReply, KeyError, TypeError, ValueError):
            node = message.metadata.src_node_id
            log(WARNING, "%s: node %d reported no '%s'", label, node, keys.LOCAL_EPSILON)
            continue
        if correct is not None:
            epsilon = correct(message, epsilon)
        ledger.record_local_guarantee(
            server_round,
            client=partitions.client_name(message.metadata.src_node_id),
            epsilon=epsilon,
            delta=ledger.target_delta,
            unit="sample-level",
        )
        recorded.append(epsilon)
    return recorded


def _round_steps(metrics: MetricRecord) -> tuple[float, float, int] | None:
    """This round's (noise multiplier, sample rate, steps) from a reply, if stated."""
    try:
        z = as_float(metrics[keys.DPSGD_ROUND_NOISE])
        q = as_float(metrics[keys.DPSGD_ROUND_SAMPLE_RATE])
        steps = as_int(metrics[keys.DPSGD_ROUND_STEPS])
    except (KeyError, TypeError, ValueError):
        return None
    if not (z >= 0 and 0 < q <= 1 and steps >= 1):
        return None
    return z, q, steps


class DPSGDClients(PrivacyWrapper):
    """Ask every sampled client for DP-SGD training; ledger its sample-level epsilon.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy (samples and aggregates).
    noise_multiplier, max_grad_norm, target_epsilon : float
        The clients' DP-SGD settings (``target_epsilon`` > 0: each client calibrates
        its noise multiplier for the planned rounds).
    ledger : PrivacyLedger
        The run's ledger (side records only: sample-level guarantees).
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    RELEASED_METRICS = (*PrivacyWrapper.RELEASED_METRICS, keys.LOCAL_EPSILON)
    CLIENT_REPORTS = (
        keys.NUM_EXAMPLES,  # the wrapped FedAvg weights by it: treated as public
        keys.LOCAL_EPSILON,
        keys.DPSGD_ROUNDS,
        keys.DPSGD_ROUND_NOISE,
        keys.DPSGD_ROUND_SAMPLE_RATE,
        keys.DPSGD_ROUND_STEPS,
    )

    def __init__(
        self,
        strategy: Strategy,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        target_epsilon: float,
        ledger: PrivacyLedger,
        **kwargs,
    ) -> None:
        super().__init__(strategy, **kwargs)
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.target_epsilon = target_epsilon
        self.ledger = ledger
        self.participations: dict[str, int] = {}
        self.interrupted = 0  # rounds under way when the server stopped: any client's
        self.steps: dict[str, list[float]] = {}  # client -> [z, q, steps] of its last round
        self._refused = ""  # a client's refusal: the run stops before the next round

    def _projected(self, client: str) -> float | None:
        """The client's ε after one more round like its last (None: not known yet)."""
        if client not in self.steps:
            return None
        z, q, steps = self.steps[client]
        rounds = self._asked(client) + 1
        return sampled_gaussian_epsilon(
            [(z, q, int(steps) * rounds)], target_delta=self.ledger.target_delta
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the DP-SGD settings added; refused
        (nothing sent) when a sampled client would exceed ``dp.max-epsilon``."""
        if self._refused:
            raise BudgetExhausted(self._refused)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        clients = [self.partitions.client_name(m.metadata.dst_node_id) for m in messages]
        budget = self.ledger.max_epsilon
        if budget is not None:
            for client in clients:
                projected = self._projected(client)
                if projected is not None and projected > budget:
                    raise BudgetExhausted(
                        f"round {server_round} would take {client}'s sample-level epsilon "
                        f"to {projected:.4f} > 'dp.max-epsilon' = {budget:g}; nothing was sent"
                    )
        extra = {
            keys.DPSGD_NOISE_MULTIPLIER: self.noise_multiplier,
            keys.DPSGD_MAX_GRAD_NORM: self.max_grad_norm,
            keys.DPSGD_TARGET_EPSILON: self.target_epsilon,
            keys.DPSGD_DELTA: self.ledger.target_delta,
            keys.DPSGD_MAX_EPSILON: float(budget or 0.0),
            **self.report_config(),
        }
        for client in clients:
            self.participations[client] = self.participations.get(client, 0) + 1
        return add_to_config(messages, extra)

    def _verified(self, message: Message, reported: float) -> float:
        """The ε to record: the server's composition of the client's steps over the
        rounds the server asked it to train when the client's accountant covers fewer
        (restarted) or its ε is below that composition by more than accountants differ
        (1 %: Opacus' RDP orders and conversion against dp-accounting's); else the
        client's own (Opacus, the accountant its noise was calibrated with). Either is
        an upper bound for the steps it took."""
        client = self.partitions.client_name(message.metadata.src_node_id)
        metrics = metrics_of(message)
        steps = _round_steps(metrics)
        if steps is None:
            log(WARNING, "DP-SGD: %s stated no steps; its own epsilon is recorded", client)
            return reported
        self.steps[client] = list(steps)
        asked = self._asked(client)
        covered = as_int(metrics.get(keys.DPSGD_ROUNDS, asked))
        z, q, per_round = steps
        composed = sampled_gaussian_epsilon(
            [(z, q, per_round * asked)], target_delta=self.ledger.target_delta
        )
        if covered < asked:
            log(
                WARNING,
                "DP-SGD: %s's accountant covers %d training(s), the server asked it %d "
                "times (a lost state file restarts it): recorded epsilon %.4f, not its %.4f",
                client,
                covered,
                asked,
                composed,
                reported,
            )
            return composed
        if reported < composed * (1 - 1e-2):
            log(
                WARNING,
                "DP-SGD: %s reported epsilon %.4f for steps that compose to %.4f: the "
                "server's is recorded",
                client,
                reported,
                composed,
            )
            return composed
        return reported

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Record each client's sample-level epsilon, then aggregate as the wrapped one."""
        replies = list(replies)
        for message in replies:
            if message.has_error() and keys.DPSGD_BUDGET_REFUSAL in (message.error.reason or ""):
                self._refused = f"a client refused to train: {message.error.reason}"
        recorded = record_local_epsilons(
            self.ledger, server_round, replies, "DP-SGD", self.partitions, correct=self._verified
        )
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if metrics is not None:
            metrics = MetricRecord(self.mark(dict(metrics)))
            if recorded:
                metrics[keys.LOCAL_EPSILON] = max(recorded)  # the worst client, not the mean
        return arrays, metrics

    def _asked(self, client: str) -> int:
        """Trainings ``client`` may have done: the rounds it was sent, and every round
        that was under way when the server stopped (its sample is unknown)."""
        return self.participations.get(client, 0) + self.interrupted

    def on_resume(self) -> None:
        """Every client may have trained in the round under way when the server stopped."""
        self.interrupted += 1

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledger, and each client's rounds and last steps by client name (partition):
        kept across resume, as its accountant must be."""
        return {
            "ledger": ledger_state(self.ledger),
            "participations": self.participations,
            "interrupted": self.interrupted,
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ledger in place)."""
        load_ledger(self.ledger, state["ledger"])
        self.participations, self.steps = state["participations"], state["steps"]
        self.interrupted = state["interrupted"]

    def summary(self) -> None:
        """Log the DP-SGD settings, then the wrapped strategy's summary."""
        log(
            INFO,
            "\t├──> DP-SGD on clients: max grad norm %g, %s",
            self.max_grad_norm,
            f"target epsilon {self.target_epsilon:g}"
            if self.target_epsilon
            else f"noise multiplier {self.noise_multiplier:g}",
        )
        self.strategy.summary()
