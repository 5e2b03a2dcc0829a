"""Attack-aware certificates of a run: μ-GDP, membership-inference bounds, SPI(k).

Subspace-DP-FL lists "μ-GDP bounds for membership inference" and "SPI(k):
Subspace Privacy Index for k-dimensional inversion" among its guarantees, without
formulas. This module states and computes both, from what the ledger recorded.

Design notes: ``docs/notes.md``, ``privacy.certificates``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
from scipy.stats import norm

# FPRs at which the final summary states the membership-inference bound.
MIA_FPRS: tuple[float, ...] = (0.001, 0.01, 0.1)
# Subspace dimensions at which SPI is reported (those <= d).
SPI_DIMS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_EPSILON_GRID = 200  # ε values at which the ledger's δ(ε) curve is read
_EXP_CAP = 700.0  # e^ε overflows a float above ~709.8


def gdp_mu_unamplified(releases: Iterable, *, unaccounted: bool = False) -> float | None:
    """Sound μ of the run's μ-GDP guarantee, ignoring sampling amplification.

    Parameters
    ----------
    releases : iterable of privacy.accounting.Release
        The ledger's releases.
    unaccounted : bool
        Whether the ledger also holds releases without a guarantee.

    Returns
    -------
    float or None
        ``√(Σ count / z²)`` over Gaussian releases (0.0 for none); ``None`` when a Laplace
        or unaccounted release leaves the run without a GDP statement.
    """
    if unaccounted:
        return None
    total = 0.0
    for release in releases:
        if release.mechanism != "gaussian":
            return None
        total += release.count / release.noise_multiplier**2
    return math.sqrt(total)


def _check_fpr(fpr: float) -> float:
    if not (isinstance(fpr, float | int) and 0.0 < fpr < 1.0):
        raise ValueError(f"fpr must be in (0, 1), got {fpr!r}")
    return float(fpr)


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: ``Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)`` (Dong et al., Cor. 2.13)."""
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be positive and finite, got {mu!r}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    # The second term in log space: e^ε Φ(x) without overflow for large ε.
    second = math.exp(epsilon + norm.logcdf(-epsilon / mu - mu / 2))
    return max(0.0, float(norm.cdf(-epsilon / mu + mu / 2)) - second)


def tpr_bound_gdp(mu: float, fpr: float) -> float:
    """Largest membership-inference TPR at ``fpr`` under μ-GDP: ``Φ(Φ⁻¹(fpr) + μ)``."""
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be finite and >= 0, got {mu!r}")
    return float(norm.cdf(norm.ppf(_check_fpr(fpr)) + mu))


def tpr_bound_dp(fpr: float, curve: Iterable[tuple[float, float]]) -> float:
    """Largest TPR at ``fpr`` for a mechanism that is (ε, δ)-DP for every pair of ``curve``.

    For one pair: ``min(e^ε·fpr + δ, 1 − e^{−ε}(1 − δ − fpr), 1)``; over several pairs the
    minimum, since each pair is a valid guarantee.
    """
    alpha = _check_fpr(fpr)
    best = 1.0
    for epsilon, delta in curve:
        best = min(
            best,
            math.exp(min(epsilon, _EXP_CAP)) * alpha + delta,  # >= 1 long before the cap
            1.0 - math.exp(-epsilon) * (1.0 - delta - alpha),
        )
    return max(best, alpha)  # no test does worse than guessing: TPR >= FPR is attainable


def ledger_curve(ledger, epsilon_max: float) -> list[tuple[float, float]]:
    """``(ε, δ(ε))`` pairs of the ledger on a grid from 0 to ``epsilon_max``."""
    grid = np.concatenate([[0.0], np.geomspace(1e-3, max(epsilon_max, 1e-3), _EPSILON_GRID)])
    # One pass over the composition (PLD: a sound upper bound on each δ, within ~1e-12 of
    # delta_for's), instead of one pass per point.
    return list(zip(grid.tolist(), ledger.delta_curve(grid.tolist()), strict=True))


def spi(
    top_eigenvalues: Sequence[float] | np.ndarray,
    *,
    floor: float,
    dim: int,
    noise_multiplier: float,
    ks: Iterable[int] = SPI_DIMS,
) -> dict[int, float]:
    """SPI(k) of noise ``N(0, σ²C² P⁻¹)`` for P with the given spectrum (see module doc).

    Parameters
    ----------
    top_eigenvalues : sequence of float
        The eigenvalues of P on its k special directions (``τ + λ_i``); may be empty.
    floor : float
        τ, the eigenvalue of P on the other ``dim − len(top_eigenvalues)`` directions.
    dim : int
        d, the dimension of the updates.
    noise_multiplier : float
        σ, the noise std on the sum over the clip norm C.
    ks : iterable of int
        Subspace dimensions; those above ``dim`` are skipped.

    Returns
    -------
    dict
        ``{k: SPI(k)}``.
    """
    top = np.sort(np.asarray(top_eigenvalues, dtype=np.float64))[::-1]
    if not (math.isfinite(floor) and floor > 0) or np.any(top <= 0) or top.size > dim:
        raise ValueError("need positive eigenvalues, a positive floor and at most dim of them")
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be positive, got {noise_multiplier!r}")
    wanted = sorted(k for k in set(ks) if 1 <= k <= dim)
    rest = dim - top.size
    # The largest eigenvalues of P, descending (enough of them for the largest k), and
    # the smallest of all d.
    spectrum = np.sort(np.concatenate([top, np.full(min(rest, max(wanted, default=0)), floor)]))
    spectrum = spectrum[::-1]
    smallest = min([floor, *top]) if rest else float(top.min())
    # For k < d the k − 1 largest never include the smallest one's position; for k = d
    # they are all but the smallest.
    return {
        k: float(noise_multiplier**2 * (1.0 + smallest * np.sum(1.0 / spectrum[: k - 1])))
        for k in wanted
    }


def _no_gdp_reason(ledger) -> str:
    """Why ``gdp_mu_unamplified`` gives no μ for ``ledger``: named, not guessed."""
    if ledger.unaccounted:
        return "the ledger holds releases without a guarantee (unaccounted)."
    if ledger.local_guarantees:
        return "some guarantees are client-reported (sample-level), not client-level."
    kinds = sorted({r.mechanism for r in ledger.releases if r.mechanism != "gaussian"})
    return (
        f"mu-GDP is derived for Gaussian releases only, and this run released with "
        f"{' and '.join(kinds)} noise; the ledger's (epsilon, delta) holds as stated."
    )


def run_certificates(
    ledger, *, spi_values: dict[int, float] | None, fprs: Sequence[float] = MIA_FPRS
) -> dict:
    """The ``certificates.json`` document of a run: μ-GDP, MIA bounds and SPI."""
    # Releases without a client-level guarantee (unaccounted ones, or DP-SGD's
    # sample-level ones) leave the run without any client-level certificate.
    uncovered = bool(ledger.unaccounted or ledger.local_guarantees)
    mu = gdp_mu_unamplified(ledger.releases, unaccounted=uncovered)
    notes: list[str] = []
    curve: list[tuple[float, float]] = []
    if ledger.releases and not uncovered:
        curve = ledger_curve(ledger, 2.0 * ledger.epsilon() + 1.0)
    mia = []
    for fpr in fprs:
        bounds = [tpr_bound_dp(fpr, curve)] if curve else []
        if mu is not None and ledger.releases:
            bounds.append(tpr_bound_gdp(mu, fpr))
        mia.append({"fpr": fpr, "tpr-bound": min(bounds) if bounds else None})
    if mu is None:
        notes.append("No mu-GDP statement: " + _no_gdp_reason(ledger))
    else:
        notes.append(
            "mu-GDP ignores sampling amplification (sound, loose); the TPR bounds also use "
            "the ledger's amplified (epsilon, delta) curve and report the smaller."
        )
    if spi_values:
        notes.append(
            "SPI(k): noise-to-signal floor of the most exposed k-dimensional inversion of "
            "one client's update from one release (higher is more private); not a DP guarantee."
        )
    return {
        "gdp-mu": mu,
        "mia": mia,
        "spi": (
            {"k": list(spi_values), "value": list(spi_values.values())} if spi_values else None
        ),
        "notes": notes,
    }
