"""δ(ε) at many ε in one pass (PrivacyLedger.delta_curve, privacy.fast_pld.delta_curve).

RDP's curve is ``compute_delta``'s bit for bit. PLD's is a proven upper bound on the
PMF's exact hockey-stick divergence, so it may exceed dp-accounting's per-point value
(itself rounded) by the rounding error of a sum, never fall below it.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from privacy.accounting import AccountingError, PrivacyLedger, Release
from privacy.certificates import ledger_curve, run_certificates, tpr_bound_dp
from privacy.composition import delta_curve_of
from privacy.fast_pld import delta_curve

GRID = [0.0, 1e-3, 0.01, 0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0]


def _release(mechanism: str = "gaussian", sampling: str = "poisson", count: int = 1) -> Release:
    parameter = {"noise_multiplier": 1.0} if mechanism == "gaussian" else {"laplace_epsilon": 0.5}
    return Release(
        server_round=1, kind="model-update", mechanism=mechanism, sampling=sampling,
        sample_size=10, population=100, count=count, **parameter,
    )  # fmt: skip


def _ledger(accountant: str, sampling: str = "poisson", **kw) -> PrivacyLedger:
    return PrivacyLedger(accountant=accountant, target_delta=1e-5, sampling=sampling, **kw)


def test_hand_computed_pmf():
    # Losses 0, 0.5, 1.0 with masses 0.5, 0.3, 0.15 and 0.05 at infinity.
    pmf = pld_pmf.DensePLDPmf(0.5, 0, np.array([0.5, 0.3, 0.15]), 0.05, True)
    curve = delta_curve(pmf, [0.0, 0.25, 0.5, 1.0, 2.0])
    want = [
        0.05 + 0.3 * (1 - math.exp(-0.5)) + 0.15 * (1 - math.exp(-1.0)),
        0.05 + 0.3 * (1 - math.exp(-0.25)) + 0.15 * (1 - math.exp(-0.75)),
        0.05 + 0.15 * (1 - math.exp(-0.5)),
        0.05,
        0.05,
    ]
    assert np.all(curve >= want)
    np.testing.assert_allclose(curve, want, rtol=1e-14, atol=0)


def test_unsorted_or_infinite_epsilons_are_refused():
    pmf = pld_pmf.DensePLDPmf(0.5, 0, np.array([0.5, 0.5]), 0.0, True)
    with pytest.raises(ValueError, match="ascending"):
        delta_curve(pmf, [1.0, 0.5])
    with pytest.raises(ValueError, match="finite"):
        delta_curve(pmf, [0.0, math.inf])
    ledger = _ledger("rdp")
    ledger.charge(_release())
    with pytest.raises(AccountingError, match="ascending"):
        ledger.delta_curve([1.0, 0.5])
    with pytest.raises(AccountingError, match="epsilon must be finite and >= 0"):
        ledger.delta_curve([-1.0])


@pytest.mark.parametrize(
    ("sampling", "mechanism", "discretization"),
    [
        ("poisson", "gaussian", 1e-4),  # the app's grid: asymmetric (remove, add) PLD
        ("none", "gaussian", 1e-3),
        ("poisson", "laplace", 1e-3),
        ("none", "laplace", 1e-3),
    ],
)
def test_pld_curve_bounds_the_per_point_values_from_above_within_1e_12(
    sampling, mechanism, discretization
):
    ledger = _ledger("pld", sampling, mechanisms=(mechanism,), pld_discretization=discretization)
    ledger.charge(_release(mechanism, sampling, count=3))
    curve = np.array(ledger.delta_curve(GRID))
    per_point = np.array([ledger.delta_for(e) for e in GRID])
    assert np.all(curve >= per_point)
    assert np.all(curve - per_point <= 1e-12 * per_point + 1e-14)
    assert per_point[0] > 1e-2 and per_point[-1] < 1e-6  # the grid spans the curve


@pytest.mark.parametrize("sampling", ["poisson", "none", "without-replacement"])
def test_rdp_curve_is_compute_delta_bit_for_bit(sampling):
    ledger = _ledger("rdp", sampling)
    ledger.charge(_release(sampling=sampling, count=30))
    ledger.charge(_release(sampling=sampling))
    assert ledger.delta_curve(GRID) == [ledger.delta_for(e) for e in GRID]


def test_an_accountant_fallback_is_read_point_by_point():
    accountant = PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE, 1e-3)
    accountant.compose(dp_accounting.RandomizedResponseDpEvent(0.5, 3), 2)
    got = delta_curve_of(accountant, GRID)
    assert got.tolist() == [accountant.get_delta(e) for e in GRID]


def test_empty_ledger_curve_is_zero():
    assert _ledger("pld").delta_curve([0.0, 1.0]) == [0.0, 0.0]


def test_certificates_read_the_same_curve_as_delta_for():
    ledger = _ledger("pld", pld_discretization=1e-3)
    ledger.charge(_release(count=20))
    curve = ledger_curve(ledger, 2.0 * ledger.epsilon() + 1.0)
    assert len(curve) == 201 and curve[0][0] == 0.0
    per_point = [(e, ledger.delta_for(e)) for e, _ in curve]
    for (_, got), (_, want) in zip(curve, per_point, strict=True):
        assert want <= got <= want + 1e-12 * want + 1e-14
    doc = run_certificates(ledger, spi_values=None)
    for row in doc["mia"]:
        assert row["tpr-bound"] == pytest.approx(tpr_bound_dp(row["fpr"], per_point), abs=1e-12)
