"""PLD ε at checkpoint counts (PrivacyLedger.checkpoints: FINE_ and SPARSE_CHECKPOINTS).

The reported ε is dp-accounting's PLDAccountant ε of each event's count rounded up to a
checkpoint: the composition of more releases than ran, never below the exact ε of what
ran. A 1e-3 grid (the app's is 1e-4) keeps these compositions cheap.
"""

from __future__ import annotations

import functools
from dataclasses import asdict

import dp_accounting
import pytest
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from privacy import composition
from privacy.accounting import (
    FINE_CHECKPOINTS,
    SPARSE_CHECKPOINTS,
    Checkpoints,
    PrivacyLedger,
    Release,
)

NR = dp_accounting.NeighboringRelation
GRID = 1e-3
EVENT = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0))


def _release(server_round: int = 1, count: int = 1, z: float = 1.0) -> Release:
    return Release(
        server_round=server_round, kind="model-update", mechanism="gaussian",
        noise_multiplier=z, sampling="poisson", sample_size=10, population=100, count=count,
    )  # fmt: skip


def _ledger(checkpoints: Checkpoints | None = FINE_CHECKPOINTS, **kw) -> PrivacyLedger:
    ledger = PrivacyLedger(
        accountant="pld", target_delta=1e-5, sampling="poisson", pld_discretization=GRID, **kw
    )
    ledger.checkpoints = checkpoints
    return ledger


@functools.cache
def _reference(*groups: tuple[dp_accounting.DpEvent, int], delta: float = 1e-5) -> float:
    accountant = PLDAccountant(NR.ADD_OR_REMOVE_ONE, GRID)
    for event, count in groups:
        accountant.compose(event, count)
    return accountant.get_epsilon(delta)


def test_checkpoint_counts_hand_computed():
    # Up to 128 unchanged; then rounded up to 7 significant bits: steps of 2 below 256,
    # 4 below 512, 8 below 1024.
    cases = {1: 1, 64: 64, 128: 128, 129: 130, 255: 256, 256: 256, 257: 260, 1000: 1000}
    cases |= {1001: 1008, 1009: 1016, 2047: 2048, 5000: 5056}
    assert {count: FINE_CHECKPOINTS.round_up(count) for count in cases} == cases
    for count in range(1, 5000):
        rounded = FINE_CHECKPOINTS.round_up(count)
        assert count <= rounded <= count * (1 + 1 / 64)
        assert FINE_CHECKPOINTS.round_up(rounded) == rounded


@pytest.mark.parametrize("count", [129, 301])
def test_epsilon_is_dp_accountings_at_the_checkpoint_and_bounds_the_exact_one(count):
    ledger = _ledger()
    ledger.charge(_release(count=count))
    exact = _reference((EVENT, count))
    assert ledger.epsilon() == _reference((EVENT, FINE_CHECKPOINTS.round_up(count)))
    assert ledger.accountant_epsilon() == ledger.epsilon()
    assert exact < ledger.epsilon() <= _reference((EVENT, FINE_CHECKPOINTS.round_up(count) + 1))
    rounded = FINE_CHECKPOINTS.round_up(count)
    assert ledger.epsilon(1e-7) == _reference((EVENT, rounded), delta=1e-7)
    assert ledger.summary()["epsilon"] == ledger.epsilon()


def test_off_by_default_and_exact_up_to_128():
    plain = _ledger(checkpoints=None)
    plain.charge(_release(count=129))
    assert plain.epsilon() == _reference((EVENT, 129))
    small = _ledger()
    small.charge(_release(count=128))
    assert small.epsilon() == _reference((EVENT, 128))


def test_every_group_is_rounded_in_its_order():
    other = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(3.0))
    ledger = _ledger()
    ledger.charge([_release(count=130), _release(count=131, z=3.0)])
    assert ledger.epsilon() == _reference((EVENT, 130), (other, 132))
    assert ledger.epsilon() > _reference((EVENT, 130), (other, 131))


def test_budget_near_the_rounded_epsilon_is_decided_exactly():
    exact, rounded = _reference((EVENT, 129)), _reference((EVENT, 130))
    ledger = _ledger(max_epsilon=(exact + rounded) / 2)
    assert not ledger.would_exceed(_release(count=129))
    ledger.charge(_release(count=129))  # accepted: what ran is within the budget
    assert ledger.epsilon() == exact <= ledger.max_epsilon
    assert ledger.would_exceed(_release())  # 130 releases exceed it
    roomy = _ledger(max_epsilon=rounded)
    roomy.charge(_release(count=129))
    assert roomy.epsilon() == rounded


def test_rounds_between_checkpoints_compose_once_and_reload_gives_the_same_epsilon(
    monkeypatch,
):
    ledger = _ledger(max_epsilon=1e9)
    ledger.charge(_release(count=1000))
    calls = []
    original = composition.compose_groups
    monkeypatch.setattr(
        composition, "compose_groups", lambda *a, **k: calls.append(a) or original(*a, **k)
    )
    epsilons = []
    for server_round in range(1001, 1008):  # 1001..1007 all round up to 1008
        assert not ledger.would_exceed(_release(server_round))
        ledger.charge(_release(server_round))
        epsilons.append(ledger.epsilon())
    assert len(calls) == 1
    assert epsilons == [_reference((EVENT, 1008))] * 7
    reloaded = _ledger(max_epsilon=1e9)
    reloaded.load_state_dict(ledger.state_dict())
    assert reloaded.epsilon() == epsilons[-1]
    # A reader that replays the state without checkpoints gets the exact, smaller ε.
    replayed = PrivacyLedger.from_state_dict(ledger.state_dict())
    assert replayed.epsilon() == _reference((EVENT, 1007)) < epsilons[-1]
    assert asdict(replayed.releases[-1]) == asdict(_release(1007)) and len(replayed.releases) == 8


def test_state_dict_caches_release_dicts_but_returns_fresh_ones():
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="poisson")
    ledger.charge(_release(1))
    first = ledger.state_dict()
    first["releases"][0]["count"] = 99  # a caller's edit stays in its copy
    ledger.charge(_release(2, count=3))
    second = ledger.state_dict()
    assert second["releases"] == [asdict(_release(1)), asdict(_release(2, count=3))]
    other = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="poisson")
    other.charge(_release(7))
    other.state_dict()
    other.load_state_dict(second)  # replaced releases: the cache follows
    assert other.state_dict() == second


def test_a_planned_count_caps_its_checkpoint():
    ledger = _ledger()
    ledger.plan(_release(count=1001))
    ledger.charge(_release(count=999))
    assert ledger.epsilon() == _reference((EVENT, 1000))  # 999 -> 1000 <= 1001
    ledger.charge(_release(count=2))
    assert ledger.epsilon() == _reference((EVENT, 1001))  # the planned run's exact ε
    ledger.charge(_release())
    assert ledger.epsilon() == _reference((EVENT, 1008))  # past the plan: checkpoints


# -- the run's schedule: SPARSE_CHECKPOINTS (2 significant bits from the first count) --


def _sparse(**kw) -> PrivacyLedger:
    ledger = _ledger(**kw)
    ledger.checkpoints = SPARSE_CHECKPOINTS
    return ledger


def test_sparse_checkpoints_hand_computed():
    cases = {1: 1, 2: 2, 3: 3, 4: 4, 5: 6, 6: 6, 7: 8, 9: 12, 13: 16, 17: 24, 25: 32}
    cases |= {30: 32, 97: 128, 129: 192, 193: 256, 1000: 1024, 1025: 1536}
    assert {count: SPARSE_CHECKPOINTS.round_up(count) for count in cases} == cases
    for count in range(1, 5000):
        rounded = SPARSE_CHECKPOINTS.round_up(count)
        assert count <= rounded <= 1.5 * count
        assert SPARSE_CHECKPOINTS.round_up(rounded) == rounded
    # Two checkpoints per doubling: 10 distinct values for counts 1..30 with 30 planned.
    assert len({min(SPARSE_CHECKPOINTS.round_up(c), 30) for c in range(1, 31)}) == 10
    assert Checkpoints(exact=128, bits=7) == FINE_CHECKPOINTS


def test_sparse_planned_run_never_below_dp_accounting_exact_at_the_end(monkeypatch):
    # A calibrated 30-round run: its budget is the planned run's ε.
    planned = _reference((EVENT, 30))
    ledger = _sparse(max_epsilon=planned)
    ledger.plan(_release(count=30))
    calls = []
    original = composition.compose_groups
    monkeypatch.setattr(
        composition, "compose_groups", lambda *a, **k: calls.append(a) or original(*a, **k)
    )
    epsilons = []
    for server_round in range(1, 31):
        assert not ledger.would_exceed(_release(server_round))
        ledger.charge(_release(server_round))
        epsilons.append(ledger.epsilon())
    for count, epsilon in enumerate(epsilons, start=1):
        assert epsilon >= _reference((EVENT, count))  # never below dp-accounting's
        assert epsilon == _reference((EVENT, min(SPARSE_CHECKPOINTS.round_up(count), 30)))
    assert epsilons[-1] == planned  # the calibrated run's last round: exact
    assert epsilons == sorted(epsilons)
    assert len(calls) == 10  # counts 1, 2, 3, 4, 6, 8, 12, 16, 24, 30
    assert ledger.would_exceed(_release(31))


def test_sparse_budget_between_exact_and_rounded_is_decided_exactly():
    exact, rounded = _reference((EVENT, 9)), _reference((EVENT, 12))
    ledger = _sparse(max_epsilon=(exact + rounded) / 2)
    ledger.charge(_release(count=8))
    assert ledger.epsilon() == _reference((EVENT, 8))
    assert not ledger.would_exceed(_release(9))  # 9 releases are within the budget
    ledger.charge(_release(9))
    assert ledger.epsilon() == exact <= ledger.max_epsilon
    plain = _sparse()  # no budget: the rounded ε, an upper bound
    plain.charge(_release(count=9))
    assert plain.epsilon() == rounded > exact
