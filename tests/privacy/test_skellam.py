"""The distributed Skellam mechanism: noise, rounding, modular encoding, its RDP bound
against an exact Rényi divergence, and its accounting in the ledger."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant, compute_epsilon
from scipy import special, stats

from privacy.accounting import AccountingError, PrivacyLedger, Release, to_dp_event
from privacy.events import RDP_ORDERS
from privacy.skellam import (
    SecureSumEncoding,
    calibrate_variance,
    conditional_round,
    l1_bound,
    rounded_l2_bound,
    skellam_epsilon,
    skellam_noise,
    skellam_rdp,
)
from privacy.skellam_accounting import SkellamDpEvent

N_SAMPLES = 200_000


def _assert_skellam_moments(sample: np.ndarray, mu: float) -> None:
    # Skellam(μ): variance μ, fourth central moment 3μ² + μ, so Var(s²) ≈ (2μ² + μ)/n.
    n = sample.size
    assert abs(sample.mean()) < 5 * math.sqrt(mu / n)
    assert abs(sample.var() - mu) < 5 * math.sqrt((2 * mu * mu + mu) / n)


def _skellam_gof_pvalue(sample: np.ndarray, mu: float) -> float:
    """Chi-square goodness of fit against scipy's Skellam(μ/2, μ/2), tails pooled."""
    dist = stats.skellam(mu / 2, mu / 2)
    lo, hi = int(dist.ppf(1e-3)), int(dist.isf(1e-3))
    edges = np.arange(lo, hi + 1)
    expected = np.concatenate([[dist.cdf(lo - 1)], dist.pmf(edges), [dist.sf(hi)]]) * sample.size
    observed = np.concatenate(
        [
            [np.sum(sample < lo)],
            np.bincount(sample[(sample >= lo) & (sample <= hi)] - lo, minlength=edges.size),
            [np.sum(sample > hi)],
        ]
    )
    keep = expected >= 5  # every bin here has expected >= 5 except possibly none
    assert keep.all()
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    return float(stats.chi2.sf(chi2, expected.size - 1))


# -- noise ----------------------------------------------------------------------------
@pytest.mark.parametrize("mu", [0.5, 10.0, 1e4])
def test_noise_is_skellam(mu):
    # Prepare
    rng = np.random.default_rng(11)
    # Execute
    sample = skellam_noise(N_SAMPLES, mu, rng)
    # Assert
    assert sample.dtype == np.int64
    _assert_skellam_moments(sample, mu)
    assert _skellam_gof_pvalue(sample, mu) > 1e-3


def test_noise_zero_variance_is_zero():
    assert not skellam_noise((3, 4), 0.0, np.random.default_rng(0)).any()


def test_sum_of_shares_is_skellam_with_summed_variance():
    # Prepare
    rng, mu, n = np.random.default_rng(12), 30.0, 7
    # Execute
    total = sum(skellam_noise(N_SAMPLES, mu / n, rng) for _ in range(n))
    # Assert
    _assert_skellam_moments(total, mu)
    assert _skellam_gof_pvalue(total, mu) > 1e-3


# -- rounding ------------------------------------------------------------------------
def test_bounds_by_hand():
    # β = e^-½: √(2 ln(1/β)) = 1. c = 3, d = 16: √(9 + 4 + (3 + 2)) = √18 < 3 + 4.
    assert rounded_l2_bound(3.0, 16) == pytest.approx(math.sqrt(18.0))
    # c = 0.1, d = 1: √(0.01 + 0.25 + 0.6) = 0.927 < c + √d = 1.1.
    assert rounded_l2_bound(0.1, 1) == pytest.approx(math.sqrt(0.86))
    assert l1_bound(3.0, 100) == 9.0  # Δ2² < √d Δ2 = 30
    assert l1_bound(30.0, 4) == 60.0  # √d Δ2 = 60 < 900


def test_conditional_round_is_unbiased_integer_when_not_rejected():
    # Prepare: a bound of ‖x‖ + √d is never exceeded (each coordinate moves < 1).
    x = np.array([0.3, -1.7, 2.5, 0.0, 4.9])
    bound = float(np.linalg.norm(x)) + math.sqrt(x.size)
    rng, draws = np.random.default_rng(13), 20_000
    # Execute
    out = np.stack([conditional_round(x, bound, rng) for _ in range(draws)])
    # Assert
    assert out.dtype == np.int64
    assert np.all((out == np.floor(x)) | (out == np.ceil(x)))
    frac = x - np.floor(x)
    standard_error = np.sqrt(frac * (1 - frac) / draws)
    assert np.all(np.abs(out.mean(axis=0) - x) <= 5 * standard_error + 1e-12)


def test_conditional_round_never_exceeds_the_bound():
    # Prepare: x on the sphere of radius c; the bound of the paper.
    rng = np.random.default_rng(14)
    c, d = 20.0, 100
    bound = rounded_l2_bound(c, d)
    for _ in range(300):
        x = rng.normal(size=d)
        x *= c / np.linalg.norm(x)
        # Execute
        out = conditional_round(x, bound, rng)
        # Assert
        assert np.linalg.norm(out) <= bound


def test_conditional_round_fallback_meets_the_bound():
    # Prepare: x = (0.9,)*4, bound ‖x‖ = 1.8: a rounding is accepted iff at most 3
    # coordinates round up (prob 1 − 0.9⁴ = 0.3439), so one try falls back to rounding
    # toward zero (all zeros) with prob 0.6561.
    x, bound, rng = np.full(4, 0.9), 1.8, np.random.default_rng(15)
    # Execute
    out = np.stack([conditional_round(x, bound, rng, max_tries=1) for _ in range(4000)])
    # Assert
    assert np.all(np.linalg.norm(out, axis=1) <= bound)
    zeros = np.mean(~out.any(axis=1))  # fallback, or (prob 0.1⁴) a rounding to zero
    assert abs(zeros - (0.6561 + 1e-4)) < 5 * math.sqrt(0.66 * 0.34 / 4000)


def test_conditional_round_refuses_a_vector_beyond_the_bound():
    with pytest.raises(ValueError, match="exceeds"):
        conditional_round(np.array([3.0, 4.0]), 4.9, np.random.default_rng(0), max_tries=5)


# -- encoding ------------------------------------------------------------------------
def _modular_sum(messages) -> np.ndarray:
    total = np.zeros_like(messages[0])
    for message in messages:
        total += message  # uint64: wraps mod 2**64, a multiple of M
    return total


def _l2_clipped(update: np.ndarray, clip: float) -> np.ndarray:
    return update * min(1.0, clip / np.linalg.norm(update))


@pytest.mark.parametrize("modulus", [2**32, 2**64])
def test_encode_decode_l2_clipped_sum_within_max_error(modulus):
    # Prepare: updates of both signs, some above the clip norm.
    rng = np.random.default_rng(16)
    encoding = SecureSumEncoding(clip_norm=1.0, scale=2.0**10, modulus=modulus)
    updates = [rng.normal(scale=s, size=50) for s in (0.05, 0.2, 1.0, 3.0, 0.1)]
    # Execute
    messages = [encoding.encode(u, rng) for u in updates]
    decoded = encoding.decode(_modular_sum(messages))
    # Assert
    assert all(m.dtype == np.uint64 and int(m.max()) < modulus for m in messages)
    assert encoding.fits(5, 50)
    expected = sum(_l2_clipped(u, 1.0) for u in updates)
    assert np.max(np.abs(decoded - expected)) <= encoding.max_error(5, 50)
    assert encoding.max_error(5, 50) == 5 / 2.0**10


@pytest.mark.parametrize("modulus", [2**16, 2**64])
def test_encode_decode_coordinate_clipped_sum_within_max_error(modulus):
    # Prepare: plain SecAgg, coordinates clipped to ±0.5, a negative total.
    rng = np.random.default_rng(17)
    encoding = SecureSumEncoding(clip_norm=0.0, scale=100.0, modulus=modulus, coordinate_range=0.5)
    updates = [rng.uniform(-0.9, 0.3, size=40) for _ in range(6)]
    # Execute
    decoded = encoding.decode(_modular_sum([encoding.encode(u, rng) for u in updates]))
    # Assert: 6 · (0.5·100 + 1) = 306 < 2**15
    assert encoding.fits(6, 40)
    expected = sum(np.clip(u, -0.5, 0.5) for u in updates)
    assert expected.min() < -2.0
    assert np.max(np.abs(decoded - expected)) <= encoding.max_error(6, 40)


def test_noise_in_decoded_sum_has_the_summed_variance():
    # Prepare: integer-valued scaled updates (no rounding error), 4 shares of variance 25.
    rng, n, dim = np.random.default_rng(18), 4, 20_000
    encoding = SecureSumEncoding(
        clip_norm=0.0, scale=10.0, modulus=2**32, client_variance=25.0, coordinate_range=1.0
    )
    updates = [rng.integers(-10, 11, size=dim) / 10.0 for _ in range(n)]
    # Execute
    decoded = encoding.decode(_modular_sum([encoding.encode(u, rng) for u in updates]))
    # Assert: the error in integer units is Sk(100)
    error = np.round((decoded - sum(updates)) * 10.0).astype(np.int64)
    _assert_skellam_moments(error, 100.0)


def test_fits_by_hand():
    # one client's largest coordinate: 1·100 + 1 = 101; M/2 = 128
    encoding = SecureSumEncoding(clip_norm=0.0, scale=100.0, modulus=2**8, coordinate_range=1.0)
    assert encoding.fits(1, 10)
    assert not encoding.fits(2, 10)
    # n clients: n·Δ2 + L/3 + √(L²/9 + 2L·n·10⁶), L = 32 + ln 2, against M/2 = 2¹⁴:
    # n = 4: 9.9 + 10.9 + 16 172 = 16 193 < 16 384; n = 5: 12.3 + 10.9 + 18 081 > 16 384
    noisy = SecureSumEncoding(clip_norm=1.0, scale=1.0, modulus=2**15, client_variance=1e6)
    assert rounded_l2_bound(1.0, 10) == pytest.approx(math.sqrt(1 + 2.5 + 1 + math.sqrt(10) / 2))
    assert noisy.fits(4, 10)
    assert not noisy.fits(5, 10)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"clip_norm": -1.0, "scale": 1.0, "modulus": 2**8}, "clip_norm"),
        ({"clip_norm": 1.0, "scale": 0.0, "modulus": 2**8}, "scale"),
        ({"clip_norm": 1.0, "scale": 1.0, "modulus": 3 * 2**8}, "modulus"),
        ({"clip_norm": 1.0, "scale": 1.0, "modulus": 2**65}, "modulus"),
        (
            {"clip_norm": 1.0, "scale": 1.0, "modulus": 2**8, "client_variance": -1},
            "client_variance",
        ),
        ({"clip_norm": 0.0, "scale": 1.0, "modulus": 2**8}, "coordinate_range"),
        (
            {"clip_norm": 1.0, "scale": 1.0, "modulus": 2**8, "coordinate_range": 1.0},
            "coordinate_range",
        ),
    ],
)
def test_encoding_validates_its_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SecureSumEncoding(**kwargs)


# -- RDP bound against an exact Rényi divergence --------------------------------------
def _exact_renyi_shift(shift: int, mu: float, alpha: int) -> float:
    """D_α(Sk(μ) + shift ‖ Sk(μ)) from scipy's Skellam pmf, on the support where it is
    representable; the terms at its edges must be negligible."""
    limit = int(60 + 40 * math.sqrt(mu) + 3 * alpha * abs(shift))
    k = np.arange(-limit, limit + 1)
    log_q = stats.skellam.logpmf(k, mu / 2, mu / 2)
    log_p = stats.skellam.logpmf(k - shift, mu / 2, mu / 2)
    ok = np.isfinite(log_p) & np.isfinite(log_q)
    terms = alpha * log_p[ok] + (1 - alpha) * log_q[ok]
    total = special.logsumexp(terms)
    assert total - max(terms[0], terms[-1]) > 40  # the truncated tails do not matter
    return float(total / (alpha - 1))


ALPHAS = (2, 3, 5, 10, 32)


@pytest.mark.parametrize("mu", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("shift", [1, 2, 5])
def test_rdp_bound_dominates_exact_divergence_1d(mu, shift):
    bound = skellam_rdp(ALPHAS, shift, shift, mu)
    exact = [_exact_renyi_shift(shift, mu, a) for a in ALPHAS]
    assert np.all(bound >= exact)


@pytest.mark.parametrize("mu", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("vector", [(1, 1), (2, -1), (1, 2, -2), (3, 0, 1)])
def test_rdp_bound_dominates_exact_divergence_vectors(mu, vector):
    # Independent coordinates: the divergence is the sum over coordinates.
    v = np.array(vector)
    bound = skellam_rdp(ALPHAS, float(np.linalg.norm(v)), float(np.abs(v).sum()), mu)
    exact = [sum(_exact_renyi_shift(int(s), mu, a) for s in v if s) for a in ALPHAS]
    assert np.all(bound >= exact)


@pytest.mark.parametrize("mu, shift", [(100.0, 1), (100.0, 2), (1000.0, 1), (1000.0, 2)])
def test_rdp_bound_is_tight_for_large_variance(mu, shift):
    bound = skellam_rdp(ALPHAS, shift, shift, mu)
    exact = np.array([_exact_renyi_shift(shift, mu, a) for a in ALPHAS])
    assert np.all(bound <= 1.1 * exact)


def test_rdp_at_non_integer_order_is_the_next_integer_and_inf_at_one():
    curve = skellam_rdp([1.0, 1.5, 2.0, 2.01, 3.0], 10.0, 30.0, 400.0)
    assert curve[0] == math.inf
    assert curve[1] == curve[2] and curve[3] == curve[4]
    # α = 2: 2·100/800 + min((3·100 + 180)/(4·160 000), 90/800) = 0.25 + 0.00075
    assert curve[2] == pytest.approx(0.25075)


def test_epsilon_close_to_gaussian_for_large_variance():
    # Prepare: Δ2 = 1000, μ = (5 Δ2)²: Gaussian noise multiplier 5.
    l2, mu, rounds, delta = 1000.0, 25e6, 50, 1e-5
    accountant = RdpAccountant(list(RDP_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(math.sqrt(mu) / l2), rounds)
    # Execute
    epsilon = skellam_epsilon(rounds, l2, l1_bound(l2, 10_000), mu, delta)
    # Assert
    gaussian = accountant.get_epsilon(delta)
    assert gaussian <= epsilon <= 1.02 * gaussian


def _hand_epsilon(rounds, l2, l1, mu, delta) -> float:
    """ε = min over integer α in 2..63 of rounds·rdp(α) + log((α−1)/α) − (log δ + log α)/(α−1)
    (Canonne, Kamath & Steinke 2020; Balle et al. 2020), rdp from Agarwal et al. Cor. 3.6."""
    best = math.inf
    for a in range(2, 64):
        rdp = a * l2**2 / (2 * mu) + min(
            ((2 * a - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu)
        )
        eps = rounds * rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize("mu, rounds", [((1.0 * 1000) ** 2, 30), ((3.0 * 1000) ** 2, 100)])
def test_golden_epsilon(mu, rounds):
    # Prepare: Δ2 = 1000 in d = 10⁴ coordinates, Δ1 = min(Δ2², √d Δ2) = 10⁵
    l2, delta = 1000.0, 1e-5
    l1 = min(l2**2, math.sqrt(1e4) * l2)
    expected = _hand_epsilon(rounds, l2, l1, mu, delta)
    # Execute
    epsilon = skellam_epsilon(rounds, l2, l1, mu, delta)
    # Assert
    assert 0.99 * expected <= epsilon <= expected + 1e-9


def test_golden_epsilon_pinned():
    # α = 2: 30·(2·10⁶/(2·10⁶) + (3·10⁶ + 6·10⁵)/(4·10¹²)) + log ½ − (log 10⁻⁵ + log 2)
    expected = 30 * (1 + 3.6e6 / 4e12) + math.log(0.5) - (math.log(1e-5) + math.log(2))
    assert skellam_epsilon(30, 1000.0, 1e5, 1e6, 1e-5) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(40.12665810, abs=1e-8)


@pytest.mark.parametrize("target", [3.0, 100.0])
def test_calibrate_variance_meets_target_minimally(target):
    # Prepare: the bracket starts at Δ2² (ε ≈ 40): searched upwards, then downwards
    delta, rounds, l2, l1 = 1e-5, 30, 1000.0, 1e5
    # Execute
    mu = calibrate_variance(target, delta, rounds, l2, l1)
    # Assert
    assert skellam_epsilon(rounds, l2, l1, mu, delta) <= target
    assert skellam_epsilon(rounds, l2, l1, 0.99 * mu, delta) > target


# -- ledger ----------------------------------------------------------------------------
def _skellam_release(server_round=1, l2=1000.0, l1=1e5, variance=1e6, count=1):
    return Release(
        server_round=server_round,
        kind="model-update",
        mechanism="skellam",
        l2_sensitivity=l2,
        l1_sensitivity=l1,
        variance=variance,
        sampling="none",
        sample_size=10,
        population=10,
        count=count,
    )


def _skellam_ledger(**kw) -> PrivacyLedger:
    kw = {"sampling": "none", "neighboring": "zero-out", "mechanisms": ("skellam",), **kw}
    return PrivacyLedger(accountant="rdp", target_delta=1e-5, **kw)


def test_ledger_epsilon_equals_skellam_epsilon():
    # Prepare
    ledger = _skellam_ledger()
    # Execute
    for rnd in range(1, 31):
        ledger.charge(_skellam_release(rnd))
    # Assert
    assert ledger.epsilon() == pytest.approx(
        skellam_epsilon(30, 1000.0, 1e5, 1e6, 1e-5), rel=1e-12
    )
    assert not ledger.would_exceed(_skellam_release(31))


def test_ledger_mixes_gaussian_count_and_skellam():
    # Prepare: a Gaussian count (noise multiplier 8) and a Skellam update per round
    ledger = _skellam_ledger(mechanisms=("gaussian", "skellam"))
    count = Release(
        server_round=1,
        kind="adaptive-clip-count",
        mechanism="gaussian",
        noise_multiplier=8.0,
        sampling="none",
        sample_size=10,
        population=10,
        count=20,
    )
    # Execute
    ledger.charge([count, _skellam_release(count=20)])
    # Assert: the two RDP curves added (Gaussian: α/(2z²), Mironov 2017)
    orders = np.array(RDP_ORDERS)
    rdp = 20 * orders / (2 * 8.0**2) + 20 * skellam_rdp(orders, 1000.0, 1e5, 1e6)
    expected = compute_epsilon(orders, rdp, 1e-5)[0]
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-12)


def test_replace_one_doubles_the_sensitivities():
    # Prepare: a fixed-size-sampling ledger (replace-one); the Skellam release unsampled
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="without-replacement")
    # Execute
    ledger.charge(_skellam_release(count=30))
    # Assert
    assert to_dp_event(_skellam_release(), "replace-one") == SkellamDpEvent(2000.0, 2e5, 1e6)
    manual = skellam_epsilon(30, 2000.0, 2e5, 1e6, 1e-5)
    assert ledger.epsilon() == pytest.approx(manual, rel=1e-12)
    assert manual > 3 * skellam_epsilon(30, 1000.0, 1e5, 1e6, 1e-5)


@pytest.mark.parametrize(
    "kw, hint",
    [
        ({"accountant": "pld"}, "dp.accountant = 'rdp'"),
        ({"sampling": "poisson", "neighboring": None}, "no amplification by sampling is claimed"),
        ({"neighboring": "add-or-remove-one"}, "neighboring='zero-out'"),
    ],
)
def test_unsupported_combinations_say_what_to_do(kw, hint):
    kw = {"accountant": "rdp", "sampling": "none", "neighboring": "zero-out", **kw}
    with pytest.raises(AccountingError, match=hint.replace(".", r"\.")):
        PrivacyLedger(target_delta=1e-5, mechanisms=("skellam",), **kw)


def test_state_dict_round_trip_reproduces_epsilon():
    # Prepare
    ledger = _skellam_ledger()
    ledger.charge([_skellam_release(rnd, variance=1e6 + rnd) for rnd in range(1, 6)])
    # Execute
    loaded = PrivacyLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    # Assert
    assert loaded.releases == ledger.releases
    assert loaded.epsilon() == ledger.epsilon()


def test_release_parameters_are_validated():
    with pytest.raises(AccountingError, match="variance"):
        _skellam_release(variance=None)
    with pytest.raises(AccountingError, match="not variance"):
        Release(
            server_round=1,
            kind="x",
            mechanism="gaussian",
            noise_multiplier=1.0,
            variance=2.0,
            sampling="none",
            sample_size=1,
            population=1,
        )
