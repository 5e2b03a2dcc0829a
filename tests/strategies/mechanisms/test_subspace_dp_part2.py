"""Subspace-DP part 2 in the strategy: trace allocation, quantization + top-up, SPI."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privacy.allocation import (
    distortion_weights,
    fair_allocation,
    subspace_energies,
    water_filling,
)
from privacy.certificates import spi
from privacy.quantization import step_for_bits
from privacy.subspace import orthonormalize
from strategies import StopTraining
from strategies.mechanisms.subspace_dp import POOLED
from tests.strategies.mechanisms.test_dp_fedavg import _wrapper as _dp_wrapper
from tests.strategies.mechanisms.test_subspace_dp import _round, _wrapper


def _public(rng, n, d, scale):
    return rng.standard_normal((n, d)) * scale


def test_distortion_weights_are_the_traces_at_the_metric():
    lam, energies = np.array([3.0, 1.0]), np.array([2.0, 0.5])
    a, b = distortion_weights(10.0, energies, dim=6, tau=2.0, lam=lam)
    assert a == pytest.approx(4 / 2 + 1 / 5 + 1 / 3)  # (d − k)/τ + Σ 1/(τ + λ)
    assert b == pytest.approx(2 * 10 + 3 * 2 + 1 * 0.5)  # τ E‖x‖² + Σ λ g


def test_water_filling_allocation_sets_the_metric_from_public_samples():
    rng = np.random.default_rng(0)
    d = 12
    basis = orthonormalize(rng.standard_normal((d, 3)))
    samples = _public(rng, 40, d, np.linspace(0.2, 3.0, d))
    strategy = _wrapper(
        initial_basis=basis, rank=3, tau=1.0, budget=6.0, allocation="water-filling"
    )
    strategy.public_samples = {POOLED: samples}
    _round(strategy, {"w": np.zeros(d)}, [{"w": np.full(d, 0.01)}] * 3)
    energies = subspace_energies(samples, basis)
    total = float(np.mean(np.sum(samples**2, axis=1)))
    a, b = distortion_weights(total, energies, dim=d, tau=1.0, lam=np.full(3, 2.0))
    expected = water_filling(energies, a=a, b=b, tau=1.0, budget=6.0)
    np.testing.assert_allclose(strategy.metric.lam, expected)
    assert not np.allclose(expected, 2.0)  # not the uniform split


def test_fairness_allocation_lowers_the_worst_group_distortion():
    rng = np.random.default_rng(1)
    d = 16
    basis = orthonormalize(rng.standard_normal((d, 4)))
    # Group "a" puts its energy on U's first directions, group "b" off U.
    group_a = rng.standard_normal((30, 4)) * [3.0, 2.0, 0.1, 0.1] @ basis.T
    group_b = _public(rng, 30, d, 1.0)
    pooled = np.vstack([group_a, group_b])
    strategy = _wrapper(initial_basis=basis, rank=4, tau=1.0, budget=8.0, allocation="fairness")
    strategy.public_samples = {POOLED: pooled, "a": group_a, "b": group_b}
    _round(strategy, {"w": np.zeros(d)}, [{"w": np.full(d, 0.01)}] * 3)
    energies = np.stack([subspace_energies(x, basis) for x in (group_a, group_b)])
    total = np.array([np.mean(np.sum(x**2, axis=1)) for x in (group_a, group_b)])
    a, b = distortion_weights(
        float(np.mean(np.sum(pooled**2, axis=1))),
        subspace_energies(pooled, basis),
        dim=d,
        tau=1.0,
        lam=np.full(4, 2.0),
    )
    offsets = a * 1.0 * (total - energies.sum(axis=1))
    fair = fair_allocation(energies, a=a, b=b, tau=1.0, budget=8.0, offsets=offsets)
    np.testing.assert_allclose(strategy.metric.lam, fair.lam)

    def worst(lam):
        p = 1.0 + lam
        return max(np.sum(a * e * p + b / p) + o for e, o in zip(energies, offsets, strict=True))

    pooled_lam = water_filling(subspace_energies(pooled, basis), a=a, b=b, tau=1.0, budget=8.0)
    assert worst(fair.lam) <= worst(pooled_lam) + 1e-9
    assert worst(fair.lam) < worst(np.full(4, 2.0))


def test_allocation_without_public_samples_stops_before_training():
    basis = orthonormalize(np.random.default_rng(2).standard_normal((6, 2)))
    strategy = _wrapper(initial_basis=basis, allocation="water-filling")
    with pytest.raises(StopTraining, match="public samples"):
        _round(strategy, {"w": np.zeros(6)}, [{"w": np.zeros(6)}] * 3)
    with pytest.raises(ValueError, match="allocation"):
        _wrapper(allocation="greedy")


def test_quantized_rounds_charge_only_the_gaussian_top_up():
    m, z, clip, bits = 3, 2.0, 1.0, 4
    strategy = _wrapper(m=m, z=z, clip=clip, tau=1.0, quantize_bits=bits)
    step = step_for_bits(clip, bits)
    z_top = math.sqrt(z**2 - m * step**2 / (12 * clip**2))
    assert strategy.z_noise == pytest.approx(z_top)
    rng = np.random.default_rng(3)
    deltas = [{"w": rng.standard_normal(10) * 0.1} for _ in range(m)]
    _, (arrays, metrics) = _round(strategy, {"w": np.zeros(10)}, deltas)
    (release,) = strategy.ledger.releases
    assert release.noise_multiplier == pytest.approx(z_top / 2)  # replace-one
    assert "top-up" in release.note
    assert metrics["subspace-quant-bits-per-update"] == 10 * bits
    # Each decoded update is off by uniform whitened errors: E‖x̂ − x‖² = d Δ²/12 (τ = 1).
    assert 0 < metrics["subspace-quant-error"] < 10 * step**2 / 12 * 4
    assert np.all(np.isfinite(arrays["w"].numpy()))


def test_quantization_that_leaves_no_top_up_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"'subspace\.quantize-bits' = 2"):
        _wrapper(m=50, z=0.5, clip=1.0, quantize_bits=2)


def test_quantized_aggregate_is_unbiased_with_the_mechanism_variance():
    """Quantization errors + top-up: the aggregate is unbiased and its noise variance is
    the mechanism's z²C²/m² per coordinate (P = I), as without quantization."""
    m, d, z, runs = 3, 6, 0.25, 300
    deltas = [{"w": np.full(d, 0.05 * (i + 1))} for i in range(m)]  # never clipped
    means = []
    for seed in range(runs):
        strategy = _wrapper(m=m, z=z, clip=1.0, tau=1.0, quantize_bits=3)
        strategy.seed, strategy.rng = seed, np.random.default_rng(seed)  # new dither, noise
        _, (arrays, _) = _round(strategy, {"w": np.zeros(d)}, deltas)
        means.append(arrays["w"].numpy())
    errors = np.array(means) - 0.1
    variance = z**2 / m**2
    n = errors.size
    assert abs(errors.mean()) < 5 * math.sqrt(variance / n)
    assert errors.var() == pytest.approx(variance, rel=5 * math.sqrt(2 / n))


def test_spi_values_of_isotropic_and_elliptical_runs():
    dp = _dp_wrapper(z=1.5)
    assert dp.spi_values() is None
    _round(dp, {"w": np.zeros(8)}, [{"w": np.zeros(8)}] * 3)
    assert dp.spi_values()[1] == pytest.approx(2.25)
    assert dp.spi_values()[8] == pytest.approx(8 * 2.25)

    basis = orthonormalize(np.random.default_rng(5).standard_normal((8, 2)))
    strategy = _wrapper(initial_basis=basis, z=1.5, tau=1.0, budget=6.0)
    _round(strategy, {"w": np.zeros(8)}, [{"w": np.zeros(8)}] * 3)
    expected = spi([4.0, 4.0], floor=1.0, dim=8, noise_multiplier=strategy.z_train)
    assert strategy.spi_values() == pytest.approx(expected)
    assert strategy.spi_values()[2] < 2 * strategy.z_train**2  # below the isotropic k·σ²


def test_a_round_with_no_update_reports_no_statistics_over_updates():
    """No reply (or an empty Poisson cohort): the noise alone is released and charged;
    the clip fraction, mean P-norm and quantization error are over no update, so they
    are left out of the round's metrics instead of reported as NaN or 0."""
    strategy = _wrapper(m=3, z=2.0, clip=1.0, tau=1.0, quantize_bits=4)
    _, (arrays, metrics) = _round(strategy, {"w": np.zeros(10)}, [], nodes=[1, 2, 3])
    assert len(strategy.ledger.releases) == 1
    assert np.all(np.isfinite(arrays["w"].numpy())) and np.any(arrays["w"].numpy() != 0)
    assert metrics["subspace-quant-bits-per-update"] == 10 * 4
    for key in ("subspace-clip-fraction", "subspace-mean-pnorm", "subspace-quant-error"):
        assert key not in metrics
