"""DP-FedAvg's server aggregate in float32 torch (privacy.device_sum) against the NumPy
path, on the CPU (the same code runs on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privacy.device_sum import clip_on_device, noisy_sum_on_device
from privacy.mechanisms import GaussianMechanism, NonFiniteUpdateError, make_generator
from strategies.mechanisms.noise_site import ServerNoise

CPU = torch.device("cpu")


def test_an_update_over_the_norm_is_scaled_to_it():
    # [3, 4] has norm 5: clipped to C = 1 it is [0.6, 0.8] (less the 1e-6 slack).
    clipped, norm = clip_on_device([np.array([3.0, 4.0], dtype=np.float32)], 1.0, CPU)
    assert norm == 5.0
    assert clipped[0].dtype == torch.float32
    np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.8], rtol=2e-6)
    assert float(torch.linalg.vector_norm(clipped[0].double())) <= 1.0


def test_an_update_within_the_norm_and_integer_arrays():
    update = [np.array([0.3, 0.4], dtype=np.float32), np.array([7, 9], dtype=np.int64)]
    clipped, norm = clip_on_device(update, 1.0, CPU)
    assert norm == pytest.approx(0.5)
    np.testing.assert_array_equal(clipped[0].numpy(), update[0])
    np.testing.assert_array_equal(clipped[1].numpy(), [0.0, 0.0])  # not released


def test_a_non_finite_update_is_refused():
    with pytest.raises(NonFiniteUpdateError):
        clip_on_device([np.array([np.nan, 1.0], dtype=np.float32)], 1.0, CPU)


def _deltas(seed: int, m: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [
            (rng.normal(size=(64, 64)) * rng.uniform(0.001, 0.05)).astype(np.float32),
            (rng.normal(size=10) * 0.1).astype(np.float32),
            np.zeros(3, dtype=np.int64),
        ]
        for _ in range(m)
    ]


def test_the_torch_sum_equals_the_numpy_sum_within_float32_tolerance():
    mech = GaussianMechanism(clip_norm=0.5, noise_multiplier=0.8)
    deltas = _deltas(0, 10)  # norms from ~0.06 to ~3: some clipped, some not
    template = [np.zeros_like(a) for a in deltas[0]]
    numpy_site, torch_site = ServerNoise(), ServerNoise()
    torch_site.device = "cpu"
    expected = numpy_site.noisy_sum(deltas, 0, mech, 10, make_generator(5), template)
    got = torch_site.noisy_sum(deltas, 0, mech, 10, make_generator(5), template)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=2e-6)
    # The same draws: the noise (std z·C = 0.4 a coordinate) dominates the difference,
    # so equality within 2e-6 means the torch path added the NumPy path's noise.
    assert float(np.abs(expected[0]).max()) > 0.5


def test_without_updates_the_sum_is_the_noise_alone():
    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=2.0)
    template = [np.zeros((2, 2), dtype=np.float32)]
    got = noisy_sum_on_device([], mech, make_generator(3), template, "cpu")
    noise = make_generator(3).normal(0.0, 2.0, size=(2, 2))
    np.testing.assert_allclose(got[0], noise.astype(np.float32), rtol=0, atol=0)
