"""Correlated noise: banded MF and DP-FTRL tree factorizations, sensitivity, accounting."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from scipy.linalg import solve_triangular
from scipy.optimize import check_grad
from scipy.stats import norm

from privacy import correlated as cr
from privacy.events import AccountingError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.CACHE_ENV, str(tmp_path / "cache"))


# -- banded factorization ---------------------------------------------------------------------
def test_one_band_is_exactly_the_identity():
    f = cr.optimize_banded(7, 1)
    assert f.coefs == (1.0,)
    np.testing.assert_array_equal(f.strategy(), np.eye(7))
    np.testing.assert_array_equal(f.decoder(), cr.prefix_sum_workload(7))
    assert f.loss == 28.0  # ||A||_F^2 = 7*8/2


def test_banded_factorizes_the_workload_with_unit_column_norm():
    f = cr.optimize_banded(50, 5)
    c, b = f.strategy(), f.decoder()
    np.testing.assert_allclose(b @ c, cr.prefix_sum_workload(50), atol=1e-10)
    assert np.linalg.norm(c, axis=0).max() == pytest.approx(1.0, abs=1e-12)
    assert np.count_nonzero(np.tril(c, -5)) == 0  # 5 bands: offsets 0..4
    assert np.sum(b * b) == pytest.approx(f.loss, rel=1e-9)


def test_loss_gradient_matches_finite_differences():
    tail = np.random.default_rng(1).normal(0.2, 0.05, 6)
    _, grad = cr._loss_and_grad(tail, 40)
    err = check_grad(
        lambda t: cr._loss_and_grad(t, 40)[0], lambda t: cr._loss_and_grad(t, 40)[1], tail
    )
    assert err < 1e-5 * np.linalg.norm(grad)


def test_more_bands_lower_the_error():
    losses = [cr.optimize_banded(64, b, use_cache=False).loss for b in (1, 2, 4, 8)]
    assert losses == sorted(losses, reverse=True)
    assert losses[3] < 0.25 * losses[0]  # 454 vs 2080
    # optimised beats its own start, the truncated square-root factorization
    start = np.cumprod([1.0] + [(2 * k - 1) / (2 * k) for k in range(1, 8)])
    assert losses[3] < cr._loss_and_grad(start[1:], 64)[0]


# -- the momentum workload -------------------------------------------------------------------
def test_momentum_workload_is_what_heavy_ball_releases():
    # m_t = beta m_(t-1) + x_t, model_t - model_0 = -lr (m_1 + ... + m_t): row t of A
    # applied to x, here built by running the recursion on unit vectors.
    n, beta = 6, 0.5
    columns = []
    for s in range(n):
        x, m, total, rows = np.eye(n)[s], 0.0, 0.0, []
        for t in range(n):
            m = beta * m + x[t]
            total += m
            rows.append(total)
        columns.append(rows)
    np.testing.assert_allclose(cr.momentum_workload(n, beta), np.array(columns).T, atol=1e-15)
    assert cr.momentum_workload(3, 0.5)[2].tolist() == [1.75, 1.5, 1.0]
    np.testing.assert_array_equal(cr.workload_column(5, 0.0), np.ones(5))


def test_banded_factorizes_the_momentum_workload_and_beats_the_prefix_strategy():
    n, beta = 60, 0.9
    f = cr.optimize_banded(n, 8, momentum=beta)
    assert f.workload == "momentum-0.9" and f.momentum == beta
    a, c = cr.momentum_workload(n, beta), f.strategy()
    np.testing.assert_allclose(f.decoder() @ c, a, atol=1e-9)
    assert np.linalg.norm(c, axis=0).max() == pytest.approx(1.0, abs=1e-12)
    direct = np.sum(solve_triangular(c.T, a.T, lower=False) ** 2)  # ||A C^-1||_F^2
    assert f.loss == pytest.approx(direct, rel=1e-9)
    prefix = cr.optimize_banded(n, 8).strategy()  # optimised for the other workload
    assert f.loss < 0.95 * np.sum(solve_triangular(prefix.T, a.T, lower=False) ** 2)
    # cached apart from the prefix-sum strategy of the same n and b
    assert cr.optimize_banded(n, 8, momentum=beta) == f
    assert cr.optimize_banded(n, 8).coefs != f.coefs


def test_momentum_loss_gradient_matches_finite_differences():
    column = cr.workload_column(40, 0.9)
    tail = np.array([-0.3, 0.1, 0.05])
    _, grad = cr._loss_and_grad(tail, 40, column)
    err = check_grad(
        lambda t: cr._loss_and_grad(t, 40, column)[0],
        lambda t: cr._loss_and_grad(t, 40, column)[1],
        tail,
    )
    assert err < 1e-6 * np.linalg.norm(grad)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, True, "0.5"])
def test_momentum_out_of_range_is_refused(momentum):
    with pytest.raises(cr.FactorizationError, match="momentum must be in"):
        cr.optimize_banded(10, 2, momentum=momentum)


def test_factorization_is_cached_as_public_data(tmp_path):
    first = cr.optimize_banded(30, 3, cache=tmp_path)
    path = tmp_path / "banded-prefix-sum-n30-b3.json"
    saved = json.loads(path.read_text())
    assert "data-independent" in saved["public"]
    assert saved["coefs"] == list(first.coefs)
    assert cr.optimize_banded(30, 3, cache=tmp_path) == first
    assert cr.cache_dir().parent.name == "cache"  # the environment variable is honoured
    path.write_text(json.dumps({**saved, "coefs": [1.0]}))  # not this (n, b): recomputed
    assert cr.optimize_banded(30, 3, cache=tmp_path).coefs == pytest.approx(first.coefs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 5, "bands": 6}, "bands must be <= n=5"),
        ({"n": 0, "bands": 1}, "n must be an integer >= 1"),
        ({"n": 5, "bands": 2, "workload": "momentum"}, "workload must be one of"),
    ],
)
def test_bad_factorization_input(kwargs, match):
    with pytest.raises(cr.FactorizationError, match=match):
        cr.optimize_banded(**kwargs)


# -- online banded noise ------------------------------------------------------------------------
def test_banded_stream_is_c_inverse_of_the_draws():
    f = cr.optimize_banded(20, 4)
    stream = cr.BandedNoise(f.coefs, dim=3, std=2.0, generator=np.random.default_rng(5))
    got = np.array([stream.next() for _ in range(20)])
    draws = np.random.default_rng(5).normal(0.0, 2.0, (20, 3))
    np.testing.assert_allclose(got, solve_triangular(f.strategy(), draws, lower=True), atol=1e-12)
    assert len(stream.state_dict()["past"]) == 3  # b - 1 solutions kept


def test_float32_stream_is_c_inverse_of_float32_draws_added_in_place():
    f = cr.optimize_banded(20, 4)
    stream = cr.BandedNoise(
        f.coefs, dim=3, std=2.0, generator=np.random.default_rng(5), dtype=np.float32
    )
    total = np.zeros((20, 3))
    for t in range(20):
        stream.add_to(total[t])  # the mechanism's path: no copy, float64 sum
    draws = 2.0 * np.random.default_rng(5).standard_normal((20, 3), dtype=np.float32)
    expected = solve_triangular(f.strategy(), draws.astype(np.float64), lower=True)
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-5)
    assert stream.next().dtype == np.float32
    with pytest.raises(cr.FactorizationError, match="dtype must be float32 or float64"):
        cr.BandedNoise(f.coefs, dim=3, std=1.0, generator=np.random.default_rng(), dtype=int)


def test_banded_stream_resumes_identically():
    coefs = cr.optimize_banded(30, 5).coefs
    whole = cr.BandedNoise(coefs, dim=4, std=1.0, generator=np.random.default_rng(9))
    expected = [whole.next() for _ in range(30)]
    gen = np.random.default_rng(9)
    first = cr.BandedNoise(coefs, dim=4, std=1.0, generator=gen)
    head = [first.next() for _ in range(13)]
    state, gen_state = first.state_dict(), gen.bit_generator.state
    gen2 = np.random.default_rng()
    gen2.bit_generator.state = gen_state
    resumed = cr.BandedNoise(coefs, dim=4, std=1.0, generator=gen2)
    resumed.load_state_dict(state)
    tail = [resumed.next() for _ in range(17)]
    np.testing.assert_array_equal(np.array(head + tail), np.array(expected))
    assert resumed.round == 30
    other = cr.BandedNoise((1.0, 0.5), dim=4, std=1.0, generator=gen2)
    with pytest.raises(cr.FactorizationError, match="other band coefficients"):
        other.load_state_dict(state)


# -- sensitivity ---------------------------------------------------------------------------------
def _random_banded(rng, n, bands, signed):
    c = np.zeros((n, n))
    for k in range(bands):
        values = rng.normal(size=n - k) if signed else rng.uniform(0.1, 1.0, n - k)
        c += np.diag(values, -k)
    return c


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize(("n", "bands", "sep", "k"), [(12, 3, 3, 4), (12, 2, 4, 3), (11, 4, 5, 2)])
def test_sensitivity_exact_against_enumeration(signed, n, bands, sep, k):
    c = _random_banded(np.random.default_rng(n * sep + k), n, bands, signed)
    result = cr.sensitivity(c, participations=k, min_separation=sep)
    assert result.method == "disjoint-columns"
    brute = cr.brute_force_sensitivity(c, participations=k, min_separation=sep)
    assert result.value == pytest.approx(brute, rel=1e-12)


def test_sensitivity_hand_computed():
    assert cr.sensitivity(np.eye(10), participations=3, min_separation=1).value == pytest.approx(
        math.sqrt(3)
    )
    # optimised banded C, k = ceil(n/b) at separation b: full columns 0, 4, 8 and column 12
    # whose norm is that of the first 4 - (16 - 12) ... n = 14: column 12 keeps 2 coefficients
    f = cr.optimize_banded(14, 4)
    c = np.array(f.coefs)
    got = cr.sensitivity(f.strategy(), participations=4, min_separation=4).value
    assert got == pytest.approx(math.sqrt(3 + c[0] ** 2 + c[1] ** 2), rel=1e-12)


def test_sensitivity_overlapping_columns_enumerated_or_bounded(monkeypatch):
    c = _random_banded(np.random.default_rng(3), 10, 4, signed=False)
    brute = cr.brute_force_sensitivity(c, participations=3, min_separation=2)
    exact = cr.sensitivity(c, participations=3, min_separation=2)
    assert exact.method == "enumeration" and exact.value == brute
    monkeypatch.setattr(cr, "_MAX_ENUMERATED", 0)
    bound = cr.sensitivity(c, participations=3, min_separation=2)
    assert bound.method == "upper-bound" and brute <= bound.value <= brute * 3


# -- DP-FTRL tree --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 5, 8, 12])
def test_tree_decoder_reproduces_prefix_sums(n):
    np.testing.assert_array_equal(
        cr.tree_decoder(n) @ cr.tree_strategy(n), cr.prefix_sum_workload(n)
    )


def test_tree_sensitivity_bound_against_enumeration():
    for n in (4, 8, 11):
        strategy = cr.tree_strategy(n)
        assert cr.tree_sensitivity(n, participations=1) == pytest.approx(
            cr.brute_force_sensitivity(strategy, participations=1, min_separation=1)
        )  # k = 1: sqrt(levels) exactly
        for k in (2, 3):
            for sep in (1, 2, 3):
                brute = cr.brute_force_sensitivity(strategy, participations=k, min_separation=sep)
                assert (
                    brute <= cr.tree_sensitivity(n, participations=k, min_separation=sep) + 1e-12
                )
    # two adjacent leaves under one node: (1, 1, 2) has norm sqrt(6) > sqrt(k * levels) = 2
    assert cr.tree_sensitivity(2, participations=2) == pytest.approx(math.sqrt(6))
    assert cr.brute_force_sensitivity(
        cr.tree_strategy(2), participations=2, min_separation=1
    ) == pytest.approx(math.sqrt(6))


def test_tree_stream_sums_to_the_dyadic_node_noises_and_resumes():
    n = 13
    stream = cr.TreeNoise(dim=2, std=1.5, generator=np.random.default_rng(4))
    increments = np.array([stream.next() for _ in range(n)])
    # node of round t: level of t's lowest set bit, index (t >> level) - 1, drawn at t
    draws = np.random.default_rng(4).normal(0.0, 1.5, (n, 2))
    levels = cr.tree_levels(n)
    offsets = np.cumsum([0] + [math.ceil(n / 2**h) for h in range(levels)])
    nodes = np.zeros((offsets[-1], 2))
    for t in range(1, n + 1):
        low = (t & -t).bit_length() - 1
        nodes[offsets[low] + (t >> low) - 1] = draws[t - 1]
    np.testing.assert_allclose(
        np.cumsum(increments, axis=0), cr.tree_decoder(n) @ nodes, atol=1e-12
    )

    gen = np.random.default_rng(4)
    first = cr.TreeNoise(dim=2, std=1.5, generator=gen)
    head = [first.next() for _ in range(7)]
    state = first.state_dict()
    assert sorted(state["nodes"]) == ["0", "1", "2"]  # 7 = 0b111
    resumed = cr.TreeNoise(dim=2, std=1.5, generator=gen)
    resumed.load_state_dict(state)
    tail = [resumed.next() for _ in range(n - 7)]
    np.testing.assert_array_equal(np.array(head + tail), increments)
    with pytest.raises(cr.FactorizationError, match="do not match its round"):
        resumed.load_state_dict({**state, "round": 8})


# -- accounting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4, 15])
def test_identity_k_participations_is_k_fold_gaussian(k):
    z, delta = 3.0, 1e-5
    sens = cr.sensitivity(np.eye(2 * k), participations=k, min_separation=2).value
    assert sens == pytest.approx(math.sqrt(k))
    composed = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), k)
    rdp = dp_accounting.rdp.RdpAccountant(cr.RDP_ORDERS).compose(composed).get_epsilon(delta)
    assert cr.epsilon(
        noise_multiplier=z, sensitivity=sens, delta=delta, accountant="rdp"
    ) == pytest.approx(rdp, rel=1e-9)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    expected = pld.compose(composed).get_epsilon(delta)
    got = cr.epsilon(noise_multiplier=z, sensitivity=sens, delta=delta)
    assert got == pytest.approx(expected, rel=2e-3)


def test_epsilon_is_an_upper_bound_of_the_analytic_gaussian():
    # Balle & Wang 2018: delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s)
    s, delta = 2.0, 1e-5
    eps = cr.epsilon(noise_multiplier=2 * s, sensitivity=2.0, delta=delta)
    exact = norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s)
    assert 0.95 * delta <= exact <= delta


def test_calibration_meets_the_target_tightly():
    sens = 2.5
    z = cr.calibrate(target_epsilon=2.0, sensitivity=sens, delta=1e-5)
    assert cr.epsilon(noise_multiplier=z, sensitivity=sens, delta=1e-5) <= 2.0
    assert cr.epsilon(noise_multiplier=z * (1 - 1e-4), sensitivity=sens, delta=1e-5) > 2.0
    # scale invariance: z / sens is the one Gaussian's multiplier
    z1 = cr.calibrate(target_epsilon=2.0, sensitivity=1.0, delta=1e-5)
    assert z / sens == pytest.approx(z1, rel=1e-5)
    with pytest.raises(AccountingError, match="target_epsilon must be finite and > 0"):
        cr.calibrate(target_epsilon=0.0, sensitivity=1.0, delta=1e-5)


# -- error of the released prefix sums ---------------------------------------------------------
def test_banded_beats_identity_at_equal_epsilon():
    n, b, delta = 64, 8, 1e-5
    k = n // b
    z_one = cr.calibrate(target_epsilon=2.0, sensitivity=1.0, delta=delta)
    errors = {}
    for bands in (1, b):
        f = cr.optimize_banded(n, bands)
        sens = cr.sensitivity(f.strategy(), participations=k, min_separation=b).value
        assert sens == pytest.approx(math.sqrt(k))
        errors[bands] = cr.prefix_sum_error(f.decoder(), noise_std=z_one * sens)
    assert errors[b] < 0.25 * errors[1]


def test_tree_beats_identity_for_one_participation():
    n = 64
    # ||B_tree||_F^2 = sum of popcount(t), t = 1..64 = 193; sens^2 = levels = 7
    assert np.sum(cr.tree_decoder(n) ** 2) == 193
    tree = cr.prefix_sum_error(cr.tree_decoder(n), noise_std=math.sqrt(7))
    identity = cr.prefix_sum_error(cr.prefix_sum_workload(n), noise_std=1.0)
    assert tree == pytest.approx(193 * 7 / 64) and identity == pytest.approx(2080 / 64)
    assert tree < identity


def test_one_band_stream_is_plain_gaussian_noise():
    stream = cr.BandedNoise((1.0,), dim=5, std=0.7, generator=np.random.default_rng(2))
    got = np.array([stream.next() for _ in range(4)])
    np.testing.assert_array_equal(got, np.random.default_rng(2).normal(0.0, 0.7, (4, 5)))
    assert stream.state_dict()["past"] == []


def test_tree_with_restarts_is_a_chain_of_fresh_trees():
    gen = np.random.default_rng(8)
    stream = cr.TreeNoise(dim=3, std=1.0, generator=gen, restart_every=4)
    got = np.array([stream.next() for _ in range(10)])
    ref_gen = np.random.default_rng(8)
    expected = []
    for length in (4, 4, 2):
        tree = cr.TreeNoise(dim=3, std=1.0, generator=ref_gen)
        expected += [tree.next() for _ in range(length)]
    np.testing.assert_array_equal(got, np.array(expected))
    # resumed at a tree boundary and inside one
    for cut in (4, 6):
        gen = np.random.default_rng(8)
        first = cr.TreeNoise(dim=3, std=1.0, generator=gen, restart_every=4)
        head = [first.next() for _ in range(cut)]
        resumed = cr.TreeNoise(dim=3, std=1.0, generator=gen, restart_every=4)
        resumed.load_state_dict(first.state_dict())
        tail = [resumed.next() for _ in range(10 - cut)]
        np.testing.assert_array_equal(np.array(head + tail), got)
    with pytest.raises(cr.FactorizationError, match="restart_every=4"):
        cr.TreeNoise(dim=3, std=1.0, generator=gen).load_state_dict(first.state_dict())


def test_tree_restart_sensitivity_against_enumeration():
    from scipy.linalg import block_diag

    n, r = 11, 4
    strategy = block_diag(cr.tree_strategy(4), cr.tree_strategy(4), cr.tree_strategy(3))
    for k in (1, 2, 3, 4):
        for sep in (1, 2, 4):
            brute = cr.brute_force_sensitivity(strategy, participations=k, min_separation=sep)
            bound = cr.tree_sensitivity(n, participations=k, min_separation=sep, restart_every=r)
            assert brute <= bound + 1e-12
    # once per tree (separation r): sqrt(k * levels) with levels = 3, exactly
    assert cr.tree_sensitivity(n, participations=3, min_separation=4, restart_every=4) == (
        pytest.approx(math.sqrt(9))
    )
    assert cr.brute_force_sensitivity(strategy, participations=3, min_separation=4) == (
        pytest.approx(3.0)
    )


# -- choosing b for the amplified schema ------------------------------------------------------
def _direct_amplified(row, *, n: int, delta: float):
    """(ε at a sweep row's z, its mean sq. error) recomputed from matrices and
    dp-accounting."""
    b, q, z, _ = row
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), math.ceil(n / b)
    )
    got = (
        dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
        .compose(event)
        .get_epsilon(delta)
    )
    c = cr.optimize_banded(n, b).strategy()
    assert np.linalg.norm(c, axis=0).max() == pytest.approx(1.0, abs=1e-12)
    decoder = solve_triangular(c.T, cr.prefix_sum_workload(n).T, lower=False).T  # A C^-1
    return got, z**2 * np.sum(decoder**2) / n


def test_least_error_separation_is_the_argmin_of_a_direct_computation():
    # n = 6 rounds, m = 2 of N = 12: b = 1 (q = 1/6), 2 (q = 1/3), 6 (q = 1, unamplified)
    n, m, delta = 6, 2, 1e-5
    for eps, sizes, best in ((4.0, {1: 12, 2: 6, 6: 2}, 6), (0.5, {1: 12, 6: 2}, 1)):
        choice = cr.least_error_separation(
            rounds=n, cohort=m, group_sizes=sizes, target_epsilon=eps, delta=delta
        )
        assert [row[0] for row in choice.sweep] == list(sizes)
        assert [row[1] for row in choice.sweep] == pytest.approx([m / g for g in sizes.values()])
        errors = {}
        for row in choice.sweep:
            got, errors[row[0]] = _direct_amplified(row, n=n, delta=delta)
            assert got <= eps * (1 + 1e-9) and got == pytest.approx(eps, rel=2e-3)
            assert row[3] == pytest.approx(errors[row[0]], rel=1e-9)
        assert choice.separation == min(errors, key=errors.get) == best


def test_least_error_separation_skips_invalid_b_and_refuses_when_none_is_left():
    # b = 3's smallest group (1) is below m = 2 and b = 9 exceeds n = 6: only b = 2 left
    choice = cr.least_error_separation(
        rounds=6, cohort=2, group_sizes={2: 4, 3: 1, 9: 2}, target_epsilon=2.0, delta=1e-5
    )
    assert choice.separation == 2 and [row[0] for row in choice.sweep] == [2]
    with pytest.raises(cr.FactorizationError, match=r"^no b has groups of at least the cohort"):
        cr.least_error_separation(
            rounds=6, cohort=2, group_sizes={3: 1, 9: 2}, target_epsilon=2.0, delta=1e-5
        )
