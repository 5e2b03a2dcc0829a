"""`flwr run` on digits for the privacy mechanisms the Flower runtime takes part in: the
audit's canary SuperNodes beside the real ones, and SecAgg+ in the Ray simulation. Both
runs are made on the suite's two-node Ray cluster (``tests/e2e/conftest.py``'s
:func:`cluster_run`, one Ray start-up for both). epsilon per round in metrics.csv,
ledger.json that reloads to the same epsilon, the final privacy summary. The audited run
is also made by the in-process engine, which must give its ledger
(``tests/e2e/test_engine_parity.py`` compares the plain run). The other mechanisms'
runs, with the same checks, are made in process: ``tests/server_app/test_privacy_runs.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lab import engine
from tests.e2e.conftest import AUDITED, AUDITED_FEDERATION
from tests.server_app.test_privacy_runs import TINY, check_epsilon_grows_and_reloads, finished

pytestmark = pytest.mark.e2e

# The audited DP-FedAvg run (tests/e2e/conftest.py, AUDITED: z calibrated to epsilon 8,
# Poisson sampling, Adam, 4 canaries beside the 4 real clients) and the distributed DP
# run (SECAGG: SecAgg+ in the Ray simulation, Skellam shares from the clients).
FIXED = "dp-fedavg-fixed"
SECAGG = "dp-fedavg-fixed+secagg"


@pytest.fixture(scope="module")
def dp_runs(cluster_run):
    return {FIXED: finished(cluster_run.audited), SECAGG: finished(cluster_run.run)}


@pytest.fixture(scope="module")
def engine_fixed(dp_runs, tmp_path_factory):
    """The audited DP-FedAvg run's config made by the in-process engine (8 nodes, one
    torch thread each as Ray gives each ClientApp): its run directory."""
    root = tmp_path_factory.mktemp("dp-engine")
    ours = engine.run(
        f"{TINY} {AUDITED} output-dir='{root}'",
        engine.Federation.parse(AUDITED_FEDERATION),
    )
    assert ours.returncode == 0 and ours.run_dir is not None, ours.error
    assert engine.engine_of(ours.run_dir) == "inprocess"
    return ours.run_dir


@pytest.mark.parametrize("privacy", [FIXED, SECAGG])
def test_client_level_epsilon_grows_and_reloads(dp_runs, privacy):
    check_epsilon_grows_and_reloads(*dp_runs[privacy])


def test_secure_aggregation_gives_an_epsilon_against_the_server(dp_runs):
    result, _, ledger_doc = dp_runs[SECAGG]
    for server_round in (1, 2, 3):
        assert f"SecAgg+ round {server_round}: sum of 3 of 3" in result.output
    models = {m["threat-model"]: m for m in ledger_doc["threat-models"]}
    epsilon = ledger_doc["summary"]["epsilon"]
    assert models["honest-but-curious-server"]["epsilon"] == pytest.approx(epsilon)
    assert {r["mechanism"] for r in ledger_doc["state"]["releases"]} == {"skellam"}


def test_target_epsilon_is_met_with_poisson_sampling_and_adam(dp_runs):
    result, metrics, ledger_doc = dp_runs[FIXED]
    calibration = ledger_doc["calibration"]
    assert calibration["parameter"] == "dp.noise-multiplier" and calibration["value"] > 0
    assert f"noise multiplier z = {calibration['value']:.4f} meets epsilon 8" in result.output
    summary = ledger_doc["summary"]
    assert (summary["sampling"], summary["accountant"]) == ("poisson", "pld")
    assert summary["neighboring-relation"] == "add-or-remove-one"
    epsilon = metrics[metrics["scope"] == "train"]["dp-epsilon"].to_numpy()
    assert len(epsilon) == 3 and 0.98 * 8.0 <= epsilon[-1] <= 8.0
    assert any("server optimizer adam" in s for s in summary["statements"])
    central = metrics[metrics["scope"] == "central-eval"]["eval-loss"].to_numpy()
    assert np.isfinite(central).all()


def test_the_audit_runs_beside_the_ledger(dp_runs):
    """Canary clients of a real federation: audit.json, the plot, the summary line and
    the ledger's record. 4 canaries can bound epsilon by 0 at most, and at the run seed
    (42) 3 are inserted and 1 held out: too few for an estimate, which audit.json says."""
    result, _, ledger_doc = dp_runs[FIXED]
    audit = json.loads((result.run_dir / "audit.json").read_text())
    assert audit["canaries"] == 4 and audit["dimension"] > 0
    assert len(audit["cosines_inserted"]) + len(audit["cosines_held_out"]) == 4
    assert audit["accountant_epsilon"] == pytest.approx(ledger_doc["summary"]["epsilon"])
    assert 0.0 <= audit["epsilon_lower_bound"] <= audit["epsilon_lower_bound_max"]
    assert not audit["exceeds_accountant"]
    assert audit["inserted"] == 3 and audit["epsilon_estimate"] is None
    assert any("no estimate" in note for note in audit["notes"])
    assert (result.run_dir / "plots" / "audit.png").stat().st_size > 0
    assert ledger_doc["audit"]["canaries"] == 4
    assert "Audit (4 canaries" in result.output
    # The real clients split the data 4 ways: the start-up check counted the canaries.
    assert "Federation: 8 nodes, num-partitions = 8 (4 of them the audit's canaries" in (
        result.output
    )


def test_the_engine_gives_the_flwr_runs_ledger(dp_runs, engine_fixed):
    """Secret noise, so not the model: the releases (each an event: mechanism, noise,
    sampling, round, in charge order), the noise calibrated to the target, epsilon."""
    result, _, expected = dp_runs[FIXED]
    assert engine.engine_of(result.run_dir) == "flwr"
    got = json.loads((engine_fixed / "ledger.json").read_text())
    assert got["state"] == expected["state"]
    assert got["summary"]["epsilon"] == expected["summary"]["epsilon"] <= 8.0
    assert got["calibration"] == expected["calibration"]
    assert got["calibration"]["accountant"] == "pld"
    assert got["calibration"]["population"] == 8  # the canaries are sampled too
    assert got["summary"]["num-releases"] == expected["summary"]["num-releases"] == 3
    # The same canaries inserted and held out (drawn from the run seed)
    audit = json.loads((engine_fixed / "audit.json").read_text())
    assert audit["canaries"] == 4 and audit["inserted"] == 3
