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

import numpy as np
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism

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
