"""PLD calibration on coarse grids, checked at the ledger's: ε <= target always, against
dp-accounting's own PLD accountant, on the peer workloads (digits, Poisson sampling)."""

from __future__ import annotations

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from privacy import calibration
from privacy.calibration import calibrate_noise_multiplier, calibrate_parameter
from privacy.events import PLD_DISCRETIZATION, Release

DELTA = 1e-5


def _pld_epsilon(z: float, q: float, rounds: int, discretization=PLD_DISCRETIZATION) -> float:
    """dp-accounting directly: T Poisson-subsampled Gaussians, add-or-remove-one."""
    accountant = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, discretization
    )
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
    )
    return accountant.get_epsilon(DELTA)


# (population, sampled per round, rounds, target ε): the peer workloads' corners.
WORKLOADS = [(100, 10, 30, 8.0), (100, 10, 1000, 2.0), (1000, 50, 30, 2.0), (1000, 50, 1000, 8.0)]


@pytest.mark.parametrize(("population", "sampled", "rounds", "target"), WORKLOADS)
def test_calibrated_z_meets_the_target_under_dp_accounting(population, sampled, rounds, target):
    z = calibrate_noise_multiplier(
        target_epsilon=target,
        target_delta=DELTA,
        rounds=rounds,
        sample_size=sampled,
        population=population,
        sampling="poisson",
        accountant="pld",
    )
    reached = _pld_epsilon(z, sampled / population, rounds)
    assert reached <= target
    # Nearly the smallest: 0.1 % less noise exceeds the target.
    assert _pld_epsilon(z * (1 - 1e-3), sampled / population, rounds) > target
    assert reached >= target - 2e-3


def test_the_same_workload_again_costs_no_pld():
    setting = {
        "target_epsilon": 4.0,
        "target_delta": DELTA,
        "rounds": 50,
        "sample_size": 10,
        "population": 100,
        "sampling": "poisson",
        "accountant": "pld",
    }
    first = calibrate_noise_multiplier(**setting)
    misses = calibration._pld_epsilon.cache_info().misses
    assert calibrate_noise_multiplier(**setting) == first
    assert calibration._pld_epsilon.cache_info().misses == misses


@pytest.mark.parametrize("z", [0.6, 1.5])
def test_a_coarser_grid_never_reports_less_epsilon(z):
    # What the search relies on (dp-accounting's pessimistic discretisation); the result
    # is checked at the ledger's grid anyway.
    fine = _pld_epsilon(z, 0.1, 100)
    for factor in (20, 40):
        assert _pld_epsilon(z, 0.1, 100, PLD_DISCRETIZATION * factor) >= fine


def test_laplace_rounds_calibrated_under_pld():
    # p = 1 / (per-round ε) of a Poisson-sampled Laplace release, 20 rounds.
    def releases(p: float) -> list[Release]:
        return [
            Release(
                server_round=0,
                kind="calibration",
                mechanism="laplace",
                laplace_epsilon=1 / p,
                sampling="poisson",
                sample_size=5,
                population=50,
                count=20,
            )
        ]

    p = calibrate_parameter(
        releases,
        target_epsilon=3.0,
        target_delta=DELTA,
        accountant="pld",
        neighboring="add-or-remove-one",
    )

    def epsilon(parameter: float) -> float:
        accountant = pld_privacy_accountant.PLDAccountant(
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, PLD_DISCRETIZATION
        )
        event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.LaplaceDpEvent(parameter))
        accountant.compose(event, 20)
        return accountant.get_epsilon(DELTA)

    assert epsilon(p) <= 3.0 < epsilon(p * (1 - 1e-3))
