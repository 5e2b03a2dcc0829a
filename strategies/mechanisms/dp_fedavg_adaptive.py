"""DP-FedAvg with adaptive clipping (Andrew et al. 2021, "Differentially Private
Learning with Adaptive Clipping", Algorithm 1), on
:class:`strategies.mechanisms.dp_fedavg.DPFedAvgFixed`.

Each sampled client also reports the bit b = [‖Δ‖ <= C] (``dpfedavg-norm-bit``); the
server releases their noised, centred count and moves C geometrically towards the
``target_quantile`` of the update norms. Updates and count are one Gaussian mechanism
with the run's multiplier z (their Theorem 1), which the ledger charges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import Strategy

from config.settings import Settings, setting
from privacy.accounting import Release
from protocol import keys
from protocol.records import InvalidReply, as_float
from strategies.errors import StopTraining
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed


@dataclass(frozen=True)
class AdaptiveClipSettings(Settings):
    """Adaptive clipping's own run-config keys (``dp.*``, beside the shared
    :class:`privacy.settings.DPSettings`): the constructor arguments of
    :class:`DPFedAvgAdaptive` by name."""

    PREFIX: ClassVar[str] = "dp"
    target_quantile: float = setting(
        0.5,
        "Adaptive clipping: quantile of update norms that C tracks.",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    )
    clip_lr: float = setting(
        0.2,
        "Adaptive clipping: geometric learning rate of C.",
        low=0.0,
        low_open=True,
    )
    clip_count_stddev: float = setting(
        0.0,
        "Adaptive clipping: noise sigma_b of the clipped count (0: max(m/20, z)).",
        low=0.0,
    )


def count_stddev(clip_count_stddev: float, num_sampled_clients: int, z: float) -> float:
    """σ_b: ``dp.clip-count-stddev``, or when 0 max(m/20, z) (Andrew et al.'s m/20, at
    least z)."""
    return clip_count_stddev or max(num_sampled_clients / 20, z)


class DPFedAvgAdaptive(DPFedAvgFixed):
    """DP-FedAvg with adaptive clipping (Andrew et al. 2021, Algorithm 1).

    Each client reports the bit b_i = [||Δ_i|| <= C]. The server releases the noised
    fraction b̄ = (Σ b_i + N(0, σ_b²)) / m and updates C ← C·exp(−η_C (b̄ − γ)), moving C
    towards the γ-quantile of the update norms. The update noise uses
    z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2) so that updates and count together are one Gaussian
    mechanism with noise multiplier z (their Theorem 1): the ledger charges exactly
    that release, which therefore covers the count query.

    With client-side noise the bit reaches the server in the clear: no guarantee holds
    against the server itself (no local view), only against observers of the model.
    """

    RELEASED_METRICS = (*DPFedAvgFixed.RELEASED_METRICS, "dp-noisy-unclipped-fraction")
    CLIENT_REPORTS = (keys.DP_NORM_BIT,)
    LOCAL_VIEW = False

    def __init__(
        self,
        strategy: Strategy,
        *,
        target_quantile: float,
        clip_lr: float,
        clip_count_stddev: float | None,
        **kwargs,
    ) -> None:
        super().__init__(strategy, **kwargs)
        if not 0 < target_quantile < 1 or clip_lr <= 0:
            raise ValueError("target_quantile must be in (0, 1), clip_lr > 0")
        self.target_quantile = target_quantile
        self.clip_lr = clip_lr
        self.count_stddev = clip_count_stddev or None  # σ_b; 0 or None: set with z
        if self.noise_multiplier is not None:
            try:
                self.after_calibration()
            except StopTraining as err:
                raise ValueError(str(err)) from None

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DP-FedAvg's state and the count's noise sigma_b."""
        return {**super().state_dict(), "count-stddev": self.count_stddev}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.count_stddev = state["count-stddev"]

    def after_calibration(self) -> None:
        """σ_b: given, or max(m/20, z) (Andrew et al.'s m/20, at least z); it must exceed
        z/2 for the split below."""
        assert self.noise_multiplier is not None
        z = self.noise_multiplier
        if self.count_stddev is None:
            self.count_stddev = count_stddev(0.0, self.num_sampled_clients, z)
        if self.count_stddev <= z / 2:
            raise StopTraining(
                f"'dp.clip-count-stddev' = {self.count_stddev:g} must exceed z/2 = {z / 2:g} "
                "(z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2); raise it, or set it to 0 (auto)"
            )

    def update_noise_multiplier(self) -> float:
        """z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2), the update share of the combined noise."""
        z, sigma_b = self.noise_multiplier, self.count_stddev
        assert z is not None and sigma_b is not None  # set or calibrated before round 1
        return (z**-2 - (2 * sigma_b) ** -2) ** -0.5

    def client_config(self) -> dict[str, float | bool | list[str]]:
        """Fixed clipping's keys plus the request for the norm indicator bit."""
        return {**super().client_config(), keys.DP_ADAPTIVE: True}

    def release(self, server_round: int, population: int) -> list[Release]:
        """One Gaussian release with multiplier z covers updates and count together."""
        update, *reports = super().release(server_round, population)
        note = (
            f"updates (z_delta = {self.update_noise_multiplier():.4f}) and the "
            f"clipped-count query (sigma_b = {self.count_stddev:g}) as one Gaussian "
            f"mechanism with z = {self.noise_multiplier:g} (Andrew et al. 2021, Thm 1)"
        )
        return [
            Release(
                **{
                    **update.__dict__,
                    "kind": "model-update+clip-count",
                    "note": "; ".join(n for n in (update.note, note) if n),
                }
            ),
            *reports,
        ]

    def round_metrics(
        self, records: list[MetricRecord], centred_bits: float | None = None
    ) -> dict[str, float]:
        """Release the noised count of centred bits, update C, and report both.

        Each valid reply adds its bit minus ½, a failed client nothing (bit ½):
        b̄ = (Σ (b_i − ½) + N(0, σ_b²)) / m + ½. Centring makes the count's sensitivity ½
        under add-or-remove-one (Poisson sampling), the relation Andrew et al.'s split
        z_Δ = (z⁻² − (2σ_b)⁻²)^(-½) assumes; under replace-one it is 1, matching the
        update's 2C (the ledger's z/2). With every one of m clients valid this is the
        uncentred (Σ b_i + noise)/m."""
        m = self.num_sampled_clients
        centred = centred_bits
        if centred is None:  # under secure aggregation the sum arrives instead
            centred = sum(as_float(r[keys.DP_NORM_BIT]) - 0.5 for r in records)
        assert self.count_stddev is not None
        noisy_fraction = (centred + self.rng.normal(0.0, self.count_stddev)) / m + 0.5
        used = self.clip_norm
        self.clip_norm = used * math.exp(-self.clip_lr * (noisy_fraction - self.target_quantile))
        return {"dp-clip-norm": used, "dp-noisy-unclipped-fraction": noisy_fraction}

    def _check(self, message: Message, current: ArrayRecord):
        received, metrics = super()._check(message, current)
        bit = metrics.get(keys.DP_NORM_BIT)
        if bit not in (0.0, 1.0, 0, 1):
            raise InvalidReply(f"no valid '{keys.DP_NORM_BIT}' (got {bit!r})")
        return received, metrics
