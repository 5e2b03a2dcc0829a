"""LocalViewLedger: per-client ε against the server, golden values from dp-accounting."""

from __future__ import annotations

import functools
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant

from privacy.accounting import PrivacyLedger, Release
from privacy.events import AccountingError
from privacy.local_view import LocalViewLedger


def _upload(z: float) -> Release:
    return Release(
        server_round=1,
        kind="noisy-upload",
        mechanism="gaussian",
        noise_multiplier=z,
        sampling="none",
        sample_size=1,
        population=1,
    )


def _laplace(epsilon: float) -> Release:
    return Release(
        server_round=1,
        kind="noisy-upload",
        mechanism="laplace",
        laplace_epsilon=epsilon,
        sampling="none",
        sample_size=1,
        population=1,
    )


@functools.cache  # 2.5 s at the golden z (a wide PLD): once for both accountants
def _gaussian_epsilon(z: float, count: int) -> float:
    """dp-accounting directly: ``count`` unsampled GaussianDpEvent(z) under PLD (its
    pessimistic discretisation: an upper bound within ~1e-3 of the exact value)."""
    fresh = pld_privacy_accountant.PLDAccountant()
    fresh.compose(dp_accounting.GaussianDpEvent(z), count)
    return fresh.get_epsilon(1e-5)


def _exact(z: float, count: int) -> float:
    """The exact ε (dp-accounting's analytic Gaussian privacy loss, inverted here by
    bisection, independently of the code under test)."""
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(z / math.sqrt(count), sensitivity=1.0)
    low, high = 0.0, 1e4
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if loss.get_delta_for_epsilon(mid) > 1e-5 else (low, mid)
    return high


@pytest.mark.xdist_group("local-view-golden")  # one worker: the reference once
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_client_noise_against_the_server_golden(accountant):
    # The example: client-side noise z = 1, m = 10, fixed-size sampling
    # (replace-one): each upload carries multiplier z / (2 sqrt(m)) against the server.
    z = 1.0 / (2 * math.sqrt(10))
    view = LocalViewLedger(accountant=accountant, target_delta=1e-5, neighboring="replace-one")
    view.charge(["partition-0"], _upload(z))
    one = view.epsilon("partition-0")
    assert one == pytest.approx(46.2112, abs=1e-3)  # dp-accounting's PLD: 46.21121
    assert one == pytest.approx(_gaussian_epsilon(z, 1), abs=1e-6)
    assert one == pytest.approx(_exact(z, 1), abs=1e-6)
    for _ in range(29):
        view.charge(["partition-0", "partition-1"], _upload(z))
    # Thirty participations: PLD says 747.74 (pessimistic), the exact value is 746.80.
    assert view.epsilon("partition-0") == pytest.approx(_exact(z, 30), abs=1e-6)
    assert 746.7 < view.epsilon("partition-0") <= 747.74
    assert view.epsilon("partition-1") == pytest.approx(_exact(z, 29), abs=1e-6)
    assert view.worst() == ("partition-0", view.epsilon("partition-0"))
    assert view.participations("partition-1") == 29
    assert view.neighboring == "replace-one"


def test_never_asked_client_has_zero_and_charge_all_reaches_everyone():
    view = LocalViewLedger(accountant="rdp", target_delta=1e-5, neighboring="add-or-remove-one")
    assert view.epsilon("partition-9") == 0.0
    assert view.worst() == (None, 0.0)
    view.charge(["partition-0"], _upload(2.0))
    view.charge_all(_upload(2.0))  # a resumed run: the interrupted round, for everyone
    assert view.participations("partition-0") == 2
    assert view.participations("partition-9") == 1  # not seen yet, charged all the same
    assert view.epsilon("partition-9") == pytest.approx(_exact(2.0, 1), abs=1e-6)
    assert view.epsilon("partition-0") == pytest.approx(_exact(2.0, 2), abs=1e-6)


def test_laplace_uploads_compose_to_the_smaller_of_basic_and_accountant():
    view = LocalViewLedger(
        accountant="rdp", target_delta=1e-5, neighboring="zero-out", mechanisms=("laplace",)
    )
    assert view.neighboring == "zero-out"
    view.charge(["a"], _laplace(10.0))
    assert view.epsilon("a") == 10.0  # RDP alone says 10.0028
    for _ in range(99):
        view.charge(["a"], _laplace(0.1))
    fresh = rdp_privacy_accountant.RdpAccountant()
    fresh.compose(dp_accounting.LaplaceDpEvent(0.1))
    fresh.compose(dp_accounting.LaplaceDpEvent(10.0), 99)
    assert view.epsilon("a") == pytest.approx(min(10 + 9.9, fresh.get_epsilon(1e-5)))


def test_would_exceed_is_the_same_for_every_client():
    z = 2.0
    budget = (_exact(z, 3) + _exact(z, 4)) / 2
    view = LocalViewLedger(
        accountant="rdp", target_delta=1e-5, neighboring="add-or-remove-one", max_epsilon=budget
    )
    assert not view.would_exceed(_upload(z))
    for _ in range(3):
        view.charge(["busy"], _upload(z))
    view.charge(["idle"], _upload(z))
    assert view.would_exceed(_upload(z))  # "busy" would reach 4 uploads
    unlimited = LocalViewLedger(accountant="rdp", target_delta=1e-5, neighboring="replace-one")
    assert not unlimited.would_exceed(_upload(1e-3))


def test_state_round_trips_and_rejects_garbage():
    view = LocalViewLedger(accountant="pld", target_delta=1e-5, neighboring="add-or-remove-one")
    view.charge(["a", "b"], _upload(1.5))
    view.charge(["a"], _upload(0.8))
    view.charge_all(_upload(1.5))
    again = LocalViewLedger(accountant="pld", target_delta=1e-5, neighboring="add-or-remove-one")
    again.load_state_dict(view.state_dict())
    assert again.worst() == view.worst()
    assert again.epsilon("b") == view.epsilon("b")
    with pytest.raises(AccountingError, match="local-view"):
        again.load_state_dict({"schema": "other"})
    bad = view.state_dict() | {"clients": {"a": [-1]}}
    with pytest.raises(AccountingError, match="counts"):
        again.load_state_dict(bad)


def test_sampled_releases_are_refused():
    view = LocalViewLedger(accountant="rdp", target_delta=1e-5, neighboring="replace-one")
    sampled = Release(
        server_round=1,
        kind="x",
        mechanism="gaussian",
        noise_multiplier=1.0,
        sampling="without-replacement",
        sample_size=1,
        population=10,
    )
    with pytest.raises(AccountingError, match="knows whom it asked"):
        view.charge(["a"], sampled)


def test_ledger_reports_min_of_basic_composition_and_accountant_for_laplace():
    # dp-accounting's RDP gives 10.0028 for one Laplace release of epsilon 10: the
    # ledger reports 10, the pure bound, and says which one it took.
    ledger = PrivacyLedger(
        accountant="rdp", target_delta=1e-5, sampling="none", mechanisms=("laplace",)
    )
    ledger.charge(_laplace(10.0))
    assert ledger.accountant_epsilon() > 10.0
    assert ledger.epsilon() == 10.0
    assert ledger.basic_composition_epsilon() == 10.0
    assert any("basic composition" in s and "smaller" in s for s in ledger.summary()["statements"])
    # Many small releases: the accountant is tighter than T * epsilon.
    ledger = PrivacyLedger(
        accountant="pld", target_delta=1e-5, sampling="none", mechanisms=("laplace",)
    )
    ledger.charge(Release(**{**_laplace(0.1).__dict__, "count": 400}))
    assert ledger.epsilon() == ledger.accountant_epsilon() < 40.0


def test_noise_from_seed_is_stated_first():
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="none")
    ledger.noise_from_seed = True
    ledger.charge(_upload(1.0))
    summary = ledger.summary()
    assert summary["noise-from-seed"] is True
    assert summary["statements"][0].startswith("NO EPSILON HOLDS against anyone who knows")


def test_zero_out_is_dp_accountings_replace_special_without_amplification():
    # Laplace (local noise) is accounted under zero-out: a client's update replaced by
    # zero while it still takes part. dp-accounting calls it REPLACE_SPECIAL.
    ledger = PrivacyLedger(
        accountant="pld",
        target_delta=1e-5,
        sampling="none",
        neighboring="zero-out",
        mechanisms=("laplace",),
    )
    release = Release(**{**_laplace(0.5).__dict__, "population": 10})
    ledger.charge(Release(**{**release.__dict__, "count": 20}))
    reference = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    reference.compose(dp_accounting.LaplaceDpEvent(2.0), 20)
    assert ledger.accountant_epsilon() == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    assert ledger.summary()["neighboring-relation"] == "zero-out"
    # Sampling is never amplified under zero-out: with local noise an unsampled client
    # (no noise term) is not a zeroed-out one (strategies.mechanisms.laplace's docstring).
    for sampling, accountant in (("poisson", "pld"), ("without-replacement", "rdp")):
        with pytest.raises(AccountingError, match="neighboring in"):
            PrivacyLedger(
                accountant=accountant,
                target_delta=1e-5,
                sampling=sampling,
                neighboring="zero-out",
            )
