"""The Laplace mechanism on client updates (seed 000, DP-FL on LunarLander).

Each sampled client clips its update Δ to L1 norm S (``dp.sensitivity``) and adds
Laplace(0, S/ε) noise to every coordinate before sending it (ε = ``dp.epsilon``, the
per-round budget). The server averages the noisy deltas unweighted and adds the
mean to the global model.

Privacy unit: one client's whole contribution to a round (its data or, for RL, its
whole environment interaction). Each noisy update is ε-DP with respect to replacing
the client's clipped update by the zero update (L1 sensitivity S); against
replacement by an arbitrary other clipped update the sensitivity is 2S and the bound
is 2ε. Noise is added locally, so no amplification by subsampling is claimed; the
ledger composes the rounds with its accountant and reports basic composition
(T·ε) beside it.

Around a strategy that aggregates the uploads itself (``AGGREGATES_UPLOADS``, e.g.
clustered FedAvg: k-means over the uploads, one average per cluster), the wrapper
checks and charges, then hands the valid noisy uploads to it: every upload is
already ε-DP, so whatever the strategy computes from them is post-processing.

Contract with the client (``client_app.mods.privacy_mod``)::

    delta = trained - received
    delta = delta * min(1, S / ||delta||_1)             # S = config["laplace-sensitivity"]
    delta += Laplace(0, config["laplace-scale"]) per coordinate
    reply arrays = received + delta
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from privacy.accounting import PrivacyLedger, Release
from privacy.mechanisms import LaplaceMechanism
from strategies import keys, partitions
from strategies.base import (
    InvalidReply,
    StopTraining,
    TrainingWrapper,
    add_to_config,
    arrays_of,
    check_reply,
    to_record,
    unweighted,
)


class LaplaceDP(TrainingWrapper):
    """Local Laplace noise on every client's clipped update, averaged unweighted."""

    CHECKPOINT = ("ledger",)  # strategies.checkpoint

    def __init__(
        self, strategy: Strategy, *, sensitivity: float, epsilon: float, ledger: PrivacyLedger
    ) -> None:
        super().__init__(strategy)
        self.mechanism = LaplaceMechanism(sensitivity=sensitivity, epsilon=epsilon)
        self.ledger = ledger
        self._round_state: tuple[ArrayRecord, int] | None = None

    def release(self, server_round: int, clients: int, population: int) -> list[Release]:
        """One Laplace release per round (worst case: a client in every round)."""
        return [
            Release(
                server_round=server_round,
                kind="model-update",
                mechanism="laplace",
                noise_multiplier=None,
                laplace_epsilon=self.mechanism.epsilon,
                sampling="none",
                sample_size=clients,
                population=population,
                note="local Laplace noise on each client's L1-clipped update; epsilon w.r.t. "
                "replacing the update by zero (2x for arbitrary replacement)",
            )
        ]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's sampling, plus the clip bound and noise scale."""
        population = len(list(grid.get_node_ids()))
        if self.ledger.would_exceed(self.release(server_round, 1, population)):
            raise StopTraining(
                f"round {server_round} would exceed 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f}); "
                "nothing was sent"
            )
        extra = {
            keys.LAPLACE_SENSITIVITY: self.mechanism.sensitivity,
            keys.LAPLACE_SCALE: self.mechanism.scale,
        }
        messages = add_to_config(
            self.strategy.configure_train(server_round, arrays, config, grid), extra
        )
        self._round_state = (arrays, population)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unweighted mean of the valid noisy deltas, added to the global model."""
        if self._round_state is None:
            return None, None
        current, population = self._round_state
        self._round_state = None
        reference, deltas, contents, valid = arrays_of(current), [], [], []
        for message in partitions.sort_replies(replies):
            try:
                received, _ = check_reply(message, current)
                contents.append(unweighted(message))
                valid.append(message)
            except InvalidReply as err:
                log(
                    WARNING,
                    "Laplace: reply of node %d skipped: %s",
                    message.metadata.src_node_id,
                    err,
                )
                continue
            deltas.append([r - c for r, c in zip(received, reference, strict=True)])
        if not deltas:
            log(WARNING, "Laplace round %d: no valid update, nothing released", server_round)
            return None, None
        if getattr(self.strategy, "AGGREGATES_UPLOADS", False):
            self.ledger.charge(self.release(server_round, len(valid), population))
            new_arrays, metrics = self.strategy.aggregate_train(server_round, valid)
            if metrics is not None:
                metrics["dp-epsilon"] = self.ledger.epsilon()
            return new_arrays, metrics
        mean = [sum(parts) / len(deltas) for parts in zip(*deltas, strict=True)]
        new_arrays = to_record(current, [c + d for c, d in zip(reference, mean, strict=True)])
        self.ledger.charge(self.release(server_round, len(deltas), population))
        metrics = aggregate_metricrecords(contents, keys.NUM_EXAMPLES)
        metrics["dp-epsilon"] = self.ledger.epsilon()
        return new_arrays, metrics

    def summary(self) -> None:
        """Log the mechanism, then the wrapped strategy's summary."""
        log(
            INFO,
            "\t├──> Laplace: L1 clip S = %g, epsilon per round %g (scale %g)",
            self.mechanism.sensitivity,
            self.mechanism.epsilon,
            self.mechanism.scale,
        )
        self.strategy.summary()
