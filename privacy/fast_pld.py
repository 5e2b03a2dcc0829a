"""dp-accounting's subsampled-Gaussian PLD, built with its hockey-stick divergences
evaluated on arrays.

``privacy_loss_distribution.from_gaussian_mechanism`` (connect-the-dots, pessimistic)
inverts the privacy loss one ε at a time in Python: about 110 000 calls at the ledger's
1e-4 grid, ~1 s per PLD. ``from_subsampled_gaussian`` builds the same PLD through the
same dp-accounting construction, with only ``get_delta_for_epsilon`` replaced by the
same formulas on NumPy arrays (edge cases are left to dp-accounting's scalar code).
tests/privacy/test_fast_pld.py holds it equal to dp-accounting's own PLD.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict

import numpy as np
from dp_accounting.pld import common, privacy_loss_distribution, privacy_loss_mechanism
from scipy import special

_Adjacency = privacy_loss_mechanism.AdjacencyType


class _ArrayGaussianPrivacyLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """``GaussianPrivacyLoss`` whose ``get_delta_for_epsilon`` inverts the privacy loss
    on whole arrays (ADD and REMOVE, 0 < sampling_prob < 1)."""

    def _inverse_array(self, eps: np.ndarray) -> np.ndarray:
        # dp-accounting's _inverse_privacy_loss_{add,remove} with
        # common.log_a_times_exp_b_plus_c(1/q, b, 1 - 1/q), element by element.
        q, s, var = self.sampling_prob, self.sensitivity, self._standard_deviation**2
        a, c = 1 / q, 1 - 1 / q
        add = self.adjacency_type == _Adjacency.ADD
        b = -eps if add else eps
        with np.errstate(divide="ignore", invalid="ignore"):
            d = b + np.log(a)
            loss = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(np.log(-c) - d)))
        loss = -loss if add else loss
        x = -0.5 * s - loss * var / s
        x = s + x if add else x
        # At the boundary (math.isclose) dp-accounting maps to the unsubsampled inverse
        # at ±inf: its own scalar code there.
        edge = -math.log(1 - q) if add else math.log(1 - q)
        near = np.abs(eps - edge) <= 2e-9 * np.maximum(abs(edge), np.abs(eps))
        for i in np.flatnonzero(near):
            if math.isclose(float(eps[i]), edge):
                x[i] = self.inverse_privacy_loss(float(eps[i]))
        return x

    def get_delta_for_epsilon(self, epsilon):
        if isinstance(epsilon, numbers.Number) or self.sampling_prob == 1.0:
            return super().get_delta_for_epsilon(epsilon)
        epsilons = np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.adjacency_type == _Adjacency.ADD:
            inverse = epsilons < -math.log1p(-self.sampling_prob)
        elif self.adjacency_type == _Adjacency.REMOVE:
            inverse = epsilons > math.log1p(-self.sampling_prob)
            other = np.logical_not(inverse)
            deltas[other] = -np.expm1(epsilons[other])
        else:
            return super().get_delta_for_epsilon(epsilon)
        eps = epsilons[inverse]
        x_cutoffs = self._inverse_array(eps)
        deltas[inverse] = self.mu_upper_cdf(x_cutoffs) - np.exp(
            eps + self.mu_lower_log_cdf(x_cutoffs)
        )
        return np.clip(deltas, 0, 1)


def from_subsampled_gaussian(
    standard_deviation: float, sampling_prob: float, value_discretization_interval: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``from_gaussian_mechanism(standard_deviation, sampling_prob=..., value_discretization
    _interval=...)`` under add-or-remove-one with its defaults (sensitivity 1,
    pessimistic, connect-the-dots, log mass truncation -50), 0 < sampling_prob < 1."""
    if not 0 < sampling_prob < 1:
        raise ValueError(f"sampling_prob must be in (0, 1), got {sampling_prob!r}")

    def single(adjacency):
        loss = _ArrayGaussianPrivacyLoss(
            standard_deviation,
            sensitivity=1,
            pessimistic_estimate=True,
            log_mass_truncation_bound=-50,
            sampling_prob=sampling_prob,
            adjacency_type=adjacency,
        )
        # Private in dp-accounting: the construction from_gaussian_mechanism itself calls.
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            loss,
            pessimistic_estimate=True,
            value_discretization_interval=value_discretization_interval,
            use_connect_dots=True,
        )

    return privacy_loss_distribution._pld_for_subsampled_mechanism(single, sampling_prob)


# -- self-composition's truncation bounds --------------------------------------------
# dp-accounting's ``common.compute_self_convolve_bounds`` (the Chernoff bounds every
# ``self_compose`` computes first) calls SciPy's ``logsumexp`` once per order, 40 orders
# per PMF: ~80 % of a self-composition at the ledger's 1e-4 grid (0.2-0.5 s), paid by every
# round's ε under PLD and by the calibration's check. The replacement computes the same
# log moment-generating functions with plain NumPy and returns the same integers: where a
# bound's value is within its rounding error of an integer (or not finite), that order is
# recomputed with dp-accounting's own SciPy call. tests/privacy/test_fast_pld.py holds
# the bounds equal to dp-accounting's on the workloads' PLDs.
_DP_ACCOUNTING_BOUNDS = common.compute_self_convolve_bounds
_LOG_MGF_ERROR = 1e-12  # absolute, far above the float64 summation error (~1e-15)


def _log_mgf(index: np.ndarray, probs: np.ndarray, ends: tuple[int, int], order: float) -> float:
    """log Σ_i probs[i] e^(i·order), shifted by its largest exponent (at the first or
    last positive probability: ``ends``) as logsumexp does."""
    exponents = index * order
    shift = float(exponents[ends[1] if order > 0 else ends[0]])
    exponents -= shift
    with np.errstate(divide="ignore"):
        return math.log(float(np.sum(probs * np.exp(exponents, out=exponents)))) + shift


# The log moment-generating functions depend on the PMF and the order, not on the count:
# a ledger composes the same release's PMF at every checkpoint, so they are kept per PMF
# (its bytes are the key: exact, never a stale entry) and each order's value is the same
# float as computing it afresh. 8 PMFs of ~110 000 values: ~7 MB of keys.
_MGF_CACHE: OrderedDict[bytes, dict[float, tuple[float, float | None]]] = OrderedDict()
_MGF_CACHE_SIZE = 8


def _cached_log_mgfs(probs: np.ndarray) -> dict[float, tuple[float, float | None]]:
    """The cache's entry for ``probs``: order -> (NumPy value, SciPy's value or None)."""
    key = probs.tobytes()
    entry = _MGF_CACHE.pop(key, None)
    if entry is None:
        entry = {}
        while len(_MGF_CACHE) >= _MGF_CACHE_SIZE:
            _MGF_CACHE.popitem(last=False)
    _MGF_CACHE[key] = entry
    return entry


def self_convolve_bounds(input_list, num_times, tail_mass_truncation=0, orders=None):
    """``common.compute_self_convolve_bounds`` with the same arguments and result."""
    probs = np.asarray(input_list, dtype=float)
    positive = probs > 0
    if tail_mass_truncation == 0 or probs.ndim != 1 or not positive.any() or (probs < 0).any():
        return _DP_ACCOUNTING_BOUNDS(input_list, num_times, tail_mass_truncation, orders)
    n = len(probs)
    upper_bound, lower_bound = (n - 1) * num_times, 0
    # Only dp-accounting's default orders are cached (what self_convolve passes).
    cache = _cached_log_mgfs(probs) if orders is None else {}
    if orders is None:  # dp-accounting's default orders
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n
    index = np.arange(n, dtype=float)
    nonzero = np.flatnonzero(positive)
    ends = (int(nonzero[0]), int(nonzero[-1]))
    log_tail = math.log(2 / tail_mass_truncation)
    for order in orders:
        order = float(order)
        value, exact = cache.get(order) or (_log_mgf(index, probs, ends, order), None)
        cache[order] = (value, exact)
        bound = (num_times * value + log_tail) / order
        slack = (_LOG_MGF_ERROR + 1e-15 * abs(value)) * num_times / abs(order) + 1e-9
        if not math.isfinite(bound) or abs(bound - round(bound)) <= slack:
            if exact is None:
                exact = float(special.logsumexp(np.arange(n) * order, b=input_list))
                cache[order] = (value, exact)
            bound = (num_times * exact + log_tail) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper_bound = min(upper_bound, math.ceil(bound))
        if order < 0:
            lower_bound = max(lower_bound, math.floor(bound))
    return lower_bound, upper_bound


# ``common.self_convolve`` looks the name up when it runs: every PLD self-composition in
# this process (the ledger's, the calibration's, dp-accounting's accountant) uses it.
common.compute_self_convolve_bounds = self_convolve_bounds


# -- δ(ε) at many ε ---------------------------------------------------------------------
# ``PLDPmf.get_delta_for_epsilon`` at one ε is a pass over the whole PMF (3.6 ms at a
# small run's size); dp-accounting's sequence form walks the PMF in a Python loop and is
# slower still. ``delta_curve`` takes the suffix sums once: O(size + len(ε)) in NumPy. It
# returns a proven upper bound on the PMF's exact hockey-stick divergence: the rounding
# error of the sums (accumulated in long double where the platform has one) is added.
_U64 = float(np.finfo(np.float64).eps) / 2
_U_SUM = float(np.finfo(np.longdouble).eps) / 2


def delta_curve(pmf, epsilons) -> np.ndarray:
    """δ(ε) of a dp-accounting ``PLDPmf`` at each of ``epsilons`` (ascending, finite).

    ``infinity_mass + Σ_{L_i > ε} p_i (1 − e^{ε − L_i})`` (dp-accounting's formula), from
    suffix sums ``U = Σ p_i`` and ``W = Σ p_i e^{−L_i}`` over ``L_i > ε``, plus a bound on
    their rounding error; never below the exact value of the formula.
    """
    pmf = pmf.to_dense_pmf()
    eps = np.asarray(epsilons, dtype=np.float64)
    if eps.ndim != 1 or not np.all(np.isfinite(eps)) or np.any(np.diff(eps) < 0):
        raise ValueError("epsilons must be a finite ascending sequence")
    losses = (np.arange(pmf.size) + pmf._lower_loss) * pmf._discretization
    probs = np.asarray(pmf._probs, dtype=np.float64)
    # U_k, W_k: sums over i >= k (k = 0..size, the last one empty), in long double; A_k:
    # the same sums of |p_i| (an FFT's rounding can leave tiny negative masses), for the
    # error bound.
    weighted = probs * np.exp(-losses)

    def suffix(values):
        out = np.zeros(len(values) + 1, dtype=np.longdouble)
        out[:-1] = np.cumsum(values[::-1], dtype=np.longdouble)[::-1]
        return out

    upper, lower = suffix(probs), suffix(weighted)
    magnitude = suffix(np.abs(probs)) + suffix(np.abs(weighted))
    start = np.searchsorted(losses, eps, side="right")  # first i with L_i > ε
    scale = np.exp(eps.astype(np.longdouble))
    value = pmf._infinity_mass + upper[start] - scale * lower[start]
    # Each suffix sum of n terms is within n·u_sum of its |terms| sum; each e^{−L}·p and
    # e^ε within a few float64 ulps; e^ε·|W| <= |U| over L_i > ε.
    terms = (pmf.size - start + 4).astype(np.longdouble)
    error = (terms * _U_SUM + 8 * _U64) * (1 + scale) * magnitude[start]
    deltas = np.asarray(value + error, dtype=np.float64)
    return np.nextafter(np.clip(deltas, 0.0, None), np.inf)
