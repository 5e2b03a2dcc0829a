"""The Laplace mechanism on client updates (seed 000, DP-FL on LunarLander).

Each sampled client clips its update Δ to L1 norm S (``dp.sensitivity``) and adds
Laplace(0, S/ε) noise to every coordinate before sending it (ε = ``dp.epsilon``, the
per-round budget), from a generator only it knows. The server averages the noisy
deltas over the clients it asked and adds the mean to the global model; a client that
failed counts as a zero update, whose Laplace noise the server draws itself (secret
generator), so the released mean is distributed as if it had sent a noised zero.

Privacy unit: one client's whole contribution to a round (its data or, for RL, its
whole environment interaction). Neighbouring relation: zero-out (Kairouz et al. 2021;
dp-accounting's REPLACE_SPECIAL): a client's clipped update replaced by zero while it
still takes part, sending its noise. That is the relation local noise supports: whether
a client sent an upload is visible in the noise of the mean (one Laplace term per
upload), so add-or-remove-one, which hides presence, does not hold. Each noisy upload
is ε-DP for it (L1 sensitivity S); against replacing the update by another client's
the sensitivity is 2S and the bound 2ε. Noise is added locally, so no amplification by
subsampling is claimed, and the same ε holds against the server, which sees every
upload: the ledger composes every round (against observers of the model) and
:class:`~privacy.local_view.LocalViewLedger` each client's own rounds (against the
server). Both report the smaller of the accountant's ε and basic composition's k·ε.

Around a strategy that aggregates the uploads itself (``AGGREGATES_UPLOADS``, e.g.
clustered FedAvg: k-means over the uploads, one average per cluster), the wrapper
checks and charges, then hands the valid noisy uploads to it: every upload is
already ε-DP, so whatever the strategy computes from them is post-processing (a
client's data-dependent failure reaches the server as a noised zero upload,
``client_app.mods.privacy_mod``).

Contract with the client (``client_app.mods.privacy_mod``)::

    delta = trained - received
    delta = delta * min(1, S / ||delta||_1)             # S = config["laplace-sensitivity"]
    delta += Laplace(0, config["laplace-scale"]) per coordinate   # secret generator
    reply arrays = received + delta
    reply metrics = only config["report-metrics"] (num-examples sent as 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger, Release
from privacy.local_view import LocalViewLedger
from privacy.mechanisms import LaplaceMechanism
from strategies import keys, partitions
from strategies.base import (
    InvalidReply,
    StopTraining,
    add_to_config,
    arrays_of,
    check_reply,
    to_record,
    weighted_metrics,
)
from strategies.private import PrivacyWrapper


class LaplaceDP(PrivacyWrapper):
    """Local Laplace noise on every client's clipped update, averaged over the sample.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy (it samples the clients).
    sensitivity, epsilon : float
        S (L1 clip norm) and the per-round ε; the noise scale is S/ε.
    ledger : PrivacyLedger
        The run's ledger (sampling "none", zero-out).
    rng : numpy.random.Generator
        The secret DP generator: the noise of clients counted as zero updates.
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    CHECKPOINT = ("rng", "ledger", "local_view")  # strategies.checkpoint
    RELEASED_METRICS = (*PrivacyWrapper.RELEASED_METRICS, keys.DP_EPSILON_LOCAL)

    def __init__(
        self,
        strategy: Strategy,
        *,
        sensitivity: float,
        epsilon: float,
        ledger: PrivacyLedger,
        rng: np.random.Generator,
        **kwargs,
    ) -> None:
        super().__init__(strategy, **kwargs)
        self.mechanism = LaplaceMechanism(sensitivity=sensitivity, epsilon=epsilon)
        self.ledger = ledger
        self.rng = rng
        self.local_view = LocalViewLedger(
            accountant=ledger.accountant,
            target_delta=ledger.target_delta,
            neighboring=ledger.neighboring,
            mechanisms=("laplace",),
            max_epsilon=ledger.max_epsilon,
        )
        self._round_state: tuple[ArrayRecord, list[int], int] | None = None

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
                note="local Laplace noise on each client's L1-clipped update; epsilon for "
                "zeroing out one client's update (it still takes part; 2x for replacing it "
                "by another client's)",
            )
        ]

    def local_release(self, server_round: int) -> Release:
        """One client's noisy upload as the server sees it."""
        (release,) = self.release(server_round, 1, 1)
        return Release(
            **{**release.__dict__, "kind": "noisy-upload", "note": "one client's upload"}
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's sampling, plus the clip bound and noise scale."""
        population = len(list(grid.get_node_ids()))
        if self.ledger.would_exceed(self.release(server_round, 1, population)) or (
            self.local_view.would_exceed(self.local_release(server_round))
        ):
            raise StopTraining(
                f"round {server_round} would exceed 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f}, "
                f"worst client against the server {self.local_view.worst()[1]:.4f}); "
                "nothing was sent"
            )
        extra = {
            keys.LAPLACE_SENSITIVITY: self.mechanism.sensitivity,
            keys.LAPLACE_SCALE: self.mechanism.scale,
            **self.report_config(),
        }
        messages = add_to_config(
            self.strategy.configure_train(server_round, arrays, config, grid), extra
        )
        sent = partitions.order(m.metadata.dst_node_id for m in messages)
        clients = [partitions.client_name(n) for n in sent]
        self.local_view.charge(clients, self.local_release(server_round))
        self._round_state = (arrays, sent, population)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The mean of the noisy deltas over the clients asked (failed: a noised zero)."""
        if self._round_state is None:
            return None, None
        current, sent, population = self._round_state
        self._round_state = None
        valid, failed = self._screen(replies, sent, current)
        self.ledger.charge(self.release(server_round, max(len(sent), 1), population))
        if getattr(self.strategy, "AGGREGATES_UPLOADS", False):
            uploads = [message for message, _ in valid]
            new_arrays, metrics = self.strategy.aggregate_train(server_round, uploads)
            return new_arrays, self._metrics(metrics or MetricRecord({}), failed)
        reference = arrays_of(current)
        total = [np.zeros(a.shape) for a in reference]
        for _, received in valid:
            for t, r, c in zip(total, received, reference, strict=True):
                t += np.asarray(r, dtype=np.float64) - c
        for _ in failed:  # their noise, drawn here: the mean is as if they sent a zero
            for t in total:
                t += self.rng.laplace(0.0, self.mechanism.scale, size=t.shape)
        count = max(len(sent), 1)
        new_arrays = to_record(
            current, [c + t / count for c, t in zip(reference, total, strict=True)]
        )
        records = [
            MetricRecord({**m.content[keys.METRICS], keys.NUM_EXAMPLES: 1}) for m, _ in valid
        ]
        return new_arrays, self._metrics(weighted_metrics(records), failed)

    def _screen(
        self, replies: Iterable[Message], sent: list[int], current: ArrayRecord
    ) -> tuple[list[tuple[Message, list[np.ndarray]]], list[int]]:
        """(the valid replies of the nodes asked with their arrays, in partition order;
        the other nodes asked)."""
        by_node: dict[int, Message] = {}
        for message in replies:
            by_node.setdefault(message.metadata.src_node_id, message)
        valid, failed = [], []
        for node in sent:
            try:
                if node not in by_node:
                    raise InvalidReply("no reply")
                received, _ = check_reply(by_node[node], current)
                valid.append((by_node[node], received))
            except InvalidReply as err:
                failed.append(node)
                log(WARNING, "Laplace: node %d counts as a zero update: %s", node, err)
        return valid, failed

    def _metrics(self, metrics: MetricRecord, failed: list[int]) -> MetricRecord:
        out = dict(metrics)
        out[keys.DP_FAILED_CLIENTS] = float(len(failed))
        out[keys.DP_EPSILON] = self.ledger.epsilon()
        out[keys.DP_EPSILON_LOCAL] = self.local_view.worst()[1]
        return MetricRecord(self.mark(out))

    def on_resume(self) -> None:
        """Every client may have uploaded in the round under way when the server stopped."""
        self.local_view.charge_all(self.local_release(0))
        log(INFO, "resume: one noisy upload charged to every client against the server")

    def summary(self) -> None:
        """Log the mechanism, then the wrapped strategy's summary."""
        log(
            INFO,
            "\t├──> Laplace: L1 clip S = %g, epsilon per round %g (scale %g), "
            "zero-out relation; the same epsilon per upload against the server",
            self.mechanism.sensitivity,
            self.mechanism.epsilon,
            self.mechanism.scale,
        )
        self.strategy.summary()
