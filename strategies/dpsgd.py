"""Sample-level DP-SGD on the clients (Abadi et al. 2016, via Opacus).

The wrapped strategy samples and aggregates as usual; this wrapper only tells the
clients to train with DP-SGD and records the sample-level (ε, δ) each client reports
in the ledger. That guarantee protects one training example of one client; it is NOT
a client-level guarantee: the model updates themselves are released without
client-level noise, so the ledger's client-level ε stays undefined for this mode and
its summary says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger
from strategies import keys, partitions
from strategies.base import InvalidReply, TrainingWrapper, add_to_config, metrics_of


def _client_name(node_id: int) -> str:
    partition = partitions.partition_of(node_id)
    return f"partition-{partition}" if partition is not None else f"node-{node_id}"


def record_local_epsilons(
    ledger: PrivacyLedger, server_round: int, replies: Iterable[Message], label: str
) -> list[float]:
    """Ledger every reply's sample-level ``local-epsilon`` (kept apart from the
    client-level epsilon); return them. Replies without one are logged and skipped.

    The client is named by its partition (``partition-3``), which a SuperNode keeps
    across reconnects and resumed runs, or by ``node-<id>`` when it reported none."""
    reported = []
    for message in partitions.sort_replies(replies):  # arrival order is random
        if message.has_error():
            continue
        try:
            epsilon = float(metrics_of(message)[keys.LOCAL_EPSILON])
        except (InvalidReply, KeyError, TypeError, ValueError):
            node = message.metadata.src_node_id
            log(WARNING, "%s: node %d reported no '%s'", label, node, keys.LOCAL_EPSILON)
            continue
        ledger.record_local_guarantee(
            server_round,
            client=_client_name(message.metadata.src_node_id),
            epsilon=epsilon,
            delta=ledger.target_delta,
            unit="sample-level",
        )
        reported.append(epsilon)
    return reported


class DPSGDClients(TrainingWrapper):
    """Ask every sampled client for DP-SGD training; ledger its reported epsilon."""

    CHECKPOINT = ("ledger",)  # strategies.checkpoint

    def __init__(
        self,
        strategy: Strategy,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        target_epsilon: float,
        ledger: PrivacyLedger,
    ) -> None:
        super().__init__(strategy)
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.target_epsilon = target_epsilon
        self.ledger = ledger

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the DP-SGD settings added."""
        extra = {
            keys.DPSGD_NOISE_MULTIPLIER: self.noise_multiplier,
            keys.DPSGD_MAX_GRAD_NORM: self.max_grad_norm,
            keys.DPSGD_TARGET_EPSILON: self.target_epsilon,
            keys.DPSGD_DELTA: self.ledger.target_delta,
        }
        return add_to_config(
            self.strategy.configure_train(server_round, arrays, config, grid), extra
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Record each client's sample-level epsilon, then aggregate as the wrapped one."""
        replies = list(replies)
        reported = record_local_epsilons(self.ledger, server_round, replies, "DP-SGD")
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if metrics is not None and reported:
            metrics[keys.LOCAL_EPSILON] = max(reported)  # the worst client, not the mean
        return arrays, metrics

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
