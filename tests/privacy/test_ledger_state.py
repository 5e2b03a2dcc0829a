"""Ledger serialisation (exact JSON round trip, validated loading) and the summary:
unaccounted releases and local guarantees are recorded but never enter ε."""

from __future__ import annotations

import copy
import json

import pytest

from privacy.accounting import AccountingError, PrivacyLedger, Release


def _ledger(accountant="rdp", sampling="poisson", **kw) -> PrivacyLedger:
    return PrivacyLedger(
        accountant=accountant,
        target_delta=1e-5,
        sampling=sampling,
        mechanisms=("gaussian", "laplace")
        if sampling == "none" or accountant == "pld"
        else ("gaussian",),
        **kw,
    )


def _filled(accountant="rdp", sampling="poisson") -> PrivacyLedger:
    # PLD rebuilds its distribution whenever the budget is checked: keep that to RDP here.
    ledger = _ledger(accountant, sampling, max_epsilon=50.0 if accountant == "rdp" else None)
    for rnd in range(1, 6):
        ledger.charge(
            [
                Release(
                    server_round=rnd,
                    kind="model-update",
                    mechanism="gaussian",
                    noise_multiplier=1.1 + (rnd % 2) / 10,
                    sampling=sampling,
                    sample_size=7,
                    population=70,
                    note="z varies",
                ),
                Release(
                    server_round=rnd,
                    kind="adaptive-clip-count",
                    mechanism="gaussian",
                    noise_multiplier=5.0,
                    sampling=sampling,
                    sample_size=7,
                    population=70,
                ),
            ]
        )
    if sampling == "none" or accountant == "pld":
        ledger.charge(
            Release(
                server_round=6,
                kind="sketch",
                mechanism="laplace",
                laplace_epsilon=0.3,
                sampling=sampling,
                sample_size=7,
                population=70,
                count=2,
            )
        )
    ledger.record_unaccounted(
        3, "per-batch-clip", "clipping without noise", {"clip": 1.0, "batches": (1, 2)}
    )
    ledger.record_local_guarantee(4, client="node-3", epsilon=2.5, delta=1e-6)
    return ledger


@pytest.mark.parametrize(
    "accountant,sampling", [("rdp", "poisson"), ("rdp", "none"), ("pld", "poisson")]
)
def test_json_round_trip_is_exact(accountant, sampling):
    ledger = _filled(accountant, sampling)
    text = json.dumps(ledger.state_dict())
    loaded = PrivacyLedger.from_state_dict(json.loads(text))
    assert loaded.state_dict() == json.loads(text)
    assert json.dumps(loaded.state_dict()) == text
    assert loaded.releases == ledger.releases
    assert loaded.epsilon() == ledger.epsilon()  # replayed: bit-identical
    assert loaded.epsilon(1e-8) == ledger.epsilon(1e-8)
    assert loaded.unaccounted == ledger.unaccounted
    assert loaded.local_guarantees == ledger.local_guarantees
    assert loaded.config == ledger.config


def test_load_state_dict_resumes_without_double_charging():
    ledger = _filled()
    resumed = _ledger(max_epsilon=50.0)
    resumed.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert resumed.epsilon() == ledger.epsilon() and len(resumed.releases) == 10
    with pytest.raises(AccountingError, match=r"max_epsilon: saved 50\.0, current 8\.0"):
        _ledger(max_epsilon=8.0).load_state_dict(ledger.state_dict())
    with pytest.raises(AccountingError, match="accountant: saved 'rdp', current 'pld'"):
        _ledger("pld", max_epsilon=50.0).load_state_dict(ledger.state_dict())


def _corrupt(state, path, value):
    state = copy.deepcopy(state)
    target = state
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("schema_version",), 2, "version"),
        (("schema",), "other", "unsupported ledger state"),
        (("releases",), KeyError, "exactly the keys"),
        (("extra",), 1, "exactly the keys"),
        (("config", "accountant"), "moments", "accountant must be one of"),
        (("config", "neighboring"), "add-or-remove-one", "neighboring='add-or-remove-one'"),
        (("config", "target_delta"), 1.5, "target_delta"),
        (("config", "rdp_orders"), [], "rdp_orders must not be empty"),
        (("config", "rdp_orders"), [0.5, 2.0], "RDP order"),
        (("config", "sampling"), KeyError, "config must have the keys"),
        (("releases", 0, "noise_multiplier"), -1.0, r"releases\[0\].*must be > 0"),
        (("releases", 1, "sample_size"), 700, "exceeds population"),
        (("releases", 1, "count"), True, "count"),
        (("releases", 2, "laplace_epsilon"), 1.0, "not laplace_epsilon"),
        (("releases", 0, "sampling"), "poisson", "accounts sampling='without-replacement'"),
        (("releases", 0, "bogus"), 1, "not a valid Release"),
        (("releases",), {"a": 1}, "must be a list"),
        (("unaccounted", 0, "reason"), "", "reason must be a non-empty"),
        (("local_guarantees", 0, "delta"), 2.0, "delta"),
    ],
)
def test_corrupted_or_mismatched_state_raises(path, value, match):
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="without-replacement")
    for rnd in range(1, 4):
        ledger.charge(
            Release(
                server_round=rnd,
                kind="model-update",
                mechanism="gaussian",
                noise_multiplier=1.0,
                sampling="without-replacement",
                sample_size=7,
                population=70,
            )
        )
    ledger.record_unaccounted(1, "per-batch-clip", "no noise")
    ledger.record_local_guarantee(1, client="a", epsilon=1.0, delta=1e-5)
    state = json.loads(json.dumps(ledger.state_dict()))
    with pytest.raises(AccountingError, match=match):
        PrivacyLedger.from_state_dict(_corrupt(state, path, value))


def test_unaccounted_and_local_guarantees_never_enter_epsilon():
    ledger = _ledger()
    ledger.charge(
        Release(
            server_round=1,
            kind="model-update",
            mechanism="gaussian",
            noise_multiplier=1.0,
            sampling="poisson",
            sample_size=7,
            population=70,
        )
    )
    epsilon = ledger.epsilon()
    entry = ledger.record_unaccounted(
        2, "per-batch-clip", "clipping without noise: no DP", {"clip": 1.0, "batches": (1, 2)}
    )
    ledger.record_local_guarantee(2, client="node-1", epsilon=3.0, delta=1e-6)
    assert ledger.epsilon() == epsilon and len(ledger.releases) == 1
    assert entry.details == {"clip": 1.0, "batches": [1, 2]}  # as the JSON file holds it
    summary = json.loads(json.dumps(ledger.summary()))
    assert summary["epsilon"] == epsilon
    assert summary["unaccounted"][0]["kind"] == "per-batch-clip"
    assert summary["local-guarantees"] == [
        {
            "server_round": 2,
            "client": "node-1",
            "epsilon": 3.0,
            "delta": 1e-6,
            "unit": "sample-level",
        }
    ]
    text = " ".join(summary["statements"])
    assert "NOT COVERED" in text and "does not cover them" in text
    assert "not part of the client-level epsilon" in text
    with pytest.raises(AccountingError, match="JSON-serialisable"):
        ledger.record_unaccounted(3, "x", "y", {"bad": object()})
    with pytest.raises(AccountingError, match="epsilon"):
        ledger.record_local_guarantee(3, client="a", epsilon=-1.0, delta=0.0)


def test_summary_counts_by_kind_and_reports_basic_composition():
    ledger = _filled("rdp", "none")
    summary = ledger.summary()
    assert summary["releases-by-kind"] == {
        "model-update": 5,
        "adaptive-clip-count": 5,
        "sketch": 2,
    }
    assert summary["num-releases"] == 12
    assert summary["basic-composition-epsilon"] is None  # Gaussian releases present
    assert (summary["accountant"], summary["sampling"], summary["neighboring-relation"]) == (
        "rdp",
        "none",
        "add-or-remove-one",
    )
    assert summary["target-delta"] == 1e-5 and summary["max-epsilon"] == 50.0
    laplace = _ledger("rdp", "none")
    laplace.charge(
        Release(
            server_round=1,
            kind="model-update",
            mechanism="laplace",
            laplace_epsilon=0.5,
            sampling="none",
            sample_size=3,
            population=9,
            count=4,
        )
    )
    assert laplace.summary()["basic-composition-epsilon"] == 2.0
    assert any(
        "basic composition gives pure epsilon = 2" in s for s in laplace.summary()["statements"]
    )
    assert _ledger().summary()["epsilon"] == 0.0


def test_summary_has_no_epsilon_when_only_unaccounted_releases_happened():
    ledger = _ledger()
    ledger.record_unaccounted(1, kind="cg-ng edge models", reason="per-batch clipping")

    summary = ledger.summary()

    assert summary["epsilon"] is None and summary["basic-composition-epsilon"] is None
    assert summary["statements"][0].startswith("No client-level guarantee")
    assert _ledger().summary()["epsilon"] == 0.0  # nothing released: nothing charged
