"""Water-filling (Theorem 5) and the group-fairness program (Theorem 9) of Subspace-DP-FL."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import optimize

from privacy.allocation import (
    FairAllocation,
    distortion,
    fair_allocation,
    subspace_energies,
    water_filling,
)
from privacy.subspace import orthonormalize, uniform_allocation


def random_instance(rng, *, binding=True, zeros=True, k=None):
    """Energies spanning six orders of magnitude (some zero), a, b, τ and a budget B."""
    k = int(rng.integers(2, 41)) if k is None else k
    g = 10.0 ** rng.uniform(-3, 3, size=k)
    if zeros:
        g[rng.random(k) < 0.2] = 0.0
        g[0] = 0.0
    a, b, tau = 10.0 ** rng.uniform(-1, 1, size=3)
    tau = tau / 10
    if binding:
        budget = float(10.0 ** rng.uniform(-1, 2))
    else:  # twice the unconstrained optimum's Σλ (finite: every g_i > 0)
        budget = 2 * float(np.sum(np.maximum(tau, np.sqrt(b / (a * g))) - tau))
    return g, a, b, tau, budget


def objective(g, lam, a, b, tau):
    p = tau + lam
    return float(np.sum(a * g * p + b / p))


def generic_solve(g, a, b, tau, budget):
    """SLSQP on the same objective and constraints, from the uniform allocation.

    The variables are q = log p (p = τ + λ, bounds q >= log τ, budget Σ(e^q − τ) <= B):
    the same problem, better conditioned where p is large and the objective flat.
    """
    k = g.size
    start = np.log(tau + uniform_allocation(k, budget))
    scale = objective(g, np.exp(start) - tau, a, b, tau)
    result = optimize.minimize(
        lambda q: objective(g, np.exp(q) - tau, a, b, tau) / scale,
        start,
        jac=lambda q: (a * g * np.exp(q) - b * np.exp(-q)) / scale,
        method="SLSQP",
        bounds=[(np.log(tau), None)] * k,
        constraints=[
            {
                "type": "ineq",
                "fun": lambda q: budget + k * tau - np.sum(np.exp(q)),
                "jac": lambda q: -np.exp(q),
            }
        ],
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    lam = np.maximum(np.exp(result.x) - tau, 0.0)
    return lam * min(1.0, budget / lam.sum())


def epigraph_solve(energies, a, b, tau, budget):
    """min t s.t. t >= D_g(λ) for every group, λ >= 0, Σλ <= B (SLSQP, from uniform)."""
    k = energies.shape[1]

    def group_values(lam):
        p = tau + lam
        return a * energies @ p + b * np.sum(1.0 / p)

    start = uniform_allocation(k, budget)
    scale = float(group_values(start).max())
    result = optimize.minimize(
        lambda z: z[-1],
        np.append(start, 1.0),
        jac=lambda z: np.append(np.zeros(k), 1.0),
        method="SLSQP",
        bounds=[(0.0, None)] * k + [(None, None)],
        constraints=[
            {"type": "ineq", "fun": lambda z: z[-1] - group_values(z[:-1]) / scale},
            {"type": "ineq", "fun": lambda z: budget - np.sum(z[:-1])},
        ],
        options={"ftol": 1e-15, "maxiter": 2000},
    )
    lam = np.maximum(result.x[:-1], 0.0)
    lam = lam * min(1.0, budget / lam.sum())
    return lam, float(group_values(lam).max())


# -- water_filling ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(30))
def test_water_filling_satisfies_kkt(seed):
    # Prepare: binding budgets (with zero energies) and non-binding ones, alternately.
    rng = np.random.default_rng(seed)
    g, a, b, tau, budget = random_instance(rng, binding=seed % 3 != 0, zeros=seed % 3 != 0)

    # Execute
    lam = water_filling(g, a=a, b=b, tau=tau, budget=budget)

    # Assert: feasibility.
    p = tau + lam
    assert lam.shape == g.shape and np.all(lam >= 0) and lam.sum() <= budget * (1 + 1e-12)
    active = lam > 0
    assert active.any()
    # The multiplier ν: 0 when the budget is slack, else read off the largest eigenvalue
    # (smallest a g_i, so b/p² − a g loses no digits); the others must agree (below).
    slack = lam.sum() < budget * (1 - 1e-9)
    top = int(np.argmax(lam))
    nu = 0.0 if slack else float(b / p[top] ** 2 - a * g[top])
    assert nu >= 0 and nu * (budget - lam.sum()) <= 1e-8 * nu * budget
    # Stationarity a g_i − b/p_i² + ν − μ_i = 0: μ_i = 0 where λ_i > 0 ...
    scale = b / p**2
    residual = a * g[active] - b / p[active] ** 2 + nu
    np.testing.assert_array_less(np.abs(residual), 1e-8 * scale[active])
    # ... and μ_i = a g_i − b/τ² + ν >= 0 where λ_i = 0.
    mu = a * g[~active] - b / tau**2 + nu
    assert np.all(mu >= -1e-8 * b / tau**2)
    if seed % 3 == 0:
        assert slack and nu == 0.0


def test_kkt_instances_have_inactive_directions_and_a_binding_budget():
    rng = np.random.default_rng(7)
    g, a, b, tau, budget = random_instance(rng, k=40)
    lam = water_filling(g, a=a, b=b, tau=tau, budget=budget)
    assert np.any(lam == 0) and np.any(lam > 0)
    assert lam.sum() == pytest.approx(budget, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_water_filling_matches_a_generic_solver(seed):
    rng = np.random.default_rng(100 + seed)
    g, a, b, tau, budget = random_instance(rng, binding=seed % 4 != 0, zeros=seed % 4 != 0)

    lam = water_filling(g, a=a, b=b, tau=tau, budget=budget)
    reference = generic_solve(g, a, b, tau, budget)

    ours, theirs = objective(g, lam, a, b, tau), objective(g, reference, a, b, tau)
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert ours <= theirs * (1 + 1e-12)


def test_water_filling_hand_computed_both_directions_active():
    # g = (0, 8), a = b = 1, τ = 1/4: ν = 1 gives p = (1/√1, 1/√9) = (1, 1/3),
    # λ = (3/4, 1/12), Σλ = 5/6 =: B; D = (0 + 1) + (8/3 + 3) = 20/3.
    lam = water_filling(np.array([0.0, 8.0]), a=1.0, b=1.0, tau=0.25, budget=5 / 6)
    np.testing.assert_allclose(lam, [0.75, 1 / 12], rtol=1e-13)
    assert distortion(np.array([0.0, 8.0]), lam, a=1.0, b=1.0, tau=0.25) == pytest.approx(
        20 / 3, rel=1e-13
    )


def test_water_filling_hand_computed_floor_binds():
    # g = (0, 3), a = b = 1, τ = 1/2, B = 1/4: ν = 16/9 gives p_1 = 3/4 and
    # √(1/(3 + 16/9)) < τ, so λ = (1/4, 0); D = 4/3 + (3/2 + 2) = 29/6.
    lam = water_filling(np.array([0.0, 3.0]), a=1.0, b=1.0, tau=0.5, budget=0.25)
    np.testing.assert_allclose(lam, [0.25, 0.0], rtol=1e-13, atol=0)
    assert distortion(np.array([0.0, 3.0]), lam, a=1.0, b=1.0, tau=0.5) == pytest.approx(29 / 6)


def test_water_filling_hand_computed_budget_slack():
    # g = (1, 4), a = b = 1, τ = 1/4: ν = 0, p = (1, 1/2), λ = (3/4, 1/4); B = 2 is slack.
    lam = water_filling(np.array([1.0, 4.0]), a=1.0, b=1.0, tau=0.25, budget=2.0)
    np.testing.assert_allclose(lam, [0.75, 0.25], rtol=1e-15)


def test_water_filling_edge_cases():
    assert water_filling(np.zeros(0), a=1.0, b=1.0, tau=1.0, budget=3.0).shape == (0,)
    np.testing.assert_array_equal(
        water_filling(np.array([0.0, 1.0]), a=1.0, b=1.0, tau=1.0, budget=0.0), [0.0, 0.0]
    )
    # Equal energies, binding budget: the even split.
    lam = water_filling(np.full(4, 2.0), a=1.0, b=1.0, tau=0.1, budget=1.0)
    np.testing.assert_allclose(lam, np.full(4, 0.25), rtol=1e-13)


def test_water_filling_keeps_digits_when_the_floor_dwarfs_the_budget():
    # Zero energies: the even split B/k, exactly, however large τ is (no √· − τ cancellation).
    lam = water_filling(np.zeros(7), a=1.0, b=1e-2, tau=3e5, budget=1e-6)
    np.testing.assert_allclose(lam, np.full(7, 1e-6 / 7), rtol=1e-14)
    assert lam.sum() <= 1e-6


@pytest.mark.parametrize("seed", range(20))
def test_water_filling_never_worse_than_uniform(seed):
    rng = np.random.default_rng(200 + seed)
    g, a, b, tau, budget = random_instance(rng, binding=seed % 2 == 0, zeros=seed % 2 == 0)
    lam = water_filling(g, a=a, b=b, tau=tau, budget=budget)
    uniform = uniform_allocation(g.size, budget)
    assert objective(g, lam, a, b, tau) <= objective(g, uniform, a, b, tau) * (1 + 1e-12)


def test_water_filling_beats_uniform_strictly_on_an_anisotropic_spectrum():
    g = np.array([100.0, 1.0, 0.01])
    lam = water_filling(g, a=1.0, b=1.0, tau=0.1, budget=3.0)
    uniform = uniform_allocation(3, 3.0)
    assert objective(g, lam, 1.0, 1.0, 0.1) < 0.9 * objective(g, uniform, 1.0, 1.0, 0.1)


# -- subspace_energies -----------------------------------------------------------------
def test_subspace_energies_hand_computed():
    samples = np.array([[1.0, 0.0], [0.0, 2.0]])
    basis = np.array([[1.0, 1.0], [1.0, -1.0]]) / np.sqrt(2)
    # (u_1ᵀx)² = 1/2 and 2; (u_2ᵀx)² = 1/2 and 2: both means are 5/4.
    np.testing.assert_allclose(subspace_energies(samples, basis), [1.25, 1.25])
    np.testing.assert_allclose(subspace_energies(samples, np.eye(2)), [0.5, 2.0])


def test_subspace_energies_equal_the_second_moment_along_u():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 9)) * np.arange(1, 10)
    u = orthonormalize(rng.standard_normal((9, 4)))
    second_moment = x.T @ x / 50
    np.testing.assert_allclose(
        subspace_energies(x, u), np.diag(u.T @ second_moment @ u), rtol=1e-12
    )


# -- fair_allocation -------------------------------------------------------------------
def test_fair_allocation_with_one_group_is_water_filling():
    rng = np.random.default_rng(11)
    g, a, b, tau, budget = random_instance(rng, k=12)
    fair = fair_allocation(g[None, :], a=a, b=b, tau=tau, budget=budget)
    np.testing.assert_array_equal(fair.lam, water_filling(g, a=a, b=b, tau=tau, budget=budget))
    assert isinstance(fair, FairAllocation)
    assert fair.weights.tolist() == [1.0] and fair.gap == 0.0
    assert fair.max_distortion == pytest.approx(objective(g, fair.lam, a, b, tau), rel=1e-14)


def test_fair_allocation_with_identical_groups_is_water_filling():
    rng = np.random.default_rng(12)
    g, a, b, tau, budget = random_instance(rng, k=15)
    fair = fair_allocation(np.stack([g, g]), a=a, b=b, tau=tau, budget=budget)
    expected = water_filling(g, a=a, b=b, tau=tau, budget=budget)
    np.testing.assert_allclose(fair.lam, expected, rtol=1e-12, atol=1e-15)
    assert fair.distortions[0] == fair.distortions[1] and fair.gap <= 1e-12 * fair.max_distortion


def test_fair_allocation_symmetric_groups_hand_computed():
    # Energies (2, 0) and (0, 2), a = b = 1, τ = 1/2, B = 0.6: by symmetry w = (½, ½),
    # pooled energies (1, 1), binding even split λ = (0.3, 0.3), p = 0.8,
    # D_g = 2·0.8 + 2/0.8 = 4.1 for both groups.
    energies = np.array([[2.0, 0.0], [0.0, 2.0]])
    fair = fair_allocation(energies, a=1.0, b=1.0, tau=0.5, budget=0.6)
    np.testing.assert_allclose(fair.lam, [0.3, 0.3], rtol=1e-12)
    np.testing.assert_allclose(fair.weights, [0.5, 0.5], rtol=1e-12)
    np.testing.assert_allclose(fair.distortions, [4.1, 4.1], rtol=1e-12)
    assert fair.lower_bound == pytest.approx(4.1, rel=1e-12)


def test_fair_allocation_beats_pooled_and_uniform_on_different_spectra():
    # Prepare: group 0 concentrates its energy on the first directions, group 1
    # (ten times weaker) on the last ones.
    energies = np.array([[100.0, 30.0, 1.0, 0.1, 0.0, 0.0], [0.0, 0.0, 0.1, 0.3, 3.0, 10.0]])
    params = {"a": 1.0, "b": 2.0, "tau": 0.1, "budget": 8.0}

    # Execute
    fair = fair_allocation(energies, **params)

    # Assert: feasible, certified, and strictly better than the two simple rules.
    assert np.all(fair.lam >= 0) and fair.lam.sum() <= params["budget"] * (1 + 1e-12)
    assert 0 <= fair.gap <= 1e-9 * fair.max_distortion
    assert fair.lower_bound <= fair.max_distortion
    assert fair.weights.min() > 0 and fair.weights.sum() == pytest.approx(1.0)

    def worst(lam):
        return max(objective(row, lam, 1.0, 2.0, 0.1) for row in energies)

    pooled = water_filling(energies.mean(axis=0), **params)
    uniform = uniform_allocation(6, params["budget"])
    assert fair.max_distortion < worst(pooled) * (1 - 1e-3)
    assert fair.max_distortion < worst(uniform) * (1 - 1e-3)
    assert fair.max_distortion == pytest.approx(worst(fair.lam), rel=1e-14)
    _, reference = epigraph_solve(energies, 1.0, 2.0, 0.1, 8.0)
    assert fair.max_distortion == pytest.approx(reference, rel=1e-6)
    assert fair.max_distortion <= reference * (1 + 1e-12)


@pytest.mark.parametrize(("seed", "groups"), [(0, 2), (1, 2), (2, 3), (3, 4), (4, 5)])
def test_fair_allocation_matches_an_epigraph_solve(seed, groups):
    rng = np.random.default_rng(300 + seed)
    k = int(rng.integers(3, 20))
    energies = 10.0 ** rng.uniform(-2, 2, size=(groups, k)) * (rng.random((groups, k)) < 0.8)
    budget = float(10.0 ** rng.uniform(0, 1.5))
    fair = fair_allocation(energies, a=1.0, b=1.0, tau=0.2, budget=budget)

    _, reference = epigraph_solve(energies, 1.0, 1.0, 0.2, budget)

    assert fair.max_distortion == pytest.approx(reference, rel=1e-6)
    assert 0 <= fair.gap <= 1e-9 * fair.max_distortion
    assert fair.lower_bound <= reference * (1 + 1e-12)  # weak duality against SLSQP
    assert np.all(fair.lam >= 0) and fair.lam.sum() <= budget * (1 + 1e-12)
    assert np.all(fair.weights >= 0) and fair.weights.sum() == pytest.approx(1.0, abs=1e-12)


def test_fair_allocation_offsets_shift_the_binding_group():
    # Group 0's constant is so large that it binds alone: w = (1, 0), its water-filling.
    energies = np.array([[1.0, 5.0, 0.0], [4.0, 0.0, 2.0]])
    fair = fair_allocation(energies, a=1.0, b=1.0, tau=0.3, budget=2.0, offsets=[1e3, 0.0])
    np.testing.assert_array_equal(fair.weights, [1.0, 0.0])
    expected = water_filling(energies[0], a=1.0, b=1.0, tau=0.3, budget=2.0)
    np.testing.assert_allclose(fair.lam, expected, rtol=1e-14)
    assert fair.gap == 0.0 and fair.max_distortion == fair.distortions[0] > 1e3


def test_fair_allocation_with_no_directions():
    fair = fair_allocation(np.zeros((3, 0)), a=1.0, b=1.0, tau=1.0, budget=1.0, offsets=[1, 3, 2])
    assert fair.lam.shape == (0,) and fair.max_distortion == 3.0 and fair.gap == 0.0


# -- bad input -------------------------------------------------------------------------
GOOD = {"a": 1.0, "b": 1.0, "tau": 0.5, "budget": 1.0}


@pytest.mark.parametrize(
    ("energies", "override", "match"),
    [
        (np.array([1.0, -1.0]), {}, "energies"),
        (np.array([1.0, np.nan]), {}, "energies"),
        (np.ones((2, 2)), {}, "energies"),
        (np.ones(2), {"a": 0.0}, "a must be positive"),
        (np.ones(2), {"b": -1.0}, "b must be positive"),
        (np.ones(2), {"tau": 0.0}, "tau must be positive"),
        (np.ones(2), {"tau": np.inf}, "tau must be positive"),
        (np.ones(2), {"budget": -0.1}, "budget must be finite and >= 0"),
    ],
)
def test_water_filling_rejects_bad_input(energies, override, match):
    with pytest.raises(ValueError, match=match):
        water_filling(energies, **{**GOOD, **override})


def test_other_functions_reject_bad_input():
    with pytest.raises(ValueError, match="group_energies"):
        fair_allocation(np.ones(3), **GOOD)
    with pytest.raises(ValueError, match="group_energies"):
        fair_allocation(np.array([[1.0, np.nan]]), **GOOD)
    with pytest.raises(ValueError, match="offsets"):
        fair_allocation(np.ones((2, 3)), **GOOD, offsets=[0.0])
    with pytest.raises(ValueError, match="budget"):
        fair_allocation(np.ones((2, 3)), **{**GOOD, "budget": np.nan})
    with pytest.raises(ValueError, match="lam"):
        distortion(np.ones(2), np.ones(3), a=1.0, b=1.0, tau=1.0)
    with pytest.raises(ValueError, match="lam"):
        distortion(np.ones(2), np.array([-2.0, 0.0]), a=1.0, b=1.0, tau=1.0)
    with pytest.raises(ValueError, match="samples"):
        subspace_energies(np.ones(3), np.eye(3))
    with pytest.raises(ValueError, match="basis"):
        subspace_energies(np.ones((2, 3)), np.eye(2))
