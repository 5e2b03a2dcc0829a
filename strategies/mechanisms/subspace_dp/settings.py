"""Geometry-aligned subspace DP's run-config keys and the combinations it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from config.settings import Choice, Settings, SettingsError, setting
from strategies.mechanisms.base import DPSettings
from strategies.mechanisms.subspace_dp.budget import noise_split
from strategies.mechanisms.subspace_dp.geometry import ALLOCATIONS, INITS


@dataclass(frozen=True)
class SubspaceSettings(Settings):
    """Geometry-aligned subspace DP's run-config keys (``subspace.*``; the task's side,
    ``subspace.head-only``, ``subspace.warm-start`` and ``subspace.public-fraction``, is
    ``tasks.vision.settings.SubspaceTaskSettings``: a task imports no strategy)."""

    PREFIX: ClassVar[str] = "subspace"
    rank: int = setting(
        32,
        "Subspace-DP: k, directions of the metric P = U diag(lambda) U^T + tau I.",
        low=1,
    )
    tau: float = setting(
        0.8,
        "Subspace-DP: tau, the metric's floor (its eigenvalue off U).",
        low=0.0,
        low_open=True,
    )
    trace_budget: float = setting(
        25.0,
        "Subspace-DP: B = Tr(diag(lambda)), split evenly over the k directions.",
        low=0.0,
    )
    sketch_dim: int = setting(
        256,
        "Subspace-DP: s > k, JL sketch dimension of Private Metric Updates (the "
        "server holds a d x s sketch).",
        low=2,
    )
    pmu_every: int = setting(
        40,
        "Subspace-DP: rounds between Private Metric Updates (rounds 1, 1 + every, ...).",
        low=1,
    )
    lambda_ptr: float = setting(
        1.0,
        "Subspace-DP: PTR gate factor; a new subspace is adopted when its eigengap "
        "and k-th eigenvalue exceed this many noise spectral norms.",
        low=0.0,
    )
    init: str = setting(
        "isotropic",
        "Subspace-DP: the metric before the first adopted PMU: `isotropic` (P = tau I) "
        "or `public` (top-k subspace of per-example gradients on the public warm-start "
        "split; no privacy cost).",
        choices=INITS,
    )
    pmu_budget_reserve: float = setting(
        0.15,
        "Subspace-DP: share of the noise budget (zCDP rho) spent on PMU sketches (0: "
        "no PMU, P = tau I).",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    allocation: str = setting(
        "uniform",
        "Subspace-DP: how the trace budget is split over U's directions: `uniform` "
        "(B/k), `water-filling` (Theorem 5, from the public split's gradient "
        "energies) or `fairness` (Theorem 9: minimise the largest group distortion; "
        "needs `vision.grouping`).",
        choices=ALLOCATIONS,
    )
    quantize_bits: int = setting(
        0,
        "Subspace-DP: quantize each clipped update to this many bits per coordinate "
        "in the metric's whitened coordinates, with a Gaussian top-up (0: off; "
        "2..16).",
        low=0,
        high=16,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """What subspace-dp needs: s > k, public data for a public basis or allocation,
        codes of at least 2 bits that a top-up can make Gaussian, server-side noise."""
        if choice.privacy != "subspace-dp":
            return
        sub, dp = choice.part(SubspaceSettings), choice.part(DPSettings)
        rank, sketch = sub.rank, sub.sketch_dim
        if rank >= sketch:
            raise SettingsError(
                f"'subspace.rank' = {rank} must be below 'subspace.sketch-dim' = {sketch} "
                "(PMU takes the top-k eigenpairs of an s x s sketch and tests the gap to the "
                "next)"
            )
        for name, default in (("init", "isotropic"), ("allocation", "uniform")):
            key, value = SubspaceSettings.key(name), getattr(sub, name)
            if value != default and choice.warm_start == 0:
                raise SettingsError(
                    f"{key!r} = {value!r} needs public data: set 'subspace.warm-start' > 0 "
                    "(a vision task's public split of the held-out set), or "
                    f"{key!r} = {default!r}"
                )
        bits = sub.quantize_bits
        if bits == 1:
            raise SettingsError(
                "'subspace.quantize-bits' = 1 cannot code a coordinate of a clipped update "
                "(the dithered codes take at least three values); valid values: 0 (off) or "
                "2..16"
            )
        if bits and dp.noise_multiplier:  # calibrated z: checked when calibrated
            try:
                noise_split(
                    dp.noise_multiplier,
                    reserve=sub.pmu_budget_reserve,
                    rounds=choice.num_rounds,
                    every=sub.pmu_every,
                    clip_norm=dp.clip_norm,
                    quantize_bits=bits,
                    num_clients=dp.num_sampled_clients,
                )
            except ValueError as err:
                raise SettingsError(str(err)) from None
        if dp.noise_site != "server":
            raise SettingsError(
                "'privacy' = 'subspace-dp' clips in the P-norm and adds elliptical noise on "
                "the server (clients would need U, d x k, every round); set 'dp.noise-site' "
                "= 'server'"
            )
