"""The published local ε: a client asked in every round, whoever was sampled.

Golden values from dp-accounting's analytic Gaussian privacy loss: k unsampled Gaussian
uploads at multiplier z compose into one Gaussian at z / sqrt(k)."""

from __future__ import annotations

import pytest

from privacy.events import AccountingError
from privacy.local_view import LocalViewLedger
from tests.privacy.test_local_view import _exact, _upload


def _view(**kw) -> LocalViewLedger:
    return LocalViewLedger(
        accountant="rdp", target_delta=1e-5, neighboring="add-or-remove-one", **kw
    )


def test_the_bound_counts_rounds_not_who_was_asked():
    z = 2.0
    one, other = _view(), _view()
    for clients in (["a"], ["b"], ["a"]):  # the worst client was asked twice
        one.charge(clients, _upload(z))
    for clients in (["a"], ["a"], ["a"]):  # ... three times
        other.charge(clients, _upload(z))
    assert one.worst()[1] == pytest.approx(_exact(z, 2), rel=1e-6)
    assert other.worst()[1] == pytest.approx(_exact(z, 3), rel=1e-6)
    assert one.bound() == other.bound() == pytest.approx(_exact(z, 3), rel=1e-6)
    empty = _view()
    empty.charge([], _upload(z))  # a round that asked nobody still counts
    assert empty.bound() == pytest.approx(_exact(z, 1), rel=1e-6) and empty.worst()[1] == 0.0
    one.charge_all(_upload(z))  # a resumed round: every client
    assert one.bound() == pytest.approx(_exact(z, 4), rel=1e-6)


def test_the_budget_reads_the_bound_so_its_stop_ignores_the_sample():
    z = 2.0
    budget = (_exact(z, 2) + _exact(z, 3)) / 2
    view = _view(max_epsilon=budget)
    view.charge(["a"], _upload(z))
    view.charge(["b"], _upload(z))  # nobody was asked twice, yet a third round could be
    assert view.would_exceed(_upload(z))
    assert view.summary()["bound"] == view.bound() and view.summary()["participations"] == 1


def test_the_rounds_round_trip_and_a_client_never_exceeds_them():
    view = _view()
    view.charge(["a", "b"], _upload(1.5))
    view.charge(["a"], _upload(1.5))
    again = _view()
    again.load_state_dict(view.state_dict())
    assert again.bound() == view.bound() and again.worst() == view.worst()
    with pytest.raises(AccountingError, match="exceeds the rounds"):
        again.load_state_dict(view.state_dict() | {"clients": {"a": [3]}})
    with pytest.raises(AccountingError, match="malformed"):
        again.load_state_dict({k: v for k, v in view.state_dict().items() if k != "rounds"})
