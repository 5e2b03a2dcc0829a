"""SmartFedProx under DP-FedAvg: the divergence report, both halves.

Each sampled client releases its model divergence clipped to a public bound and noised
(:func:`release_divergence`, called by ``dp_fedavg_mod``); :class:`DivergenceRelease`
is the server half that :class:`~strategies.mechanisms.dp_fedavg.DPFedAvgFixed` composes:
it asks for the report, charges it every round without amplification and hands the
noised reports to SmartFedProx's selection (docs/privacy.md, SmartFedProx under DP).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from typing import ClassVar

from flwr.app import ConfigRecord, Message, MetricRecord
from flwr.common.logger import log

from config.settings import Choice, Settings, SettingsError, setting
from privacy.accounting import Release
from privacy.mechanisms import BoundedScalarRelease
from protocol import keys
from protocol.records import InvalidReply, as_float

NOTE = (
    "each selected client's model divergence, clipped to a public bound and "
    "noised on the client; selection and adaptive mu read only these. No "
    "amplification: the server knows whom it asked, and selection depends on "
    "the reports"
)


@dataclass(frozen=True)
class DivergenceSettings(Settings):
    """The divergence release's run-config keys (``smart.divergence-*``)."""

    PREFIX: ClassVar[str] = "smart"
    divergence_clip: float = setting(
        0.0,
        "SmartFedProx under DP-FedAvg: public bound D each client clips its reported "
        "divergence to; 0: the round's clip norm C.",
        low=0.0,
    )
    divergence_noise: float = setting(
        0.0,
        "SmartFedProx under DP-FedAvg: noise multiplier of the divergence report (std"
        " / D), charged every round; 0: the run's `dp.noise-multiplier` z.",
        low=0.0,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """A divergence release only where DP-FedAvg releases it."""
        if choice.strategy != "smart-fedprox":
            return
        release = choice.part(DivergenceSettings)
        reports = [n for n in ("divergence_clip", "divergence_noise") if getattr(release, n)]
        if reports and choice.privacy not in ("dp-fedavg-fixed", "dp-fedavg-adaptive"):
            key, value = DivergenceSettings.key(reports[0]), getattr(release, reports[0])
            raise SettingsError(
                f"{key!r} = {value:g} sets the divergence release of DP-FedAvg; with "
                f"'privacy' = {choice.privacy!r} nothing is released that way; valid privacy "
                "values for it: 'dp-fedavg-fixed', 'dp-fedavg-adaptive'"
            )


@dataclass(frozen=True)
class DivergenceRelease:
    """How sampled clients release SmartFedProx's divergence under DP-FedAvg.

    Attributes
    ----------
    bound : float
        D, the public clip of the report; 0: the round's clip norm C (the divergence
        ``||w_local - w_global||`` is the norm of the update C clips).
    noise_multiplier : float or None
        z_d: the report's noise std is z_d·D; None: the run's z (calibrated with it).
    """

    bound: float = 0.0
    noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if not self.bound >= 0:
            raise ValueError(f"bound must be >= 0 (0: the clip norm), got {self.bound!r}")
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be > 0 or None, got {self.noise_multiplier!r}"
            )

    @staticmethod
    def check(uniform_sampling: bool, sampling: str) -> None:
        """ValueError unless the wrapper claims no amplification (selection reads data)."""
        if uniform_sampling or sampling != "none":
            raise ValueError(
                "divergence reports drive a data-dependent selection: they need "
                "uniform_sampling = False and a ledger without sampling"
            )

    def mechanism(self, clip_norm: float, noise_multiplier: float) -> BoundedScalarRelease:
        """The report's mechanism (bound D, multiplier z_d) given the run's C and z."""
        return BoundedScalarRelease(
            bound=self.bound or clip_norm,
            noise_multiplier=self.noise_multiplier or noise_multiplier,
        )

    def release(self, noise_multiplier: float, server_round: int, count: int = 1) -> Release:
        """Every sampled client's noised divergence: one Gaussian release with multiplier
        z_d per round for the client it concerns (each report depends on its own client's
        data only), charged as if every client reported every round."""
        return Release(
            server_round=server_round,
            kind="divergence-report",
            mechanism="gaussian",
            noise_multiplier=self.noise_multiplier or noise_multiplier,
            sampling="none",
            sample_size=1,
            population=1,
            count=count,
            note=NOTE,
        )

    def client_config(self, clip_norm: float, noise_multiplier: float) -> dict[str, float]:
        """The train-config keys that ask each client for its report."""
        report = self.mechanism(clip_norm, noise_multiplier)
        return {keys.DIVERGENCE_CLIP: report.bound, keys.DIVERGENCE_NOISE_STDDEV: report.noise_std}

    @staticmethod
    def observe(strategy, server_round: int, replies: list[Message], failed: list[int]) -> None:
        """Hand the valid replies' noised reports to the wrapped strategy's selection."""
        accepted = [m for m in replies if m.metadata.src_node_id not in failed]
        strategy.observe_train(server_round, accepted, arrays_checked=True)

    def summary(self) -> None:
        """Log the report's bound and noise."""
        log(
            INFO,
            "\t│\t└── divergence reports: clipped to %s, noise multiplier %s, "
            "charged every round without amplification (selection reads only them)",
            f"{self.bound:g}" if self.bound else "the clip norm C",
            f"{self.noise_multiplier:g}" if self.noise_multiplier else "z (the run's)",
        )


def release_divergence(config: ConfigRecord, metrics: MetricRecord, rng) -> None:
    """Replace the raw divergence by its clipped, noised release (0 when none was
    computed: a failed client's zero update)."""
    bound = as_float(config[keys.DIVERGENCE_CLIP])
    std = as_float(config[keys.DIVERGENCE_NOISE_STDDEV])
    raw = metrics.get(keys.DIVERGENCE, 0.0)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise InvalidReply(f"'{keys.DIVERGENCE}' = {raw!r} is not a number")
    release = BoundedScalarRelease(bound=bound, noise_multiplier=std / bound)
    metrics[keys.DIVERGENCE] = release.release(float(raw), rng=rng)
