"""certificates.json's note when a run has no mu-GDP statement names the actual reason
(a distributed-DP run releases with Skellam noise and has a client-level epsilon)."""

from types import SimpleNamespace

from privacy.certificates import _no_gdp_reason, gdp_mu_unamplified


def _ledger(*mechanisms, unaccounted=(), local=()):
    releases = [SimpleNamespace(mechanism=m, count=1, noise_multiplier=1.0) for m in mechanisms]
    return SimpleNamespace(releases=releases, unaccounted=unaccounted, local_guarantees=local)


def test_a_skellam_run_is_told_apart_from_a_run_without_client_level_guarantee():
    skellam = _ledger("skellam", "skellam")
    assert gdp_mu_unamplified(skellam.releases) is None
    assert _no_gdp_reason(skellam) == (
        "mu-GDP is derived for Gaussian releases only, and this run released with skellam "
        "noise; the ledger's (epsilon, delta) holds as stated."
    )
    assert "laplace and skellam" in _no_gdp_reason(_ledger("gaussian", "skellam", "laplace"))
    assert "client-reported" in _no_gdp_reason(_ledger("gaussian", local=("dp-sgd",)))
    assert "unaccounted" in _no_gdp_reason(_ledger("gaussian", unaccounted=("x",)))
