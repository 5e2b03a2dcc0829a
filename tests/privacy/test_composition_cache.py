"""Cached per-event compositions equal dp-accounting's accountants bit for bit.

``privacy.composition.compose_pld`` mirrors ``PLDAccountant._maybe_compose`` with the
count-independent PLD of each event memoised (``event_pld``); ``compose_rdp`` adds
memoised RDP curves. Every comparison here is ``==``: a dp-accounting upgrade that
changes how the accountant builds or composes a PLD makes these tests fail.
"""

from __future__ import annotations

import logging

import dp_accounting
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from privacy import composition
from privacy.accounting import RDP_ORDERS, PrivacyLedger, Release
from privacy.composition import compose_pld, compose_rdp, event_pld, event_rdp_curve

logging.getLogger("absl").setLevel(logging.ERROR)

NR = dp_accounting.NeighboringRelation
G, L = dp_accounting.GaussianDpEvent, dp_accounting.LaplaceDpEvent
Poisson, WOR = dp_accounting.PoissonSampledDpEvent, dp_accounting.SampledWithoutReplacementDpEvent
RELATIONS = {"add-or-remove-one": NR.ADD_OR_REMOVE_ONE, "replace-one": NR.REPLACE_ONE}
COARSE = 1e-3  # 10x fewer PLD points than the app's 1e-4: same code path, faster tests


def _accountant(groups, neighboring, discretization):
    reference = PLDAccountant(RELATIONS[neighboring], discretization)
    for event, count in groups:
        reference.compose(event, count)
    return reference


def _assert_same(groups, neighboring, discretization=COARSE):
    mine = compose_pld(groups, neighboring, discretization)
    reference = _accountant(groups, neighboring, discretization)
    for delta in (1e-7, 1e-5, 1e-3):
        assert mine.get_epsilon(delta) == reference.get_epsilon(delta)
    for epsilon in (0.5, 2.0, 8.0):
        assert mine.get_delta(epsilon) == reference.get_delta(epsilon)
    return mine


# Every event type PLDAccountant supports that compose_pld mirrors (not a fallback).
MIRRORED = {
    "gaussian": ("add-or-remove-one", G(10.0)),
    "gaussian replace-one": ("replace-one", G(10.0)),
    "laplace": ("add-or-remove-one", L(2.0)),
    "poisson gaussian": ("add-or-remove-one", Poisson(0.1, G(1.0))),
    "poisson laplace": ("add-or-remove-one", Poisson(0.05, L(1.0))),
    "self-composed": ("add-or-remove-one", dp_accounting.SelfComposedDpEvent(L(3.0), 4)),
    "composed": (
        "add-or-remove-one",
        dp_accounting.ComposedDpEvent([Poisson(0.1, G(2.0)), L(5.0), G(20.0)]),
    ),
    "no-op": ("add-or-remove-one", dp_accounting.NoOpDpEvent()),
    "q = 0": ("add-or-remove-one", Poisson(0.0, G(1.0))),
}


@pytest.mark.parametrize("count", [1, 7, 100])
@pytest.mark.parametrize("name", sorted(MIRRORED))
def test_each_mirrored_event_equals_pld_accountant(name, count):
    neighboring, event = MIRRORED[name]
    mine = _assert_same(((event, count),), neighboring)
    assert isinstance(mine, composition.PldComposition)


@pytest.mark.parametrize(
    "neighboring,event",
    [
        ("add-or-remove-one", dp_accounting.NonPrivateDpEvent()),
        ("add-or-remove-one", G(0.0)),
        ("add-or-remove-one", Poisson(0.1, G(0.0))),
        ("add-or-remove-one", L(0.0)),
    ],
)
def test_non_private_events_give_infinite_epsilon_like_the_accountant(neighboring, event):
    groups = ((Poisson(0.1, G(1.0)), 3), (event, 2))
    mine = compose_pld(groups, neighboring, COARSE)
    reference = _accountant(groups, neighboring, COARSE)
    assert mine.get_epsilon(1e-5) == reference.get_epsilon(1e-5) == float("inf")
    assert mine.get_delta(1.0) == reference.get_delta(1.0) == 1


def test_app_default_discretisation_several_groups_and_count_1000():
    groups = (
        (Poisson(0.1, G(1.0)), 1000),
        (Poisson(0.1, G(3.0)), 17),
        (L(2.0), 5),
        (Poisson(0.05, L(1.0)), 7),
    )
    _assert_same(groups, "add-or-remove-one", 1e-4)


def test_group_order_is_kept():
    first, second = (Poisson(0.1, G(1.0)), 3), (L(1.0), 2)
    _assert_same((first, second), "add-or-remove-one")
    _assert_same((second, first), "add-or-remove-one")


@pytest.mark.parametrize(
    "neighboring,event",
    [
        ("replace-one", dp_accounting.RandomizedResponseDpEvent(0.5, 3)),
        ("add-or-remove-one", dp_event.DiscreteLaplaceDpEvent(1.0, 1)),
    ],
)
def test_events_not_mirrored_fall_back_to_the_accountant(neighboring, event):
    groups = ((G(10.0), 2), (event, 3))
    mine = _assert_same(groups, neighboring)
    assert isinstance(mine, PLDAccountant)


@pytest.mark.parametrize(
    "neighboring,event",
    [
        ("replace-one", WOR(100, 10, G(1.0))),  # PLD has no sampling without replacement
        ("replace-one", L(1.0)),  # PLD's Laplace needs add-or-remove-one
        ("replace-one", Poisson(0.1, L(1.0))),
    ],
)
def test_unsupported_events_raise_like_the_accountant(neighboring, event):
    with pytest.raises(dp_accounting.UnsupportedEventError):
        _accountant(((event, 1),), neighboring, COARSE)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        compose_pld(((G(10.0), 1), (event, 1)), neighboring, COARSE)


def test_second_composition_with_another_count_reuses_the_event_pld(monkeypatch):
    event = Poisson(0.1, G(1.5))
    event_pld.cache_clear()
    compose_pld(((event, 3),), "add-or-remove-one", COARSE)
    builds = []
    real = privacy_loss_distribution.from_gaussian_mechanism
    monkeypatch.setattr(
        privacy_loss_distribution,
        "from_gaussian_mechanism",
        lambda *a, **k: builds.append(k) or real(*a, **k),
    )
    _assert_same(((event, 1000),), "add-or-remove-one")
    info = event_pld.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert len(builds) == 1  # the reference accountant's own build, not compose_pld's


def test_pld_ledger_builds_each_event_once():
    event_pld.cache_clear()
    ledger = PrivacyLedger(
        accountant="pld", target_delta=1e-5, max_epsilon=1e6, sampling="poisson"
    )
    for rnd in range(1, 6):
        ledger.charge(
            Release(
                server_round=rnd,
                kind="model-update",
                mechanism="gaussian",
                noise_multiplier=1.2,
                sampling="poisson",
                sample_size=10,
                population=100,
            )
        )
        ledger.epsilon()
    assert event_pld.cache_info().misses == 1
    assert ledger.epsilon() == _accountant(
        ((Poisson(0.1, G(1.2)), 5),), "add-or-remove-one", 1e-4
    ).get_epsilon(1e-5)


# -- RDP: memoised curves ---------------------------------------------------------
@pytest.mark.parametrize(
    "neighboring,events",
    [
        ("replace-one", (WOR(100, 10, G(1.0)), WOR(100, 10, G(2.5)), G(4.0))),
        ("add-or-remove-one", (Poisson(0.1, G(1.0)), Poisson(0.01, G(2.5)), L(3.0))),
    ],
)
def test_rdp_equals_rdp_accountant(neighboring, events):
    groups = tuple(zip(events, (1000, 7, 1), strict=True))
    reference = RdpAccountant(RDP_ORDERS, RELATIONS[neighboring])
    for event, count in groups:
        reference.compose(event, count)
    mine = compose_rdp(groups, neighboring, RDP_ORDERS)
    for delta in (1e-7, 1e-5):
        assert mine.get_epsilon(delta) == reference.get_epsilon(delta)
    assert mine.get_delta(2.0) == reference.get_delta(2.0)


def test_rdp_curve_cache_holds_4096_events():
    assert event_rdp_curve.cache_info().maxsize == 4096


# -- what a Gaussian ledger imports -------------------------------------------------
_GAUSSIAN_LEDGER = """
import sys
from privacy.accounting import PrivacyLedger, Release
from privacy.events import check_supported
for accountant, neighboring, sampling in (
    ("rdp", "replace-one", "without-replacement"), ("pld", "add-or-remove-one", "none")
):
    check_supported(accountant, neighboring, sampling, "gaussian")
    ledger = PrivacyLedger(accountant=accountant, target_delta=1e-5, max_epsilon=1e6,
                           sampling=sampling)
    ledger.charge(Release(server_round=1, kind="model-update", mechanism="gaussian",
                          noise_multiplier=1.0, sampling=sampling,
                          sample_size=4, population=4))
    assert ledger.epsilon() > 0
print(sorted(m for m in ("privacy.skellam_accounting", "privacy.fast_pld") if m in sys.modules))
"""


def test_a_gaussian_ledger_without_poisson_imports_no_skellam_or_fast_pld_code():
    # A fresh interpreter: this process has imported both modules already.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _GAUSSIAN_LEDGER], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_probe_accountant_is_dp_accountings_own_and_supports_alike():
    from privacy.events import new_accountant
    from privacy.skellam_accounting import SkellamRdpAccountant

    plain = new_accountant("rdp", "replace-one", skellam=False)
    assert type(plain) is RdpAccountant
    assert isinstance(new_accountant("rdp", "replace-one"), SkellamRdpAccountant)
    event = WOR(100, 10, G(1.0))
    assert plain.supports(event) and new_accountant("rdp", "replace-one").supports(event)
    assert not plain.supports(Poisson(0.1, G(1.0)))  # replace-one: no Poisson
