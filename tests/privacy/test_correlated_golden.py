"""Golden values for the correlated-noise factorizations: numbers the papers state and
values from other implementations' tests, each recomputed here by this repository's
code (privacy.correlated); every test names its source."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from privacy import correlated as cr
from privacy.accounting import PrivacyLedger, Release


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.CACHE_ENV, str(tmp_path / "cache"))


def _sqrt_coefs(n: int) -> np.ndarray:
    """r_k = binom(2k, k) / 4^k, exactly (fractions), as floats."""
    return np.array([float(Fraction(math.comb(2 * k, k), 4**k)) for k in range(n)])


# -- DP-FTRL, the honest tree (Kairouz et al., ICML 2021) ----------------------------------
@pytest.mark.parametrize(("n", "levels"), [(1, 1), (2, 2), (3, 3), (8, 4), (300, 10), (2000, 12)])
def test_tree_one_participation_sensitivity_is_the_papers_node_count(n, levels):
    """Kairouz et al. 2021, Section 3 (after Dwork et al. 2010, Chan, Shi and Song 2011):
    in the binary tree over T rounds each x_t enters ceil(lg T) + 1 nodes, so the L2
    sensitivity of one participation is sqrt(ceil(lg T) + 1) (clip 1)."""
    assert levels == math.ceil(math.log2(n)) + 1
    assert cr.tree_sensitivity(n, participations=1) == pytest.approx(math.sqrt(levels), abs=0)
    if n <= 300:  # the strategy matrix itself: its largest column norm
        c = cr.tree_strategy(n)
        assert float(np.linalg.norm(c, axis=0).max()) == pytest.approx(math.sqrt(levels))


@pytest.mark.parametrize(("n", "total"), [(8, 13), (1024, 5121)])
def test_honest_tree_prefix_noise_is_one_node_per_bit(n, total):
    """Kairouz et al. 2021 (the honest tree, their Algorithm 1's noise): prefix sum t
    carries the noise of the nodes of t's binary representation, popcount(t) of them.
    Summed over t = 1..2^L that is L 2^(L-1) + 1 (hand-computed: 13 for n = 8, 5121 for
    n = 1024), the decoder's squared Frobenius norm."""
    b = cr.tree_decoder(n)
    np.testing.assert_array_equal(b.sum(axis=1), [bin(t).count("1") for t in range(1, n + 1)])
    assert float(np.sum(b * b)) == total
    assert cr.prefix_sum_error(b, noise_std=1.0) == pytest.approx(total / n, rel=1e-15)


def test_two_round_tree_matches_jax_privacys_test_matrix():
    """Value from jax-privacy's test ``DenseTest.test_error`` (matrix_factorization
    dense_test.py, "n=2 tree aggregation"): C = [[1, 0], [0, 1], [1, 1]]; with Honaker's
    full decoder (the pseudoinverse) each prefix sum's error is 2/3, while the honest
    decoder (used here, Kairouz et al.'s online one) pays 1 and 1."""
    c = cr.tree_strategy(2)
    np.testing.assert_array_equal(c, [[1, 0], [0, 1], [1, 1]])
    a = cr.prefix_sum_workload(2)
    honaker = a @ np.linalg.pinv(c)
    np.testing.assert_allclose(np.sum(honaker**2, axis=1), [2 / 3, 2 / 3], rtol=1e-12)
    honest = cr.tree_decoder(2)
    np.testing.assert_array_equal(honest @ c, a)  # A = B C
    np.testing.assert_array_equal(np.sum(honest**2, axis=1), [1, 1])


# -- the square-root factorization (Fichtenberger, Henzinger, Upadhyay, ICML 2023) ----------
def test_square_root_coefficients_factorize_prefix_sums():
    """Fichtenberger, Henzinger and Upadhyay 2023 ("Constant matters"): B = C = A^(1/2),
    lower-triangular Toeplitz with r_k = binom(2k, k) / 4^k, the Taylor coefficients of
    (1 - x)^(-1/2): 1, 1/2, 3/8, 5/16, 35/128, 63/256."""
    r = _sqrt_coefs(6)
    np.testing.assert_array_equal(r, [1, 1 / 2, 3 / 8, 5 / 16, 35 / 128, 63 / 256])
    n = 64
    root = cr.BandedFactorization(n, n, tuple(_sqrt_coefs(n)))
    c = root.strategy()
    np.testing.assert_allclose(c @ c, cr.prefix_sum_workload(n), atol=1e-12)
    np.testing.assert_allclose(root.decoder(), c, atol=1e-12)  # B = A C^-1 = A^(1/2)


@pytest.mark.parametrize("n", [16, 256, 1024])
def test_square_root_max_error_grows_as_log_n_over_pi(n):
    """Fichtenberger, Henzinger and Upadhyay 2023: the factorization's max error
    ||B||_(2->inf) ||C||_(1->2) equals sum_{k<n} r_k^2 = ln(n)/pi + O(1). With the Wallis
    bounds 1/(pi(k + 1/2)) <= r_k^2 <= 1/(pi(k + 1/4)) (k >= 1) the sum is pinned between
    two harmonic-type sums; both factors are computed here from C (its largest column
    norm, the sensitivity) and from B (its largest row norm)."""
    r = _sqrt_coefs(n)
    root = cr.BandedFactorization(n, n, tuple(r))
    k = np.arange(1, n)
    low = 1 + np.sum(1 / (math.pi * (k + 0.5)))
    high = 1 + np.sum(1 / (math.pi * (k + 0.25)))
    sens = cr.sensitivity(root.strategy(), participations=1, min_separation=1).value
    row = float(np.max(np.linalg.norm(root.decoder(), axis=1)))
    max_error = sens * row
    assert low <= max_error <= high
    assert max_error == pytest.approx(float(np.sum(r * r)), rel=1e-12)
    # ln(n)/pi + O(1): the O(1) is 1.061 at n = 16, 1.066 at n = 1 024
    assert 1.06 < max_error - math.log(n) / math.pi < 1.07


def test_optimised_full_band_beats_the_square_root_on_its_objective():
    """The L-BFGS optimum of ||A C^-1||_F^2 at unit column norm (Choquette-Choo et al.
    2023's objective for one participation) is at most the square-root factorization's
    value, sum_k r_k^2 * sum_m (n - m) r_m^2 (B = C = A^(1/2)), and for n = 2 it is the
    hand-derived optimum: c = (1, c_1) with c_1 the root of 2c^3 - 3c^2 + 4c - 1 in
    (0, 1/2), loss (1 + c_1^2)(2 + (1 - c_1)^2)."""
    n = 64
    r = _sqrt_coefs(n)
    root_loss = float(np.sum(r * r) * np.sum((n - np.arange(n)) * r * r))
    assert cr.optimize_banded(n, n).loss <= root_loss
    roots = np.roots([2, -3, 4, -1])
    (c1,) = [float(x.real) for x in roots if abs(x.imag) < 1e-12 and 0 < x.real < 0.5]
    got = cr.optimize_banded(2, 2)
    assert got.coefs[1] / got.coefs[0] == pytest.approx(c1, rel=1e-5)
    assert got.loss == pytest.approx((1 + c1**2) * (2 + (1 - c1) ** 2), rel=1e-9)


# -- matrix-mechanism error and sensitivity (jax-privacy's tests) --------------------------
def test_two_by_two_factorization_error_matches_jax_privacy():
    """Value from jax-privacy's test ``DenseTest.test_error`` ("2x2 prefix sum, simple
    factorization"): C = [[1, 0], [0.5, 1]] gives B = [[1, 0], [0.5, 1]], per-query
    errors [1, 1.25], mean error 1.125."""
    f = cr.BandedFactorization(2, 2, (1.0, 0.5))
    np.testing.assert_allclose(f.decoder(), [[1, 0], [0.5, 1]], atol=0)
    np.testing.assert_allclose(np.sum(f.decoder() ** 2, axis=1), [1, 1.25], atol=0)
    assert cr.prefix_sum_error(f.decoder(), noise_std=1.0) == 1.125


@pytest.mark.parametrize("n", [1, 2, 7, 14])
def test_identity_strategy_errors_match_jax_privacy(n):
    """Values from jax-privacy's tests ``ToeplitzErrorTest.test_mean_error_identity`` and
    ``test_max_error_identity``: C = I (one band, DP-FedAvg's noise) has mean prefix-sum
    error (n + 1) / 2 and max error n."""
    b = cr.optimize_banded(n, 1).decoder()
    assert cr.prefix_sum_error(b, noise_std=1.0) == pytest.approx((n + 1) / 2, rel=1e-15)
    assert float(np.max(np.sum(b * b, axis=1))) == n


@pytest.mark.parametrize(("n", "k", "expected"), [(5, 2, 17), (5, 4, 46), (3, 1, 3)])
def test_lower_triangular_ones_sensitivity_matches_jax_privacy(n, k, expected):
    """jax-privacy's test ``ToeplitzTest.test_sensitivity_squared_tri``: for C = the
    n x n lower-triangular ones, min separation 1 and k participations, the squared
    sensitivity is the squared norm of the sum of C's first k columns (hand-computed:
    n = 5, k = 2: 1 + 4 * 4 = 17; k = 4: 1 + 4 + 9 + 16 + 16 = 46; n = 3, k = 1: 3)."""
    got = cr.sensitivity(np.tri(n), participations=k, min_separation=1)
    assert got.value**2 == pytest.approx(expected, rel=1e-12)
    assert got.value**2 == pytest.approx(float(np.sum(np.tri(n)[:, :k].sum(axis=1) ** 2)))


def test_amplified_at_q_one_is_the_unamplified_min_separation_mechanism():
    """jax-privacy's test ``ToeplitzAmplificationTest.test_helper_stddev_at_max_bands``:
    with as many bands as groups of one cohort each (q = 1) amplified banded MF needs the
    noise of the b-min-separation mechanism without amplification. Here: the amplified
    ledger's k Poisson-sampled Gaussians at q = 1, multiplier z (max column norm 1), give
    the ε of the cyclic charge, one Gaussian at z / sens with sens = sqrt(k)."""
    n, b, z = 40, 4, 3.0
    k = math.ceil(n / b)
    f = cr.optimize_banded(n, b)
    sens = cr.sensitivity(f.strategy(), participations=k, min_separation=b)
    assert sens.value == pytest.approx(math.sqrt(k), rel=1e-12)
    ledger = PrivacyLedger(accountant="pld", target_delta=1e-5, sampling="poisson")
    ledger.charge(
        Release(
            server_round=1,
            kind="model-updates",
            mechanism="gaussian",
            noise_multiplier=z,
            sampling="poisson",
            sample_size=10,
            population=10,
            count=k,
        )
    )
    cyclic = cr.epsilon(noise_multiplier=z, sensitivity=sens.value, delta=1e-5)
    assert ledger.epsilon() == pytest.approx(cyclic, rel=2e-3)


def test_calibration_matches_pfl_researchs_pld_accountant():
    """Value from pfl-research 0.6.0, computed in its own environment by
    bench/peers/pfl_banded_mf.py (N = 200, m = 10, 60 rounds, b = 20: k = 3):
    ``PLDPrivacyAccountant(num_compositions=3, sampling_probability=1.0,
    mechanism="gaussian", epsilon=2, delta=1e-5).cohort_noise_parameter`` is
    3.4534454345703125. k Gaussians at sigma are one Gaussian at sigma / sqrt(k), so the
    cyclic calibration at sensitivity sqrt(3) must agree, on the private side."""
    pfl = 3.4534454345703125
    z = cr.calibrate(target_epsilon=2.0, sensitivity=math.sqrt(3), delta=1e-5)
    assert z == pytest.approx(pfl, rel=1e-4)
    assert cr.epsilon(noise_multiplier=pfl, sensitivity=math.sqrt(3), delta=1e-5) <= 2.0
    assert cr.epsilon(noise_multiplier=z, sensitivity=math.sqrt(3), delta=1e-5) <= 2.0
