"""The audit's statistics (privacy/audit.py) against independent computations and by
seeded simulation: the Gaussian-pair epsilon against dp-accounting and numerical
integration, the estimator's stated error, the one-run lower bound's validity (below
the true epsilon in >= 95 % of trials) and power, and the canaries' construction."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from scipy import integrate, stats

from privacy import audit


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 4.0])
def test_equal_variance_pair_is_the_gaussian_mechanism_of_dp_accounting(sigma):
    """N(0, s²) vs N(1, s²) is the Gaussian mechanism of sensitivity 1, noise s: its
    epsilon at delta equals dp-accounting's PLD (an independent computation)."""
    pld = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        sigma, value_discretization_interval=1e-4
    )
    expected = pld.get_epsilon_for_delta(1e-5)
    got = audit.gaussian_pair_epsilon((0.0, sigma), (1.0, sigma), 1e-5)
    assert got == pytest.approx(expected, abs=1e-3)


def test_unequal_variances_match_numerical_integration():
    """delta(eps) = integral of (p - e^eps q)_+ by quadrature, for both orders."""
    p, q, eps = (0.0, 1.0), (0.7, 1.6), 1.3

    def hockey(a, b):
        pa, pb = stats.norm(*a), stats.norm(*b)
        f = lambda x: max(0.0, pa.pdf(x) - math.exp(eps) * pb.pdf(x))  # noqa: E731
        return integrate.quad(f, -40, 40, points=[-5, 0, 5], limit=500)[0]

    assert audit._hockey_stick(p, q, eps) == pytest.approx(hockey(p, q), abs=1e-7)
    assert audit._hockey_stick(q, p, eps) == pytest.approx(hockey(q, p), abs=1e-7)
    # The pair's epsilon is the smallest with delta(eps) <= delta in both orders.
    epsilon = audit.gaussian_pair_epsilon(p, q, 1e-3)
    worst = max(audit._hockey_stick(p, q, epsilon), audit._hockey_stick(q, p, epsilon))
    assert worst == pytest.approx(1e-3, rel=1e-3)
    assert audit.gaussian_pair_epsilon((0.0, 1.0), (0.0, 1.0), 1e-5) == 0.0


def test_one_run_p_value_is_the_binomial_tail_at_delta_zero():
    # 10 right of 10 guesses: P = q^10, q = e^eps / (1 + e^eps), computed by hand.
    q = math.exp(1.0) / (1 + math.exp(1.0))
    assert audit.one_run_p_value(100, 10, 10, 1.0, 0.0) == pytest.approx(q**10, rel=1e-12)
    assert audit.one_run_p_value(100, 10, 0, 1.0, 0.0) == 1.0
    # delta adds a non-negative term, growing with m
    base = audit.one_run_p_value(100, 10, 9, 1.0, 0.0)
    assert (
        base
        < audit.one_run_p_value(100, 10, 9, 1.0, 1e-3)
        < audit.one_run_p_value(1000, 10, 9, 1.0, 1e-3)
    )


def _gdp_trial(rng, m: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """m canaries of a mu-GDP mechanism: inserted with probability 1/2, score N(mu, 1)
    if inserted, N(0, 1) if not."""
    inserted = rng.random(m) < 0.5
    return rng.normal(0.0, 1.0, m) + mu * inserted, inserted


def _gdp_epsilon(mu: float, delta: float) -> float:
    return audit.gaussian_pair_epsilon((0.0, 1.0), (mu, 1.0), delta)


def test_lower_bound_is_below_the_true_epsilon_in_at_least_95_percent_of_trials():
    """200 seeded trials of a mechanism whose (epsilon, delta) is known exactly (mu-GDP
    with mu = 2: epsilon 6.4 at delta 1e-5); the audit at 0.95 must not exceed it in
    more than 5 % of them. The scores separate well, so the bound is not trivially 0."""
    rng = np.random.default_rng(20231)
    delta, true_eps = 1e-5, _gdp_epsilon(2.0, 1e-5)
    bounds = []
    for _ in range(200):
        scores, inserted = _gdp_trial(rng, 1000, 2.0)
        bounds.append(audit.one_run_lower_bound(scores, inserted, delta, 0.95).epsilon)
    bounds = np.asarray(bounds)
    assert np.mean(bounds <= true_eps) >= 0.95
    assert np.median(bounds) > 1.0  # power: the audit sees this mechanism


def test_lower_bound_reaches_its_ceiling_on_separable_scores_and_zero_on_noise():
    rng = np.random.default_rng(5)
    m = 200
    inserted = rng.random(m) < 0.5
    separable = np.where(inserted, 1.0, 0.0) + rng.normal(0, 1e-3, m)
    top = audit.one_run_lower_bound(separable, inserted, 1e-5, 0.95)
    assert top.correct == top.guesses and top.epsilon > 2.0
    assert top.epsilon <= audit.EPSILON_CAP
    noise = audit.one_run_lower_bound(rng.normal(size=m), inserted, 1e-5, 0.95)
    assert noise.epsilon < 0.5
    # the ceiling for m canaries: every inserted one first, half inserted
    assert audit.largest_lower_bound(200, 1e-5, 0.95) == pytest.approx(2.477, abs=0.01)


def test_the_estimate_recovers_epsilon_within_its_stated_error():
    """On synthetic cosines of a known Gaussian mechanism (mu-GDP in units of the
    cosines' std 1/sqrt(d)), the estimate's 95 % interval holds the true epsilon in
    about 95 % of 200 trials (at least 90 %), and its median is within 10 %."""
    rng = np.random.default_rng(7)
    mu, delta, d = 1.0, 1e-5, 10_000
    true_eps = _gdp_epsilon(mu, delta)
    hits, estimates = 0, []
    for _ in range(200):
        held_out = rng.normal(0.0, 1 / math.sqrt(d), 250)
        inserted = rng.normal(mu / math.sqrt(d), 1 / math.sqrt(d), 250)
        estimates.append(audit.estimate_epsilon(inserted, held_out, delta))
        low, high = audit.estimate_interval(inserted, held_out, delta)
        hits += low <= true_eps <= high
    assert hits / 200 >= 0.90
    assert np.median(estimates) == pytest.approx(true_eps, rel=0.1)
    assert audit.estimate_epsilon(np.ones(1), np.zeros(5), delta) is None


def test_canary_directions_are_seeded_unit_vectors_independent_of_data():
    a = audit.canary_direction(3, 0, 5000)
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_array_equal(a, audit.canary_direction(3, 0, 5000))  # seed and j only
    others = [audit.canary_direction(3, j, 5000) for j in range(1, 20)]
    # distinct canaries are nearly orthogonal: |cos| ~ 1/sqrt(d) = 0.014
    assert max(abs(a @ b) for b in others) < 6 / math.sqrt(5000)
    assert not np.array_equal(a, audit.canary_direction(4, 0, 5000))


def test_inclusion_and_per_round_rate_are_binomial():
    """Each canary inserted with probability 1/2, and an inserted canary uploads with
    the canary rate: counts within the binomial's 99.99 % interval."""
    k = 4000
    inserted = audit.inclusion(11, k).sum()
    low, high = stats.binom.interval(0.9999, k, 0.5)
    assert low <= inserted <= high
    rate, trials = 0.3, 4000
    uploads = sum(audit.inserts_in_round(11, j % 50, j // 50 + 1, rate) for j in range(trials))
    low, high = stats.binom.interval(0.9999, trials, rate)
    assert low <= uploads <= high
    assert all(audit.inserts_in_round(11, 0, r, 1.0) for r in range(1, 20))


def test_canary_norm_overshoots_the_clip_bound():
    direction = audit.canary_direction(0, 0, 1000)
    assert audit.canary_norm(direction, l2_bound=0.5, l1_bound=None) == 1.0
    scale = audit.canary_norm(direction, l2_bound=None, l1_bound=3.0)
    assert np.abs(scale * direction).sum() == pytest.approx(6.0)


def test_flatten_and_unflatten_skip_integer_buffers():
    arrays = [np.ones((2, 3), np.float32), np.array(7, np.int64), np.zeros(4, np.float64)]
    flat = audit.flatten(arrays)
    assert flat.shape == (10,) and flat.dtype == np.float64
    back = audit.unflatten(flat + 1, arrays)
    assert back[0].dtype == np.float32 and (back[0] == 2).all()
    assert back[1] == 7 and (back[2] == 1).all()


def test_audit_of_a_delta_built_from_the_inserted_canaries():
    """A final delta that is the sum of the inserted canaries' directions (no noise):
    every inserted canary scores about 1/sqrt(#inserted), the rest about 0, so the
    bound is at its ceiling and the estimate at its cap."""
    seed, k, dim = 9, 64, 20_000
    truth = audit.inclusion(seed, k)
    delta = sum(audit.canary_direction(seed, j, dim) for j in np.flatnonzero(truth))
    result = audit.audit(delta, seed=seed, canaries=k, delta=1e-5, confidence=0.95,
                         accountant_epsilon=1.0)  # fmt: skip
    assert result.inserted == truth.sum() and result.dimension == dim
    assert min(result.cosines_inserted) > 5 * max(np.abs(result.cosines_held_out))
    assert result.epsilon_lower_bound == pytest.approx(result.epsilon_lower_bound_max)
    assert result.exceeds  # a bound above the accountant's 1.0 is a failed audit
    doc = result.to_json()
    assert doc["exceeds_accountant"] and doc["canaries"] == k
