"""Anisotropic subtractive-dither quantization and the Gaussian top-up (Subspace-DP-FL)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from privacy.mechanisms import make_generator
from privacy.quantization import (
    AnisotropicQuantizer,
    bits_for_step,
    code_dtype,
    dequantize,
    max_code,
    quantize,
    step_for_bits,
    topup_noise_multiplier,
)
from privacy.subspace import SubspaceMetric, orthonormalize

N = 20_000


def random_metric(d=6, k=2, tau=0.5, lam=(4.0, 1.0), seed=0):
    basis = orthonormalize(np.random.default_rng(seed).standard_normal((d, k)))
    return SubspaceMetric(basis=basis, lam=np.asarray(lam[:k]), tau=tau)


def dense(metric):
    u = metric.basis
    return u @ np.diag(metric.lam) @ u.T + metric.tau * np.eye(metric.dim)


def inverse_sqrt(p):
    values, vectors = np.linalg.eigh(p)
    return vectors @ np.diag(values**-0.5) @ vectors.T


def covariance_se(a, var, kurtosis_excess, n):
    """SE of the empirical covariance entries of ``e = A w``, w iid with variance ``var``
    and fourth cumulant ``kurtosis_excess·var²``:
    Var(e_i e_j) = S_ij² + S_ii S_jj + κ4 Σ_k A_ik² A_jk² with S = var·AAᵀ."""
    s = var * a @ a.T
    fourth = kurtosis_excess * var**2 * (a**2) @ (a**2).T
    return s, np.sqrt((s**2 + np.outer(np.diag(s), np.diag(s)) + fourth) / n)


def points_on_ball(metric, clip, n, rng):
    """n updates (d, n) with ‖x‖_P = clip·r, r ~ U(0, 1): varied directions and sizes."""
    white = rng.standard_normal((metric.dim, n))
    white *= clip * rng.uniform(0, 1, n) / np.linalg.norm(white, axis=0)
    return metric.power(white, -0.5)


def test_step_and_bits_are_inverse_and_hand_computed():
    # Δ = 2C/(2^b − 3): b = 2 → 2C, b = 3 → 2C/5, b = 8 → 2C/253.
    assert step_for_bits(1.0, 2) == pytest.approx(2.0)
    assert step_for_bits(0.5, 3) == pytest.approx(0.2)
    assert step_for_bits(3.0, 8) == pytest.approx(6.0 / 253.0)
    # L = ceil(C/Δ + 1/2): Δ = 0.4, C = 1 → L = 3 (7 codes, 3 bits).
    assert max_code(1.0, 0.4) == 3 and bits_for_step(1.0, 0.4) == 3
    assert bits_for_step(1.0, 100.0) == 2  # even a huge step needs -1, 0, 1
    for clip in (0.3, 1.0, 7.0):
        for bits in range(2, 33):
            step = step_for_bits(clip, bits)
            assert bits_for_step(clip, step) == bits
            assert max_code(clip, step) == 2 ** (bits - 1) - 1
            # Smallest: any smaller step needs one more bit.
            assert bits_for_step(clip, step * (1 - 1e-6)) == bits + 1


def test_code_dtypes_and_bits_per_update():
    assert [code_dtype(b) for b in (2, 8, 9, 16, 17, 32)] == [
        np.int8,
        np.int8,
        np.int16,
        np.int16,
        np.int32,
        np.int32,
    ]
    quant = AnisotropicQuantizer(random_metric(), clip_norm=1.0, bits=5)
    assert quant.bits_per_update(6) == 30
    assert quant.error_variance == pytest.approx((2.0 / 29.0) ** 2 / 12.0)
    codes = quant.encode(np.zeros(6), make_generator(0, 1))
    assert codes.dtype == np.int8 and codes.shape == (6,)


@pytest.mark.parametrize("bits", [2, 3, 8, 12, 32])
def test_adversarial_corners_use_the_full_range_and_never_overflow(bits):
    clip = 1.3
    step = step_for_bits(clip, bits)
    limit = 2 ** (bits - 1) - 1
    d = 4
    top = np.nextafter(step / 2, 0.0)  # u < Δ/2: the dither interval is half-open
    for j in range(d):
        for sign in (1.0, -1.0):
            white = np.zeros(d)
            white[j] = sign * clip
            for u in (-step / 2, top, step / 2, 0.0):
                codes = quantize(white, np.full(d, u), step, bits)
                assert np.max(np.abs(codes.astype(np.int64))) <= limit
    # The corners reach ±M exactly: the bound is attained, the range fully used.
    corner = np.array([clip, -clip])
    codes = quantize(corner, np.array([top, -step / 2]), step, bits)
    assert codes.tolist() == [limit, -limit]
    with pytest.raises(AssertionError, match="overflows"):
        quantize(np.array([clip]), np.array([top]), step / 2, bits)


def test_encode_at_the_ball_surface_never_overflows():
    metric = random_metric()
    for bits in (2, 3, 8):
        quant = AnisotropicQuantizer(metric, clip_norm=2.0, bits=bits)
        # All mass on one whitened coordinate (y = ±C e_j), and a metric direction.
        white = np.concatenate([2.0 * np.eye(6), -2.0 * np.eye(6)], axis=1)
        x = metric.power(np.repeat(white, 500, axis=1), -0.5)
        codes = quant.encode(x, make_generator(1, bits))
        assert np.max(np.abs(codes.astype(np.int64))) == 2 ** (bits - 1) - 1
        along_u = 2.0 * metric.basis[:, 0] / math.sqrt(metric.tau + metric.lam[0])
        assert metric.norm(along_u) == pytest.approx(2.0)
        quant.encode(along_u, make_generator(2, bits))  # accepted, no overflow


def test_decode_rebuilds_the_dither_from_the_seed():
    metric = random_metric()
    quant = AnisotropicQuantizer(metric, clip_norm=1.0, bits=4)
    x = points_on_ball(metric, 1.0, 1, np.random.default_rng(3))[:, 0]
    codes = quant.encode(x, make_generator(7, 2, 5))
    decoded = quant.decode(codes, make_generator(7, 2, 5))
    white_error = metric.power(decoded - x, 0.5)
    assert np.max(np.abs(white_error)) <= quant.step / 2 + 1e-12  # one half-step per coord
    wrong = quant.decode(codes, make_generator(7, 2, 6))
    assert np.max(np.abs(metric.power(wrong - x, 0.5))) > quant.step / 2


@pytest.mark.parametrize("where", ["origin", "surface"])
def test_whitened_error_is_uniform_and_does_not_depend_on_x(where):
    """For fixed x the whitened error ŷ − y is Uniform[−Δ/2, Δ/2): mean 0 and variance
    Δ²/12 within 5 SE (Var of e² is Δ⁴/180), and a KS test against the uniform."""
    metric = random_metric()
    quant = AnisotropicQuantizer(metric, clip_norm=1.0, bits=3)
    step = quant.step
    x = np.zeros(6)
    if where == "surface":  # the top metric direction, P-norm C
        x = metric.basis[:, 0] / math.sqrt(metric.tau + metric.lam[0])
    xs = np.repeat(x[:, None], N, axis=1)
    rng_seed = 11 if where == "origin" else 12
    decoded = quant.decode(quant.encode(xs, make_generator(rng_seed)), make_generator(rng_seed))
    error = metric.power(decoded - xs, 0.5)
    assert np.all(np.abs(error) <= step / 2 + 1e-12)
    mean_se = math.sqrt(quant.error_variance / N)
    assert np.all(np.abs(error.mean(axis=1)) <= 5 * mean_se)
    var_se = math.sqrt(step**4 / 180.0 / N)
    assert np.all(np.abs((error**2).mean(axis=1) - quant.error_variance) <= 5 * var_se)
    for row in error:
        assert stats.kstest(row, stats.uniform(-step / 2, step).cdf).pvalue > 1e-4


def test_whitened_error_is_uncorrelated_with_the_update():
    """At b = 2 (Δ = 2C, the coarsest grid) the error and y, and their squares, have
    correlations within 5/√n of 0; plain rounding (no dither) fails both by far."""
    metric = random_metric()
    quant = AnisotropicQuantizer(metric, clip_norm=1.0, bits=2)
    xs = points_on_ball(metric, 1.0, N, np.random.default_rng(4))
    white = metric.power(xs, 0.5)
    decoded = quant.decode(quant.encode(xs, make_generator(9)), make_generator(9))
    error = metric.power(decoded, 0.5) - white
    plain = dequantize(np.rint(white / quant.step), 0.0, quant.step) - white
    for err, ok in ((error, True), (plain, False)):
        corr = np.corrcoef(np.vstack([err, white]))[:6, 6:]
        corr_sq = np.corrcoef(np.vstack([err**2, white**2]))[:6, 6:]
        small = np.all(np.abs(corr) <= 5 / math.sqrt(N))
        small_sq = np.all(np.abs(corr_sq) <= 5 / math.sqrt(N))
        assert small == ok and small_sq == ok


def test_error_covariance_in_original_coordinates_is_step2_over_12_p_inverse():
    """Cov(x̂ − x) vs (Δ²/12)P⁻¹ entry-wise within 5 SE; the SE uses the uniform's
    excess kurtosis −6/5 (computed with a dense P^(-½), independent of the module)."""
    metric = random_metric()
    quant = AnisotropicQuantizer(metric, clip_norm=1.0, bits=3)
    xs = points_on_ball(metric, 1.0, N, np.random.default_rng(5))
    error = quant.decode(quant.encode(xs, make_generator(13)), make_generator(13)) - xs
    expected, se = covariance_se(inverse_sqrt(dense(metric)), quant.error_variance, -1.2, N)
    np.testing.assert_allclose(expected, quant.error_variance * np.linalg.inv(dense(metric)))
    empirical = error @ error.T / N
    assert np.all(np.abs(empirical - expected) <= 5 * se)
    # The shape matters: an isotropic (Δ²/12)·I is far outside the band.
    assert np.any(np.abs(empirical - quant.error_variance * np.eye(6)) > 20 * se)


def test_quantization_plus_topup_keeps_the_mechanism_covariance():
    """m = 4 clients' errors + N(0, C²z_top² P⁻¹) on the sum: total ≈ σ²C²P⁻¹ (5 SE).
    Leaving out the top-up correction (σ instead of z_top) would miss by ≈ 20 SE."""
    metric = random_metric()
    clip, sigma, m = 0.8, 0.5, 4
    quant = AnisotropicQuantizer(metric, clip_norm=clip, bits=3)
    z_top = quant.topup_noise_multiplier(sigma, num_clients=m)
    assert z_top == pytest.approx(math.sqrt(sigma**2 - m * quant.step**2 / (12 * clip**2)))
    rng = np.random.default_rng(6)
    total = np.zeros((6, N))
    for client in range(m):
        xs = points_on_ball(metric, clip, N, rng)
        decoded = quant.decode(
            quant.encode(xs, make_generator(8, client)), make_generator(8, client)
        )
        total += decoded - xs
    noise_rng = make_generator(8, 99)
    total += np.stack([metric.sample(clip * z_top, noise_rng) for _ in range(N)], axis=1)
    # Whitened total: sum of m uniforms (κ4 = −1.2 m s²) plus a Gaussian.
    var = (sigma * clip) ** 2
    kappa = -1.2 * m * quant.error_variance**2 / var**2
    expected, se = covariance_se(inverse_sqrt(dense(metric)), var, kappa, N)
    empirical = total @ total.T / N
    assert np.all(np.abs(empirical - expected) <= 5 * se)
    missing = m * quant.error_variance * np.linalg.inv(dense(metric))
    assert np.max(np.abs(missing) / se) > 15


def test_isotropic_metric_quantizes_the_scaled_coordinates():
    metric = SubspaceMetric.isotropic(3, tau=4.0)  # y = 2x
    quant = AnisotropicQuantizer(metric, clip_norm=1.0, bits=3)  # Δ = 0.4
    x = np.array([0.3, -0.2, 0.0])  # ‖x‖_P = 2·√0.13 ≈ 0.72
    codes = quant.encode(x, make_generator(0))
    dither = make_generator(0).uniform(-0.2, 0.2, size=3)
    np.testing.assert_array_equal(codes, np.rint((2 * x + dither) / 0.4).astype(np.int8))
    decoded = quant.decode(codes, make_generator(0))
    np.testing.assert_allclose(decoded, (0.4 * codes - dither) / 2.0, rtol=1e-12)


def test_infeasible_topup_raises_with_the_numbers():
    # m Δ²/12 = 12·4/12 = 4 ≥ σ²C² = 1: 2 bits at C = 1 (Δ = 2).
    with pytest.raises(ValueError, match=r"no valid Gaussian top-up.*2 bits"):
        topup_noise_multiplier(1.0, clip_norm=1.0, step=2.0, num_clients=12)
    with pytest.raises(ValueError, match="no valid"):  # the equality case: z_top = 0
        topup_noise_multiplier(1.0, clip_norm=1.0, step=2.0, num_clients=3)
    assert topup_noise_multiplier(1.0, clip_norm=1.0, step=2.0, num_clients=2) == pytest.approx(
        math.sqrt(1 / 3)
    )


def test_bad_inputs_raise_naming_the_argument():
    metric = random_metric()
    for bits in (0, 1, 33, 2.5, True):
        with pytest.raises(ValueError, match="bits"):
            AnisotropicQuantizer(metric, clip_norm=1.0, bits=bits)
    for clip in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="clip_norm"):
            AnisotropicQuantizer(metric, clip_norm=clip, bits=4)
        with pytest.raises(ValueError, match="clip_norm"):
            step_for_bits(clip, 4)
    quant = AnisotropicQuantizer(metric, clip_norm=1.0, bits=4)
    x = metric.basis[:, 0] / math.sqrt(metric.tau + metric.lam[0])  # P-norm exactly 1
    quant.encode(x * (1 + 1e-12), make_generator(0))  # float tolerance: accepted
    with pytest.raises(ValueError, match="x has P-norm"):
        quant.encode(x * 1.001, make_generator(0))
    with pytest.raises(ValueError, match="x must have shape"):
        quant.encode(np.zeros(5), make_generator(0))
    with pytest.raises(ValueError, match="codes must lie"):
        quant.decode(np.full(6, 8, np.int8), make_generator(0))
    with pytest.raises(ValueError, match="codes must be integers"):
        quant.decode(np.zeros(6), make_generator(0))
    with pytest.raises(ValueError, match="num_clients"):
        quant.topup_noise_multiplier(1.0, num_clients=0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        quant.topup_noise_multiplier(-1.0, num_clients=2)
    with pytest.raises(ValueError, match="d must"):
        quant.bits_per_update(0)
