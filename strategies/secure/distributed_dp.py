"""DP-FedAvg over a secure sum (``secagg.enabled`` with ``dp-fedavg-*``): the clients'
encoding, what the ledger charges, and the private mean from the decoded sum.

The two noise sites are described in :mod:`strategies.secure.secure_aggregation`; the per-client
accounting of distributed DP in :class:`SecureNoise`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from flwr.app import ArrayRecord, MetricRecord

from privacy.accounting import (
    BudgetExceededError,
    PrivacyLedger,
    Release,
    l2_sensitivity_factor,
)
from privacy.mechanisms import is_released
from privacy.skellam import SecureSumEncoding, centred_lift, l1_bound, rounded_l2_bound
from privacy.subspace import unflatten
from protocol import keys
from protocol.records import arrays_of, to_record
from strategies.errors import BudgetExhausted
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive
from strategies.secure.secagg_plus import SecAggSettings, SecureSum

SURVIVORS, DROPPED = "secagg-survivors", "secagg-dropped"
INTERRUPTED = (
    "distributed Skellam: the round under way when the server stopped (resume) may have "
    "been unmasked: one more sum for every client"
)


@dataclass
class SecureNoise:
    """What DP-FedAvg does differently when its sum is computed securely: the clients'
    encoding, the releases it charges, and the aggregate from the decoded sum.

    Distributed DP is accounted per client: the server learns about client i only from
    the sums its update reached, so i's ε composes those rounds alone (sampling is data
    independent; a round i was not in is post-processing for i). Each released round
    carries at least n_min shares of noise, so every client's ε is at most that of k
    Skellam releases at the n_min variance, k the most sums any client's update has
    reached: the ledger charges one such release each time k grows. The budget
    (``dp.max-epsilon``, else ``dp.target-epsilon``) then caps k: once one more would
    exceed it, only clients below k are sampled (a data-independent rule), and the run
    stops when fewer than m remain. z is calibrated for the participations the most
    active client is expected to reach (:meth:`planned_participations`).
    """

    settings: SecAggSettings
    distributed: bool
    """The clients add the noise (Skellam shares); else the server (Gaussian)."""
    dim: int = 0
    """d: the update's size (set before the first round's calibration)."""
    participations: dict[int, int] = field(default_factory=dict)
    """Distributed DP: node -> released sums its update reached."""
    interrupted: int = 0
    """Rounds under way at a resume: every client may have reached their sums."""
    charged: int = 0
    """k: the most sums any client's update reached, as the ledger has charged it."""

    def survivors_needed(self, dp: DPFedAvgFixed) -> int:
        """n_min: the survivors each client's noise share is calibrated for."""
        return self.settings.survivors_needed(dp.num_sampled_clients)

    def l2(self, dp: DPFedAvgFixed) -> float:
        """Δ₂ of one client's rounded update in integer units."""
        return rounded_l2_bound(dp.clip_norm * self.settings.scale, self.dim)

    def client_variance(self, dp: DPFedAvgFixed, noise_multiplier: float | None = None) -> float:
        """Each client's Skellam share, (zCs)²/n_min (0 with server-side noise)."""
        if not self.distributed:
            return 0.0
        z = dp.update_noise_multiplier() if noise_multiplier is None else noise_multiplier
        return (z * dp.clip_norm * self.settings.scale) ** 2 / self.survivors_needed(dp)

    def encoding(self, dp: DPFedAvgFixed) -> SecureSumEncoding:
        return SecureSumEncoding(
            clip_norm=dp.clip_norm,
            scale=self.settings.scale,
            modulus=self.settings.modulus_range,
            client_variance=self.client_variance(dp),
        )

    def client_config(self, dp: DPFedAvgFixed) -> dict:
        """The collect stage's encoding keys (no Gaussian noise key: see the module)."""
        return {
            keys.SECAGG_CLIP_NORM: dp.clip_norm,
            keys.SECAGG_SCALE: self.settings.scale,
            keys.SECAGG_MODULUS_BITS: self.settings.modulus_range.bit_length() - 1,
            keys.SECAGG_VARIANCE: self.client_variance(dp),
            keys.SECAGG_NORM_BIT: isinstance(dp, DPFedAvgAdaptive),
        }

    def release(
        self,
        dp: DPFedAvgFixed,
        noise_multiplier: float,
        server_round: int,
        population: int,
        count: int = 1,
    ) -> Release:
        """The round's release: Skellam at n_min shares (the least noise a released round
        carries; see the class docstring), or the server's Gaussian at the sensitivity
        Δ₂/s of a rounded update."""
        l2 = self.l2(dp)
        if self.distributed:
            shares = self.survivors_needed(dp)
            return Release(
                server_round=server_round,
                kind="model-update",
                mechanism="skellam",
                l2_sensitivity=l2,
                l1_sensitivity=l1_bound(l2, self.dim),
                variance=self.client_variance(dp, noise_multiplier) * shares,
                sampling="none",
                sample_size=1,
                population=1,
                count=count,
                note=(
                    "distributed Skellam on the securely summed, conditionally rounded "
                    "updates: one more sum reached by the most-participating client's "
                    f"update, charged at the least noise a released sum carries ({shares} "
                    "clients' shares); no amplification (the server knows whom it asked)"
                ),
            )
        factor = l2_sensitivity_factor(dp.ledger.neighboring)
        scaled = dp.clip_norm * self.settings.scale / l2  # z at the rounded sensitivity
        return Release(
            server_round=server_round,
            kind="model-update",
            mechanism="gaussian",
            noise_multiplier=noise_multiplier * scaled / factor,
            sampling=dp.ledger.sampling,
            sample_size=dp.num_sampled_clients,
            population=population,
            count=count,
            note=(
                "securely summed, conditionally rounded updates; Gaussian noise added by "
                "the server"
            ),
        )

    def aggregate(
        self, dp: DPFedAvgFixed, server_round: int, result: SecureSum
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The private mean from the secure sum, charged (nothing when abandoned)."""
        assert dp._round_state is not None
        current, _sent, population = dp._round_state
        dp._round_state = None
        extra = {SURVIVORS: float(len(result.survivors)), DROPPED: float(len(result.dropped))}
        if result.vector is None:
            extra[keys.DP_EPSILON] = dp.ledger.epsilon()
            return None, MetricRecord(dp.mark(extra))
        vector, centred = result.vector, None
        if isinstance(dp, DPFedAvgAdaptive):
            bits = int(
                centred_lift(vector[self.dim : self.dim + 1], self.settings.modulus_range)[0]
            )
            vector, centred = vector[: self.dim], bits - len(result.survivors) / 2
        reference = arrays_of(current)
        flat = self.encoding(dp).decode(vector)
        total = unflatten(flat, reference)
        if not self.distributed:
            total = dp._mechanism().noise_sum(total, rng=dp.rng)
        m = dp.num_sampled_clients
        mean = [(t / m).astype(r.dtype, copy=False) for t, r in zip(total, reference, strict=True)]
        new = to_record(  # integer arrays keep the server's value (not released)
            current,
            [r + d if is_released(r) else r for r, d in zip(reference, mean, strict=True)],
        )
        if self.distributed:
            self.record(dp, server_round, result.survivors, population)
        else:
            dp.ledger.charge(dp.release(server_round, population))
        return new, dp.released_metrics([], result.dropped, centred_bits=centred, **extra)

    # -- distributed DP: the most-participating client ------------------------------
    def count(self, node: int) -> int:
        """The released sums ``node``'s update may have reached."""
        return self.participations.get(node, 0) + self.interrupted

    def planned_participations(self, dp: DPFedAvgFixed, population: int) -> int:
        """k the calibration plans for: T·q plus three standard deviations of a
        client's Binomial(T, q) participations (q = m/N), at most T."""
        rounds = dp.planned_rounds
        q = min(1.0, dp.num_sampled_clients / population)
        spread = 3 * math.sqrt(rounds * q * (1 - q))
        return max(1, min(rounds, math.ceil(rounds * q + spread)))

    def eligible(self, dp: DPFedAvgFixed, nodes: list[int]) -> list[int]:
        """``nodes``, or only those below k when one more sum for a client at k would
        take the ledger past the budget (BudgetExhausted when fewer than m remain)."""
        budget = dp.ledger.max_epsilon or dp.target_epsilon
        if not self.distributed or budget is None:
            return nodes
        assert dp.noise_multiplier is not None
        more = self.release(dp, dp.noise_multiplier, 0, len(nodes))
        projected = PrivacyLedger.from_state_dict(dp.ledger.state_dict())
        try:
            projected.charge(more)
            over = projected.epsilon() > budget
        except BudgetExceededError:  # over dp.max-epsilon
            over = True
        if not over:
            return nodes
        below = [n for n in nodes if self.count(n) < self.charged]
        if len(below) < dp.num_sampled_clients:
            raise BudgetExhausted(
                f"only {len(below)} clients can take part without exceeding the budget "
                f"epsilon {budget:g} (ledger at {dp.ledger.epsilon():.4f}; the others "
                f"reached {self.charged} released sums); 'dp.num-sampled-clients' = "
                f"{dp.num_sampled_clients}; nothing was sent"
            )
        return below

    def record(
        self, dp: DPFedAvgFixed, server_round: int, survivors: list[int], population: int
    ) -> None:
        """Count the sum for each client whose update reached it; charge the ledger
        for each sum the most-participating client gained."""
        for node in survivors:
            self.participations[node] = self.participations.get(node, 0) + 1
        top = max((self.count(n) for n in self.participations), default=self.interrupted)
        if top > self.charged:
            z = dp.noise_multiplier
            assert z is not None
            release = self.release(dp, z, server_round, population, top - self.charged)
            if not survivors:  # on resume: the round that was under way
                release = replace(release, note=INTERRUPTED)
            dp.ledger.charge(release)
            self.charged = top

    def on_resume(self) -> None:
        """The round under way when the server stopped may have been unmasked (the
        server saw its sum): every client counts one more sum, charged by
        :meth:`catch_up` before the next round is sent."""
        if self.distributed:
            self.interrupted += 1

    def catch_up(self, dp: DPFedAvgFixed) -> None:
        """Charge the sums counted on resume (once d and z are known again)."""
        if self.distributed and dp.noise_multiplier is not None:
            self.record(dp, 0, [], 1)
