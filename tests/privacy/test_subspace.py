"""Geometry-aligned DP: P-norm, elliptical noise, PMU sketches and the PTR gate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privacy.mechanisms import make_generator
from privacy.subspace import (
    EllipticalGaussianMechanism,
    SketchAccumulator,
    SubspaceMetric,
    combined_noise_multiplier,
    estimate_subspace,
    flatten,
    orthonormalize,
    pmu_noise_multiplier,
    principal_angle,
    release_sketch,
    sketch_matrix,
    top_subspace,
    unflatten,
    uniform_allocation,
)


def random_metric(d=7, k=2, tau=0.5, seed=0, lam=None):
    rng = np.random.default_rng(seed)
    basis = orthonormalize(rng.standard_normal((d, k)))
    lam = np.array([3.0, 1.5][:k]) if lam is None else np.asarray(lam)
    return SubspaceMetric(basis=basis, lam=lam, tau=tau)


def dense(metric):
    u = metric.basis
    return u @ np.diag(metric.lam) @ u.T + metric.tau * np.eye(metric.dim)


def test_powers_and_norm_match_the_dense_matrix():
    metric = random_metric()
    p = dense(metric)
    v = np.random.default_rng(1).standard_normal(metric.dim)
    np.testing.assert_allclose(metric.power(v, 1.0), p @ v, rtol=1e-12)
    np.testing.assert_allclose(metric.power(v, -1.0), np.linalg.solve(p, v), rtol=1e-10)
    half = metric.power(np.eye(metric.dim), 0.5)
    np.testing.assert_allclose(half @ half, p, atol=1e-12)
    np.testing.assert_allclose(metric.power(metric.power(v, 0.5), -0.5), v, rtol=1e-12)
    assert metric.norm(v) == pytest.approx(math.sqrt(v @ p @ v), rel=1e-12)
    # The metric's eigenvalues: tau + lam along U, tau on the complement.
    expected = sorted([0.5] * 5 + [3.5, 2.0])
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(p)), expected, atol=1e-12)


def test_isotropic_metric_is_a_scaled_l2_norm():
    metric = SubspaceMetric.isotropic(5, tau=4.0)
    v = np.array([3.0, 4.0, 0.0, 0.0, 0.0])
    assert metric.norm(v) == pytest.approx(10.0)
    assert metric.rank == 0


def test_invalid_metrics_are_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="orthonormal"):
        SubspaceMetric(basis=rng.standard_normal((6, 2)), lam=np.ones(2), tau=1.0)
    with pytest.raises(ValueError, match="positive definite"):
        random_metric(lam=[-1.0, 0.0], tau=0.5)
    with pytest.raises(ValueError, match="tau"):
        SubspaceMetric.isotropic(3, tau=0.0)
    with pytest.raises(ValueError, match="linearly dependent"):
        orthonormalize(np.ones((5, 2)))


def test_pnorm_clipping_bounds_the_whitened_update():
    metric = random_metric(d=7)
    mech = EllipticalGaussianMechanism(metric, clip_norm=1.0, noise_multiplier=1.0)
    rng = np.random.default_rng(2)
    for scale in (0.01, 1.0, 100.0):
        update = [rng.standard_normal((3, 2)).astype(np.float32) * scale, rng.standard_normal(1)]
        result = mech.clip(update)
        clipped = flatten(result.arrays)
        assert result.arrays[0].dtype == np.float32
        assert metric.norm(clipped) <= 1.0
        # ||P^1/2 g||_2 = ||g||_P: the sensitivity of the whitened release.
        assert np.linalg.norm(metric.power(clipped, 0.5)) <= 1.0 + 1e-12
        if result.clipped:
            assert metric.norm(clipped) == pytest.approx(1.0, rel=1e-6)
            # Clipping is a scaling: the direction is kept.
            np.testing.assert_allclose(clipped / result.scale, flatten(update), rtol=1e-5)
        else:
            np.testing.assert_array_equal(clipped, flatten(update))


def test_elliptical_noise_has_covariance_sigma2_c2_p_inverse():
    """Empirical covariance of 40 000 draws vs σ²C²P⁻¹, entry-wise within 5 standard
    errors; whitened by P^½ the noise is isotropic N(0, σ²C² I)."""
    metric = random_metric(d=6, k=2, tau=0.5, lam=[4.0, 1.0])
    mech = EllipticalGaussianMechanism(metric, clip_norm=0.7, noise_multiplier=1.3)
    rng = np.random.default_rng(3)
    n = 40_000
    draws = np.stack([metric.sample(mech.sum_noise_std, rng) for _ in range(n)])
    expected = mech.sum_noise_std**2 * np.linalg.inv(dense(metric))
    empirical = draws.T @ draws / n
    # Var of an entry of the empirical covariance: (S_ij² + S_ii S_jj) / n.
    se = np.sqrt((expected**2 + np.outer(np.diag(expected), np.diag(expected))) / n)
    assert np.all(np.abs(empirical - expected) <= 5 * se)
    white = metric.power(draws.T, 0.5).T
    white_cov = white.T @ white / n
    target = mech.sum_noise_std**2 * np.eye(6)
    se_white = np.sqrt((target**2 + np.outer(np.diag(target), np.diag(target))) / n)
    assert np.all(np.abs(white_cov - target) <= 5 * se_white)
    # Noise is smallest along the top direction (largest P eigenvalue).
    top = metric.basis[:, 0]
    assert top @ expected @ top == pytest.approx(mech.sum_noise_std**2 / 4.5)


def test_noise_sum_adds_elliptical_noise_to_the_arrays():
    metric = random_metric(d=7)
    mech = EllipticalGaussianMechanism(metric, clip_norm=1.0, noise_multiplier=2.0)
    total = [np.zeros((3, 2), np.float32), np.zeros(1, np.float32)]
    noised = mech.noise_sum(total, rng=make_generator(5, 1))
    again = mech.noise_sum(total, rng=make_generator(5, 1))
    assert [a.shape for a in noised] == [(3, 2), (1,)] and noised[0].dtype == np.float32
    np.testing.assert_array_equal(flatten(noised), flatten(again))  # seeded
    assert mech.dp_event() == mech.dp_event().__class__(2.0)


def test_flatten_round_trip():
    arrays = [np.arange(6.0).reshape(2, 3), np.array([7.0])]
    back = unflatten(flatten(arrays), arrays)
    for a, b in zip(arrays, back, strict=True):
        np.testing.assert_array_equal(a, b)


def planted_updates(d, k, clients, rng, off_subspace=0.0):
    basis = orthonormalize(rng.standard_normal((d, k)))
    scales = np.linspace(3.0, 1.5, k)
    updates = []
    for _ in range(clients):
        g = basis @ (scales * rng.standard_normal(k))
        updates.append(g + off_subspace * rng.standard_normal(d))
    return basis, updates


def test_pmu_recovers_a_planted_subspace_at_low_noise():
    rng = np.random.default_rng(4)
    d, k, s = 300, 3, 24
    basis, updates = planted_updates(d, k, clients=400, rng=rng, off_subspace=0.002)
    acc = SketchAccumulator(sketch_matrix(d, s, make_generator(0, 7)))
    for g in updates:
        acc.add(g)
    release = release_sketch(acc, noise_multiplier=0.05, rng=make_generator(0, 8))
    estimate = estimate_subspace(release, rank=k, lambda_ptr=1.0)
    assert principal_angle(basis, estimate.basis) < 0.05
    assert estimate.adopt
    np.testing.assert_allclose(estimate.basis.T @ estimate.basis, np.eye(k), atol=1e-10)


def test_ptr_gate_rejects_a_small_gap():
    """Isotropic directions (no subspace) or heavy noise: the gap is below threshold."""
    rng = np.random.default_rng(5)
    d, s = 300, 24
    acc = SketchAccumulator(sketch_matrix(d, s, make_generator(0, 9)))
    for _ in range(50):
        acc.add(rng.standard_normal(d))
    release = release_sketch(acc, noise_multiplier=1.0, rng=make_generator(0, 10))
    assert not estimate_subspace(release, rank=3, lambda_ptr=1.0).adopt
    # A clear planted subspace drowned by noise (50 clients, sigma_PMU = 20) is refused too.
    _, updates = planted_updates(d, 3, clients=50, rng=rng)
    acc = SketchAccumulator(sketch_matrix(d, s, make_generator(0, 11)))
    for g in updates:
        acc.add(g)
    noisy = release_sketch(acc, noise_multiplier=20.0, rng=make_generator(0, 12))
    assert not estimate_subspace(noisy, rank=3, lambda_ptr=1.0).adopt


def test_sketch_contributions_are_bounded_by_one():
    rng = np.random.default_rng(6)
    acc = SketchAccumulator(sketch_matrix(50, 8, make_generator(1, 1)))
    for scale in (1e-6, 1.0, 1e6):
        before_lift, before_second = acc.lift.copy(), acc.second_moment.copy()
        acc.add(scale * rng.standard_normal(50))
        assert np.linalg.norm(acc.lift - before_lift) <= 1.0 + 1e-12
        assert np.linalg.norm(acc.second_moment - before_second) <= 1.0 + 1e-12
    acc.add(np.zeros(50))  # contributes nothing
    assert acc.count == 4


def test_noise_split_keeps_the_zcdp_budget():
    z, r, rounds, pmu = 1.2, 0.15, 30, 3
    z_train, z_pmu = pmu_noise_multiplier(z, r, rounds, pmu)
    rho = rounds / (2 * z_train**2) + pmu / (2 * z_pmu**2)
    assert rho == pytest.approx(rounds / (2 * z**2))
    assert rounds / (2 * z_train**2) == pytest.approx((1 - r) * rounds / (2 * z**2))
    assert pmu_noise_multiplier(z, 0.0, rounds, pmu) == (z, math.inf)
    # Same-sample releases compose as one Gaussian: 1/z² adds.
    assert combined_noise_multiplier(3.0, 4.0) == pytest.approx(2.4)
    assert combined_noise_multiplier(2.0, math.inf) == pytest.approx(2.0)


def test_uniform_allocation_spends_the_trace_budget():
    lam = uniform_allocation(4, 10.0)
    np.testing.assert_allclose(lam, 2.5)
    assert uniform_allocation(0, 10.0).size == 0


@pytest.mark.parametrize("sigma", [0.05, 0.5, 1.0, 2.0, 5.0])
def test_ptr_gate_adopts_only_accurate_estimates(sigma):
    """Across noise levels, every adopted basis is within 0.4 rad of the planted one and
    the gate refuses once the lift noise dominates (σ_PMU >= 2 here: angle > 0.6 rad)."""
    rng = np.random.default_rng(4)
    basis, updates = planted_updates(300, 3, clients=400, rng=rng, off_subspace=0.002)
    acc = SketchAccumulator(sketch_matrix(300, 24, make_generator(0, 7)))
    for g in updates:
        acc.add(g)
    release = release_sketch(acc, noise_multiplier=sigma, rng=make_generator(0, 8))
    estimate = estimate_subspace(release, rank=3, lambda_ptr=1.0)
    assert estimate.adopt == (sigma < 2.0)
    if estimate.adopt:
        assert principal_angle(basis, estimate.basis) < 0.4


def test_top_subspace_of_public_samples():
    rng = np.random.default_rng(7)
    basis = orthonormalize(rng.standard_normal((30, 3)))
    samples = (basis @ (rng.standard_normal((3, 100)) * [[5.0], [3.0], [2.0]])).T
    found = top_subspace(samples, 3)
    # arccos near 1 resolves angles only to sqrt(2 * machine epsilon) = 1.5e-8
    assert found.shape == (30, 3) and principal_angle(basis, found) < 1e-7
    with pytest.raises(ValueError, match="rank"):
        top_subspace(samples[:2], 3)
