"""The array-built subsampled-Gaussian PLD is dp-accounting's own, bit for bit."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from privacy.fast_pld import from_subsampled_gaussian


@pytest.mark.parametrize(
    ("z", "q", "interval"),
    [
        (1.19, 0.05, 1e-3),
        (0.6, 0.1, 4e-3),
        (3.0, 0.01, 1e-4),
        (0.3, 0.5, 2e-3),
        # -log(1 - q) = 0.05 on the grid: the points next to the subsampling boundary.
        (1.0, -math.expm1(-0.05), 1e-3),
    ],
)
def test_equal_to_from_gaussian_mechanism(z, q, interval):
    expected = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=z,
        value_discretization_interval=interval,
        sampling_prob=q,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    built = from_subsampled_gaussian(z, q, interval)
    for want, got in (
        (expected._pmf_remove, built._pmf_remove),
        (expected._pmf_add, built._pmf_add),
    ):
        assert got._lower_loss == want._lower_loss
        assert got._infinity_mass == want._infinity_mass
        assert np.array_equal(got._probs, want._probs)
    assert built.self_compose(20).get_epsilon_for_delta(1e-5) == expected.self_compose(
        20
    ).get_epsilon_for_delta(1e-5)


def test_sampling_probability_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="sampling_prob"):
        from_subsampled_gaussian(1.0, 1.0, 1e-4)


@pytest.mark.parametrize(
    ("z", "q", "interval", "counts"),
    [
        (0.7293342243400441, 0.1, 1e-3, (2, 30, 1000)),  # the ε = 8, N = 100 peer run's z
        (0.5858702703028728, 0.05, 1e-4, (30,)),  # ε = 8, N = 1 000, at the ledger's grid
        (6.390444234542291, 0.1, 4e-3, (1, 1000)),
        (0.3, 0.5, 2e-3, (7, 300)),
    ],
)
def test_self_composition_bounds_are_dp_accountings(z, q, interval, counts):
    from privacy import fast_pld

    pld = from_subsampled_gaussian(z, q, interval)
    for pmf in (pld._pmf_remove, pld._pmf_add):
        pmf = pmf.to_dense_pmf() if hasattr(pmf, "to_dense_pmf") else pmf
        for count in counts:
            for tail in (1e-15, 1e-10):
                want = fast_pld._DP_ACCOUNTING_BOUNDS(pmf._probs, count, tail)
                assert fast_pld.self_convolve_bounds(pmf._probs, count, tail) == want


def test_self_composition_bounds_edge_cases_follow_dp_accounting():
    from privacy import fast_pld

    probs = np.array([0.0, 0.25, 0.5, 0.0, 0.25])
    for args in ((probs, 3, 0), (probs, 3, 1e-3), (probs, 3, 1e-3, [0.5, -0.5]), (probs, 1, 0.5)):
        assert fast_pld.self_convolve_bounds(*args) == fast_pld._DP_ACCOUNTING_BOUNDS(*args)
    # What every self-composition in the process now calls.
    from dp_accounting.pld import common

    assert common.compute_self_convolve_bounds is fast_pld.self_convolve_bounds


def test_bounds_cached_per_pmf_stay_dp_accountings_and_follow_a_changed_pmf():
    from privacy import fast_pld

    probs = from_subsampled_gaussian(0.7293342243400441, 0.1, 1e-3)._pmf_remove._probs.copy()
    fast_pld._MGF_CACHE.clear()
    for count in (1, 2, 3, 4, 6, 8, 12, 16, 24, 30, 1000):  # a ledger's checkpoints
        want = fast_pld._DP_ACCOUNTING_BOUNDS(probs, count, 1e-15)
        assert fast_pld.self_convolve_bounds(probs, count, 1e-15) == want
    assert len(fast_pld._MGF_CACHE) == 1
    changed = probs.copy()
    changed[len(changed) // 2] *= 0.5  # other bytes: another entry, not a stale one
    want = fast_pld._DP_ACCOUNTING_BOUNDS(changed, 30, 1e-15)
    assert fast_pld.self_convolve_bounds(changed, 30, 1e-15) == want
    assert len(fast_pld._MGF_CACHE) == 2
