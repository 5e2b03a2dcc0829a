"""Mechanisms: noise distributions, clipping bounds in floating point, generators."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

from privacy.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    NonFiniteUpdateError,
    add_noise,
    clip_by_l1_norm,
    clip_by_l2_norm,
    clip_metrics,
    gaussian_noise_like,
    global_l1_norm,
    global_l2_norm,
    laplace_noise_like,
    make_generator,
    noise_generator,
    secret_seed,
    secure_generator,
)

SHAPES = [(40, 50), (30,), (2, 3, 5)]


def _zeros(dtype=np.float64):
    return [np.zeros(s, dtype=dtype) for s in SHAPES]


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.ravel(a) for a in arrays])


def _norms64(arrays) -> tuple[float, float]:
    """Reference norms by plain numpy on float64 (independent of the module)."""
    flat = _flat(arrays).astype(np.float64)
    return float(np.linalg.norm(flat)), float(np.sum(np.abs(flat)))


# -- noise ------------------------------------------------------------------------
def test_noise_on_sum_has_std_zC():
    mech = GaussianMechanism(clip_norm=0.7, noise_multiplier=1.3)
    rng = make_generator(1, 2)
    draws = _flat([_flat(mech.noise_sum(_zeros(), rng=rng)) for _ in range(50)])
    assert mech.sum_noise_std == pytest.approx(0.91)
    assert np.std(draws) == pytest.approx(0.91, rel=0.03)
    assert abs(np.mean(draws)) < 4 * 0.91 / math.sqrt(draws.size)


def test_client_side_noise_sums_to_the_server_side_distribution():
    mech, m, rounds = GaussianMechanism(clip_norm=2.0, noise_multiplier=0.8), 8, 10
    server_rng, client_rng = make_generator(7, 0), make_generator(7, 1)
    server = _flat([_flat(mech.noise_sum(_zeros(), rng=server_rng)) for _ in range(rounds)])
    client = []
    for _ in range(rounds):
        shares = [mech.noise_client(_zeros(), num_clients=m, rng=client_rng) for _ in range(m)]
        client.append(_flat([sum(parts) for parts in zip(*shares, strict=True)]))
    client = _flat(client)
    assert mech.client_noise_std(m) == pytest.approx(1.6 / math.sqrt(8))
    assert np.std(server) == pytest.approx(1.6, rel=0.03)
    assert np.std(client) == pytest.approx(1.6, rel=0.03)
    assert stats.ks_2samp(server, client).pvalue > 0.01


def test_laplace_noise_mean_absolute_deviation_and_variance():
    mech = LaplaceMechanism(sensitivity=3.0, epsilon=2.0)
    rng = make_generator(3)
    draws = _flat([_flat(mech.noise(_zeros(), rng=rng)) for _ in range(100)])
    assert mech.scale == 1.5
    assert np.mean(np.abs(draws)) == pytest.approx(1.5, rel=0.03)
    assert np.var(draws) == pytest.approx(2 * 1.5**2, rel=0.03)


def test_noise_keeps_dtype_and_rejects_bad_parameters():
    rng = make_generator(0)
    noisy = add_noise(_zeros(np.float32), gaussian_noise_like(_zeros(), std=1.0, rng=rng))
    assert all(a.dtype == np.float32 for a in noisy)
    with pytest.raises(ValueError, match="std"):
        gaussian_noise_like(_zeros(), std=-1.0, rng=rng)
    with pytest.raises(ValueError, match="scale"):
        laplace_noise_like(_zeros(), scale=math.nan, rng=rng)
    with pytest.raises(ValueError, match="shape"):
        add_noise([np.zeros(3)], [np.zeros(4)])
    with pytest.raises(NonFiniteUpdateError):
        add_noise([np.array([np.nan])], [np.zeros(1)])


def test_mechanism_events_and_validation():
    assert GaussianMechanism(clip_norm=1.0, noise_multiplier=1.1).dp_event() == (
        dp_accounting.GaussianDpEvent(1.1)
    )
    # dp-accounting's Laplace parameter is scale / sensitivity = 1/epsilon.
    assert LaplaceMechanism(sensitivity=2.0, epsilon=4.0).dp_event() == (
        dp_accounting.LaplaceDpEvent(0.25)
    )
    for bad in (
        {"clip_norm": 0.0, "noise_multiplier": 1.0},
        {"clip_norm": 1.0, "noise_multiplier": math.inf},
    ):
        with pytest.raises(ValueError):
            GaussianMechanism(**bad)
    with pytest.raises(ValueError):
        LaplaceMechanism(sensitivity=-1.0, epsilon=1.0)
    with pytest.raises(ValueError, match="num_clients"):
        GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0).client_noise_std(0)


# -- clipping ---------------------------------------------------------------------
def _assert_within(result, arrays, clip_norm, norm="l2"):
    l2, l1 = _norms64(result.arrays)
    ours = global_l2_norm(result.arrays) if norm == "l2" else global_l1_norm(result.arrays)
    assert ours <= clip_norm
    assert (l2 if norm == "l2" else l1) <= clip_norm
    assert [a.dtype for a in result.arrays] == [np.asarray(a).dtype for a in arrays]
    assert [a.shape for a in result.arrays] == [np.shape(a) for a in arrays]


def _cases():
    rng = np.random.default_rng(0)
    return {
        "random": [rng.normal(size=s) for s in SHAPES],
        "tiny": [rng.normal(size=s) * 1e-300 for s in SHAPES],
        "huge": [rng.normal(size=s) * 1e30 for s in SHAPES],
        "beyond-squaring": [rng.normal(size=s) * 1e200 for s in SHAPES],
        "mixed-dtypes": [
            rng.normal(size=(20, 20)).astype(np.float32),
            rng.normal(size=7).astype(np.float16),
            rng.normal(size=3) * 1e3,
        ],
        "huge-float32": [(rng.normal(size=s) * 1e30).astype(np.float32) for s in SHAPES],
        "many-arrays": [rng.normal(size=rng.integers(1, 20)) for _ in range(300)],
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("clip_norm", [1e-3, 1.0, 7.5])
def test_clipped_update_never_exceeds_the_bound(case, norm, clip_norm):
    arrays = _cases()[case]
    clip = clip_by_l2_norm if norm == "l2" else clip_by_l1_norm
    result = clip(arrays, clip_norm=clip_norm)
    _assert_within(result, arrays, clip_norm, norm)
    if result.clipped:
        achieved = global_l2_norm(result.arrays) if norm == "l2" else global_l1_norm(result.arrays)
        assert achieved == pytest.approx(clip_norm, rel=1e-2)  # float16 rounding allowed


def test_adversarial_float32_inputs_where_naive_scaling_overshoots():
    rng, overshoots = np.random.default_rng(0), 0
    for _ in range(300):
        update = [
            (rng.normal(size=rng.integers(1, 50)) * rng.uniform(0.5, 100)).astype(np.float32)
        ]
        clip_norm = float(rng.uniform(0.1, 2.0))
        norm = np.linalg.norm(update[0].astype(np.float64))
        naive = (update[0].astype(np.float64) * (clip_norm / norm)).astype(np.float32)
        overshoots += np.linalg.norm(naive.astype(np.float64)) > clip_norm
        result = clip_by_l2_norm(update, clip_norm=clip_norm)
        _assert_within(result, update, clip_norm)
        if result.clipped:
            assert global_l2_norm(result.arrays) == pytest.approx(clip_norm, rel=1e-6)
    assert overshoots > 50  # the naive min(1, C/norm) scaling does break the bound


_finite64 = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)
_finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
_arrays = st.one_of(
    hnp.arrays(np.float64, hnp.array_shapes(max_dims=2, max_side=6), elements=_finite64),
    hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=6), elements=_finite32),
)


@given(
    arrays=st.lists(_arrays, min_size=1, max_size=4),
    clip_norm=st.floats(min_value=1e-6, max_value=1e6),
    norm=st.sampled_from(["l2", "l1"]),
)
def test_property_clipping_bound_on_arbitrary_finite_arrays(arrays, clip_norm, norm):
    clip = clip_by_l2_norm if norm == "l2" else clip_by_l1_norm
    result = clip(arrays, clip_norm=clip_norm)
    ours = global_l2_norm(result.arrays) if norm == "l2" else global_l1_norm(result.arrays)
    assert ours <= clip_norm
    assert result.clipped == (result.norm > clip_norm)
    if result.clipped:  # scaled by us: also within the bound for plain numpy
        assert _norms64(result.arrays)[0 if norm == "l2" else 1] <= clip_norm
    else:
        assert all(np.array_equal(a, b) for a, b in zip(result.arrays, arrays, strict=True))


@given(arrays=st.lists(_arrays, min_size=1, max_size=4))
def test_global_norms_are_the_array_by_array_sums(arrays):
    """Each array's scaled sum taken on its own, then summed exactly: the value the
    norms are defined by, bit for bit, however the update is held in memory."""
    arrays64 = [np.asarray(a, dtype=np.float64) for a in arrays]
    peak = max(float(np.max(np.abs(a))) if a.size else 0.0 for a in arrays64)
    if peak == 0.0:
        assert global_l2_norm(arrays) == global_l1_norm(arrays) == 0.0
        return
    l2 = peak * math.sqrt(math.fsum(float(np.sum(np.square(a / peak))) for a in arrays64))
    l1 = peak * math.fsum(float(np.sum(np.abs(a / peak))) for a in arrays64)
    assert global_l2_norm(arrays) == l2
    assert global_l1_norm(arrays) == l1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fn", [clip_by_l2_norm, clip_by_l1_norm])
def test_non_finite_values_raise(bad, fn):
    update = [np.ones(3), np.array([1.0, bad], dtype=np.float32)]
    with pytest.raises(NonFiniteUpdateError, match=r"array 1 .*non-finite"):
        fn(update, clip_norm=1.0)
    with pytest.raises(NonFiniteUpdateError):
        global_l2_norm(update)


def test_overflowing_norms_raise():
    with pytest.raises(NonFiniteUpdateError, match="L2 norm overflows"):
        clip_by_l2_norm([np.full(10, 1e308)], clip_norm=1.0)
    with pytest.raises(NonFiniteUpdateError, match="L1 norm overflows"):
        clip_by_l1_norm([np.full(3, 1e308)], clip_norm=1.0)


def test_update_within_the_bound_is_returned_unchanged():
    update = [np.array([3.0, 0.0], dtype=np.float32), np.array([[4.0]])]
    result = clip_by_l2_norm(update, clip_norm=5.0)  # norm exactly 5
    assert (result.norm, result.scale, result.clipped) == (5.0, 1.0, False)
    assert all(
        np.array_equal(a, b) and a.dtype == b.dtype and a is not b
        for a, b in zip(result.arrays, update, strict=True)
    )
    assert clip_by_l1_norm(update, clip_norm=7.0).scale == 1.0


def test_clipping_by_hand_and_metrics():
    result = clip_by_l2_norm([np.array([3.0, 4.0])], clip_norm=1.0)
    np.testing.assert_allclose(result.arrays[0], [0.6, 0.8], rtol=1e-11)
    assert result.norm == 5.0 and result.clipped and result.scale == pytest.approx(0.2)
    l1 = clip_by_l1_norm([np.array([3.0, -1.0])], clip_norm=2.0)
    np.testing.assert_allclose(l1.arrays[0], [1.5, -0.5], rtol=1e-11)
    assert clip_metrics([result, l1, clip_by_l2_norm([np.zeros(2)], clip_norm=1.0)]) == {
        "clip-fraction": pytest.approx(2 / 3),
        "mean-update-norm": pytest.approx(3.0),
    }
    assert clip_by_l2_norm([], clip_norm=1.0).arrays == []


# -- generators -------------------------------------------------------------------
def test_generators_are_explicit_and_reproducible():
    first = make_generator(42, 1, 2).normal(size=5)
    np.testing.assert_array_equal(first, make_generator(42, 1, 2).normal(size=5))
    assert not np.allclose(first, make_generator(42, 1, 3).normal(size=5))
    expected = np.random.Generator(np.random.PCG64(np.random.SeedSequence([42, 1, 2])))
    np.testing.assert_array_equal(first, expected.normal(size=5))
    np.testing.assert_array_equal(
        noise_generator(seed=42, streams=(1, 2), reproducible=True).normal(size=5), first
    )
    assert not np.allclose(secure_generator().normal(size=5), secure_generator().normal(size=5))
    # The default: secret, whatever the seed.
    draws = [noise_generator(seed=42, streams=(1, 2)).normal(size=5) for _ in range(2)]
    assert not np.allclose(draws[0], first) and not np.allclose(draws[0], draws[1])
    assert secret_seed() != secret_seed() and 0 <= secret_seed() < 2**63
    with pytest.raises(ValueError, match="non-negative integers"):
        make_generator(-1)
