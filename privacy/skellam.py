"""The distributed Skellam mechanism for secure aggregation (Agarwal, Kairouz & Liu 2021).

Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated
Learning" (NeurIPS 2021). Each client clips its update to L2 norm C, scales it by s
(integer units per real unit), rounds it to an integer vector, adds integer noise
``Sk(μ_i) = Poisson(μ_i/2) − Poisson(μ_i/2)`` (mean 0, variance μ_i) to every coordinate,
and reduces mod M; secure aggregation reveals only the sum mod M.

Design notes: ``docs/notes.md``, ``privacy.skellam``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from privacy.rdp_orders import RDP_ORDERS

BETA: float = math.exp(-0.5)
"""Conditional rounding's failure probability parameter β (√(2 ln(1/β)) = 1)."""
# Noise margin of fits(): Bernstein's inequality for Sk(μ) (a sum of centred Poissons,
# sub-gamma with scale 1/3) gives P(|X| >= t) <= 2 exp(−t²/(2(μ + t/3))) = e^{-32} at
# t = L/3 + √(L²/9 + 2Lμ), L = 32 + ln 2 (≈ 8.09 √μ for large μ).
_TAIL_LOG = 32.0 + math.log(2.0)
# Largest integer magnitude handled per client: int64 arithmetic with room for the noise.
_MAX_UNITS = 2.0**62


def rounded_l2_bound(scaled_clip: float, dim: int, beta: float = BETA) -> float:
    """Δ2 of conditional randomized rounding (Kairouz, Liu & Steinke 2021, Sec. 4).

    A real vector of L2 norm ≤ ``scaled_clip`` (c = C·s) in ``dim`` coordinates rounds
    to an integer vector of norm ≤ ``min(√(c² + d/4 + √(2 ln(1/β))(c + √d/2)), c + √d)``.
    """
    if not (math.isfinite(scaled_clip) and scaled_clip >= 0) or dim < 1 or not 0 < beta < 1:
        raise ValueError(
            f"need scaled_clip >= 0, dim >= 1 and 0 < beta < 1, got {(scaled_clip, dim, beta)}"
        )
    c, d = float(scaled_clip), float(dim)
    tail = math.sqrt(2.0 * math.log(1.0 / beta)) * (c + math.sqrt(d) / 2.0)
    return min(math.sqrt(c * c + d / 4.0 + tail), c + math.sqrt(d))


def l1_bound(l2: float, dim: int) -> float:
    """L1 bound of an integer vector of L2 norm ≤ ``l2``: ``min(l2², √dim · l2)``."""
    return min(l2 * l2, math.sqrt(dim) * l2)


def _norm(x: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64)))


def stochastic_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased rounding to int64: ``floor(x) + Bernoulli(x − floor(x))``."""
    low = np.floor(x)
    return (low + (rng.random(x.shape) < x - low)).astype(np.int64)


def conditional_round(
    x: np.ndarray, bound: float, rng: np.random.Generator, max_tries: int = 100
) -> np.ndarray:
    """Stochastic rounding of ``x`` to int64, repeated until ``‖result‖₂ ≤ bound``.

    After ``max_tries`` rejections, rounds toward zero (norm ≤ ‖x‖). Raises ValueError
    if even that exceeds ``bound`` (``‖x‖ > bound``): the result never exceeds it.
    """
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("x must be finite")
    for _ in range(max_tries):
        rounded = stochastic_round(x, rng)
        if _norm(rounded) <= bound:
            return rounded
    rounded = np.trunc(x).astype(np.int64)
    if _norm(rounded) > bound:
        raise ValueError(f"‖x‖ = {_norm(x):.6g} exceeds the rounding bound {bound:.6g}")
    return rounded


def skellam_noise(shape, variance: float, rng: np.random.Generator) -> np.ndarray:
    """int64 symmetric Skellam noise ``Poisson(variance/2) − Poisson(variance/2)``."""
    if not (math.isfinite(variance) and variance >= 0):
        raise ValueError(f"variance must be finite and >= 0, got {variance!r}")
    if variance == 0:
        return np.zeros(shape, dtype=np.int64)
    half = variance / 2.0
    return rng.poisson(half, shape).astype(np.int64) - rng.poisson(half, shape).astype(np.int64)


def centred_lift(values: np.ndarray, modulus: int) -> np.ndarray:
    """int64 values in ``[−M/2, M/2)`` congruent mod M (a power of two <= 2**64) to the
    unsigned ``values``."""
    values = np.asarray(values).astype(np.uint64)
    shift = np.uint64(64 - (modulus.bit_length() - 1))
    # Keep the low log2(M) bits at the top, then shift back with sign extension.
    return (values << shift).view(np.int64) >> shift.astype(np.int64)


@dataclass(frozen=True)
class SecureSumEncoding:
    """How a client turns its real update into integers mod M for secure aggregation,
    and how the server turns the modular sum back (see the module docstring)."""

    clip_norm: float
    """C > 0: L2 clip before scaling (DP); 0: clip each coordinate to ±coordinate_range."""
    scale: float
    """s > 0: integer units per real unit."""
    modulus: int
    """M, a power of two in [2, 2**64]."""
    client_variance: float = 0.0
    """Variance of each client's Skellam share, in integer units; 0: no noise."""
    coordinate_range: float = 0.0
    """Only when clip_norm == 0 (plain SecAgg, no DP): per-coordinate clip."""

    def __post_init__(self) -> None:
        def check(name, ok, valid):
            if not ok:
                raise ValueError(f"{name} must be {valid}, got {getattr(self, name)!r}")

        def finite(value) -> bool:
            return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)

        check("clip_norm", finite(self.clip_norm) and self.clip_norm >= 0, "finite and >= 0")
        check("scale", finite(self.scale) and self.scale > 0, "finite and > 0")
        m = self.modulus
        power = isinstance(m, Integral) and not isinstance(m, bool) and 2 <= m <= 2**64
        check("modulus", power and m & (m - 1) == 0, "a power of two in [2, 2**64]")
        object.__setattr__(self, "modulus", int(m))
        variance_ok = finite(self.client_variance) and 0 <= self.client_variance <= 1e18
        check("client_variance", variance_ok, "in [0, 1e18]")
        if self.clip_norm > 0:
            check("coordinate_range", self.coordinate_range == 0, "0 when clip_norm > 0")
        else:
            ok = finite(self.coordinate_range) and self.coordinate_range > 0
            check("coordinate_range", ok, "finite and > 0 when clip_norm == 0")

    def l2_bound(self, dim: int) -> float:
        """Δ2 of one client's integer vector: ``rounded_l2_bound(C·s, dim)`` (DP only)."""
        if self.clip_norm == 0:
            raise ValueError("l2_bound needs clip_norm > 0 (no L2 bound without L2 clipping)")
        return rounded_l2_bound(self.clip_norm * self.scale, dim)

    def _max_units(self, dim: int) -> float:
        """Largest |coordinate| of one client's rounded vector, in integer units."""
        if self.clip_norm > 0:
            return self.l2_bound(dim)
        return self.coordinate_range * self.scale + 1.0

    def encode(self, update: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The client's message: clip, scale, round, add its Skellam share, reduce mod M.

        Returns a np.uint64 array with values in [0, M).
        """
        update = np.asarray(update, dtype=np.float64)
        if update.ndim != 1 or not np.all(np.isfinite(update)):
            raise ValueError("update must be a flat array of finite numbers")
        dim = update.size
        if self._max_units(dim) >= _MAX_UNITS:
            raise ValueError(f"clip x scale too large for int64 arithmetic: {self}")
        if self.clip_norm > 0:
            norm = _norm(update)
            factor = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
            units = conditional_round(update * (factor * self.scale), self.l2_bound(dim), rng)
        else:
            clipped = np.clip(update, -self.coordinate_range, self.coordinate_range)
            units = stochastic_round(clipped * self.scale, rng)
        units = units + skellam_noise(dim, self.client_variance, rng)
        message = units.view(np.uint64)  # two's complement: the value mod 2**64
        if self.modulus < 2**64:
            message = message & np.uint64(self.modulus - 1)
        return message

    def decode(self, modular_sum: np.ndarray) -> np.ndarray:
        """The real sum from an integer array congruent to it mod M (e.g. the wrapping
        uint64 sum of the messages): centred lift into ``[−M/2, M/2)``, divided by s."""
        return centred_lift(modular_sum, self.modulus).astype(np.float64) / self.scale

    def max_error(self, num_clients: int, dim: int) -> float:
        """Worst-case L∞ error of ``decode(sum)`` against the real sum of the clipped
        updates without noise: ``num_clients / s`` (rounding moves each coordinate by
        < 1 unit). Holds when no wrap-around occurs (``fits``)."""
        del dim  # the bound is per coordinate
        return num_clients / self.scale

    def fits(self, num_clients: int, dim: int) -> bool:
        """Whether the sum of ``num_clients`` messages decodes without wrap-around.

        True when ``n · (largest |coordinate| of one client) + t < M/2``, with the
        largest coordinate ``l2_bound(dim)`` (DP) or ``coordinate_range·s + 1`` and t the
        noise margin that ``Sk(n·client_variance)`` exceeds with probability < e^-32
        (Bernstein; t ≈ 8.09 √(n·client_variance) for a large variance, 0 without noise).
        """
        variance = num_clients * self.client_variance
        margin = 0.0
        if variance > 0:
            margin = _TAIL_LOG / 3 + math.sqrt(_TAIL_LOG**2 / 9 + 2 * _TAIL_LOG * variance)
        return num_clients * self._max_units(dim) + margin < self.modulus / 2


# -- accounting -------------------------------------------------------------------------
def skellam_rdp(
    orders, l2_sensitivity: float, l1_sensitivity: float, variance: float
) -> np.ndarray:
    """RDP of the Skellam mechanism at ``orders`` (Agarwal et al. 2021, Cor. 3.6).

    Parameters
    ----------
    orders : array_like of float
        RDP orders α. The bound is proven for integer α > 1; a non-integer order gets
        the value at ``ceil(α)`` (Rényi divergence is non-decreasing in α); α ≤ 1: inf.
    l2_sensitivity, l1_sensitivity : float
        Δ2, Δ1 of the integer-valued query, in integer units.
    variance : float
        μ, the per-coordinate variance of the Skellam noise, in integer units.

    Returns
    -------
    np.ndarray
        ``α Δ2²/(2μ) + min(((2α − 1) Δ2² + 6 Δ1)/(4μ²), 3 Δ1/(2μ))`` at α = ceil(order).
    """
    for name, value in (("l2_sensitivity", l2_sensitivity), ("l1_sensitivity", l1_sensitivity)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if not (math.isfinite(variance) and variance > 0):
        raise ValueError(f"variance must be finite and > 0, got {variance!r}")
    order = np.asarray(orders, dtype=np.float64)
    alpha = np.ceil(order)
    d2, d1, mu = l2_sensitivity**2, float(l1_sensitivity), float(variance)
    surcharge = np.minimum(((2 * alpha - 1) * d2 + 6 * d1) / (4 * mu * mu), 3 * d1 / (2 * mu))
    return np.where(order > 1, alpha * d2 / (2 * mu) + surcharge, np.inf)


def skellam_epsilon(
    rounds: int,
    l2_sensitivity: float,
    l1_sensitivity: float,
    variance: float,
    delta: float,
    orders=RDP_ORDERS,
) -> float:
    """ε at ``delta`` of ``rounds`` Skellam releases (dp-accounting's ``compute_epsilon``)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    from dp_accounting.rdp import rdp_privacy_accountant  # on use (module docstring)

    rdp = rounds * skellam_rdp(orders, l2_sensitivity, l1_sensitivity, variance)
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(np.asarray(orders), rdp, delta)
    return float(epsilon)


def calibrate_variance(
    target_epsilon: float,
    delta: float,
    rounds: int,
    l2_sensitivity: float,
    l1_sensitivity: float,
    orders=RDP_ORDERS,
) -> float:
    """The smallest variance μ (relative tolerance 1e-6) whose ``skellam_epsilon`` is at
    most ``target_epsilon``; the returned μ meets the target (ε decreases in μ)."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")

    def meets(mu: float) -> bool:
        eps = skellam_epsilon(rounds, l2_sensitivity, l1_sensitivity, mu, delta, orders)
        return eps <= target_epsilon

    high = max(l2_sensitivity, 1.0) ** 2
    for _ in range(200):  # bracket: high meets the target, low does not
        if meets(high):
            break
        high *= 4.0
    else:
        raise ValueError(f"no variance below {high:.3g} meets ε = {target_epsilon}")
    low = high / 4.0
    while meets(low):
        high, low = low, low / 4.0
        if low < 1e-300:
            return high
    while high / low - 1.0 > 1e-6:  # bisection in log space
        middle = math.sqrt(low * high)
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high
