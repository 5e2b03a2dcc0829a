"""μ-GDP, membership-inference bounds and SPI(k) (privacy/certificates.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.stats import norm

from privacy.accounting import PrivacyLedger, Release
from privacy.certificates import (
    gdp_delta,
    gdp_mu_unamplified,
    run_certificates,
    spi,
    tpr_bound_dp,
    tpr_bound_gdp,
)


def _release(z: float, count: int = 1, mechanism: str = "gaussian") -> Release:
    parameter = {"noise_multiplier": z} if mechanism == "gaussian" else {"laplace_epsilon": z}
    return Release(
        server_round=1, kind="model-update", mechanism=mechanism, sampling="poisson",
        sample_size=10, population=100, count=count, **parameter,
    )  # fmt: skip


def test_gdp_delta_hand_computed():
    # μ = 1, ε = 1: Φ(−0.5) − e·Φ(−1.5) = 0.3085375387 − 2.7182818285·0.0668072013.
    assert gdp_delta(1.0, 1.0) == pytest.approx(0.3085375387 - 2.7182818285 * 0.0668072013, 1e-9)
    assert gdp_delta(2.0, 0.0) == pytest.approx(2 * norm.cdf(1.0) - 1, 1e-12)  # TV distance


@pytest.mark.parametrize("sigma", [0.7, 1.0, 3.0])
def test_gdp_delta_matches_dp_accounting_gaussian_pld(sigma):
    # An independent source: dp-accounting's PLD of one Gaussian release (sensitivity 1,
    # std σ), which is exactly (1/σ)-GDP; its pessimistic discretisation may only add.
    # At interval 1e-4 it is within 1e-12 of exact here (1e-5: the same, 10x the CPU).
    pld = pld_lib.from_gaussian_mechanism(sigma, value_discretization_interval=1e-4)
    for epsilon in (0.1, 0.5, 1.0, 2.0):
        exact = gdp_delta(1.0 / sigma, epsilon)
        assert pld.get_delta_for_epsilon(epsilon) == pytest.approx(exact, rel=1e-3, abs=1e-7)


def test_gdp_mu_composes_gaussian_releases_and_refuses_laplace():
    releases = [_release(2.0, count=10), _release(1.0)]
    assert gdp_mu_unamplified(releases) == pytest.approx(math.sqrt(10 / 4 + 1))
    assert gdp_mu_unamplified([]) == 0.0
    assert gdp_mu_unamplified([*releases, _release(0.5, mechanism="laplace")]) is None
    assert gdp_mu_unamplified(releases, unaccounted=True) is None


def test_tpr_bounds_hand_computed():
    assert tpr_bound_gdp(1.0, 0.05) == pytest.approx(norm.cdf(norm.ppf(0.05) + 1.0), 1e-12)
    assert tpr_bound_gdp(1.0, 0.05) == pytest.approx(0.2595110, abs=1e-6)
    assert tpr_bound_gdp(0.0, 0.05) == pytest.approx(0.05)
    # (ε, δ) = (1, 0) at α = 0.1: min(e·0.1, 1 − e^{−1}·0.9) = 0.27183.
    assert tpr_bound_dp(0.1, [(1.0, 0.0)]) == pytest.approx(math.e * 0.1)
    assert tpr_bound_dp(0.5, [(1.0, 0.0)]) == pytest.approx(1 - math.exp(-1) * 0.5)
    assert tpr_bound_dp(0.1, []) == 1.0
    with pytest.raises(ValueError, match="fpr"):
        tpr_bound_gdp(1.0, 1.5)


def test_dp_curve_bound_of_gdp_curve_tends_to_the_gdp_tradeoff():
    # The envelope of the (ε, δ(ε)) bounds of μ-GDP is its trade-off curve (Dong et al.,
    # Prop. 2.12): on a fine grid it lies just above Φ(Φ⁻¹(α) + μ), never below.
    mu = 1.5
    curve = [(e, gdp_delta(mu, e)) for e in np.linspace(0.0, 10.0, 4001)]
    for fpr in (0.001, 0.01, 0.1):
        envelope = tpr_bound_dp(fpr, curve)
        assert tpr_bound_gdp(mu, fpr) <= envelope + 1e-12
        assert envelope == pytest.approx(tpr_bound_gdp(mu, fpr), abs=2e-3)


def test_likelihood_ratio_attack_meets_but_does_not_beat_the_gdp_bound():
    # The optimal attack on one Gaussian release (std σ, sensitivity 1): threshold the
    # output. Its empirical TPR at FPR 0.05 must sit at the bound (within sampling error).
    rng = np.random.default_rng(0)
    sigma, n = 1.25, 400_000
    out_absent, out_present = rng.normal(0, sigma, n), rng.normal(1, sigma, n)
    threshold = np.quantile(out_absent, 0.95)
    tpr = float(np.mean(out_present > threshold))
    bound = tpr_bound_gdp(1 / sigma, 0.05)
    assert tpr <= bound + 5 * math.sqrt(bound * (1 - bound) / n) + 2e-3
    assert tpr == pytest.approx(bound, abs=5e-3)


def test_spi_isotropic_is_k_sigma_squared():
    values = spi([], floor=0.8, dim=1000, noise_multiplier=1.5, ks=(1, 4, 32, 2000))
    assert values == pytest.approx({1: 2.25, 4: 9.0, 32: 72.0})


def test_spi_hand_computed_elliptical():
    # Spectrum {5, 3, 1, 1}: SPI(2) = 1 + 1/5, SPI(4) = 1 + 1/5 + 1/3 + 1/1.
    values = spi([5.0, 3.0], floor=1.0, dim=4, noise_multiplier=1.0, ks=(1, 2, 3, 4))
    assert values == pytest.approx(
        {1: 1.0, 2: 1.2, 3: 1 + 1 / 5 + 1 / 3, 4: 1 + 1 / 5 + 1 / 3 + 1}
    )


def _ratio(p_inv: np.ndarray, basis: np.ndarray) -> float:
    m = basis.T @ p_inv @ basis
    return float(np.trace(m) / np.linalg.eigvalsh(m).max())


def test_spi_is_the_minimum_over_subspaces():
    # Brute force on d = 5: random k-subspaces never beat SPI(k); the coordinate
    # subspaces (the eigenbasis is the identity here) attain it.
    rng = np.random.default_rng(1)
    eig = np.array([9.0, 4.0, 2.5, 1.2, 0.7])
    p_inv = np.diag(1 / eig)
    values = spi(eig, floor=0.1, dim=5, noise_multiplier=1.0, ks=range(1, 6))  # no floor left
    # The floor fills the directions not listed: the same as listing them.
    floored = spi(eig[:3], floor=0.7, dim=5, noise_multiplier=1.0, ks=range(1, 6))
    listed = spi([9.0, 4.0, 2.5, 0.7, 0.7], floor=0.1, dim=5, noise_multiplier=1.0, ks=range(1, 6))
    assert floored == pytest.approx(listed)
    for k in range(1, 6):
        for _ in range(300):
            q, _ = np.linalg.qr(rng.standard_normal((5, k)))
            assert _ratio(p_inv, q) >= values[k] - 1e-9
        best = min(
            _ratio(p_inv, np.eye(5)[:, list(cols)]) for cols in itertools.combinations(range(5), k)
        )
        assert best == pytest.approx(values[k])


def test_run_certificates_from_a_ledger():
    ledger = PrivacyLedger(accountant="pld", target_delta=1e-5, sampling="poisson")
    ledger.charge(_release(1.0, count=20))
    doc = run_certificates(ledger, spi_values={1: 1.0, 2: 2.0}, fprs=(0.01,))
    assert doc["gdp-mu"] == pytest.approx(math.sqrt(20))
    (row,) = doc["mia"]
    # Amplified (q = 0.1) curve is far tighter than the unamplified μ = √20 bound.
    assert row["tpr-bound"] < tpr_bound_gdp(math.sqrt(20), 0.01)
    assert 0.01 <= row["tpr-bound"] <= 1.0
    # ... and still a valid bound: at least what the ledger's own (ε, δ) implies exactly.
    epsilon = ledger.epsilon()
    assert row["tpr-bound"] <= math.exp(epsilon) * 0.01 + 1e-5 + 1e-9
    assert doc["spi"] == {"k": [1, 2], "value": [1.0, 2.0]}
    empty = run_certificates(
        PrivacyLedger(accountant="pld", target_delta=1e-5, sampling="poisson"), spi_values=None
    )
    assert empty["gdp-mu"] == 0.0 and all(r["tpr-bound"] is None for r in empty["mia"])


def test_no_certificate_when_a_release_has_no_client_level_guarantee():
    # DP-SGD records sample-level guarantees only: no client-level mu, never mu = 0.
    sample_level = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="none")
    sample_level.record_local_guarantee(1, client="3", epsilon=2.0, delta=1e-5)
    doc = run_certificates(sample_level, spi_values=None)
    assert doc["gdp-mu"] is None and all(r["tpr-bound"] is None for r in doc["mia"])
    unaccounted = PrivacyLedger(accountant="pld", target_delta=1e-5, sampling="poisson")
    unaccounted.charge(_release(1.0))
    unaccounted.record_unaccounted(2, "clipped-update", "clipping without noise")
    doc = run_certificates(unaccounted, spi_values=None)
    assert doc["gdp-mu"] is None and all(r["tpr-bound"] is None for r in doc["mia"])
    assert "releases without a guarantee (unaccounted)" in doc["notes"][0]


def test_huge_epsilon_gives_a_trivial_bound_without_overflow():
    assert tpr_bound_dp(0.01, [(5000.0, 0.0)]) == pytest.approx(1.0)
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="poisson")
    ledger.charge(_release(0.02, count=30))  # z = 0.02: ε in the thousands
    assert ledger.epsilon() > 700
    doc = run_certificates(ledger, spi_values=None, fprs=(0.01,))
    assert doc["mia"][0]["tpr-bound"] == pytest.approx(1.0)
