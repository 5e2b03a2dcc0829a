"""`flwr run` on digits for each privacy mechanism: epsilon per round in metrics.csv,
ledger.json that reloads to the same epsilon, and the final privacy summary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from privacy.accounting import PrivacyLedger
from server_app.results import load_metrics

pytestmark = pytest.mark.e2e

# Mechanics with noise that may swamp 4 clients: no divergence ratio check (it is
# tested in tests/server_app/test_failure_policy.py).
TINY = (
    "num-server-rounds=3 fraction-train=1.0 train.local-epochs=1 train.momentum=0.0 "
    "run.divergence-factor=0.0"
)
VARIANTS = {
    # Mechanics, not utility: with 3 of 4 clients, noise that gives a useful epsilon
    # swamps the updates (README, "Privacy"). Here the DP that learns: Poisson sampling
    # (the default), z calibrated to a target epsilon over the run, Adam on the
    # released aggregate, the small MLP.
    # With the privacy audit: 4 canary clients beside the 4 real ones (FEDERATION).
    "dp-fedavg-fixed": "dp.target-epsilon=8.0 dp.num-sampled-clients=3 "
    "server.optimizer='adam' server.lr=0.05 model.name='mlp' audit.canaries=4",
    "dp-fedavg-adaptive": "dp.num-sampled-clients=3 dp.noise-multiplier=0.1 "
    "dp.noise-site='client' dp.sampling='fixed' dp.clip-count-stddev=1.0 dp.clip-norm=0.5",
    "laplace": "dp.sensitivity=1.0 dp.epsilon=30.0 dp.sampling='fixed'",
    "dp-sgd": "dp.target-epsilon=5.0 dp.clip-norm=1.0",
    # Head-only after a 2-epoch warm start on the public split; PMU in rounds 1 and 3;
    # the public U split by the fairness program over two label groups; 8-bit updates.
    "subspace-dp": "dp.num-sampled-clients=3 dp.noise-multiplier=0.1 dp.clip-norm=0.5 "
    "subspace.head-only=true subspace.warm-start=2 subspace.rank=2 subspace.sketch-dim=8 "
    "subspace.pmu-every=2 subspace.init='public' subspace.allocation='fairness' "
    "data.groups='low-high' subspace.quantize-bits=8",
    # Distributed DP: SecAgg+ in the Ray simulation, Skellam shares from the clients.
    "dp-fedavg-fixed+secagg": "secagg.enabled=true dp.noise-site='client' "
    "dp.sampling='fixed' dp.num-sampled-clients=3 dp.noise-multiplier=1.0 "
    "dp.clip-norm=0.5 model.name='mlp'",
}
RUNS = {name: f"privacy='{name.split('+')[0]}' {o}" for name, o in VARIANTS.items()}
# N = 4 real clients + k = 4 canaries; naming the size replaces all of the connection's
# options, so the CPUs per ClientApp are named too (else Flower's default of 2: one at a time)
FEDERATION = {"dp-fedavg-fixed": "num-supernodes=8 client-resources-num-cpus=1"}


@pytest.fixture(scope="module")
def dp_runs(flower, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-runs")
    runs = {}
    for privacy, options in RUNS.items():
        result = flower.run(
            f"{TINY} {options} output-dir='{root}'",
            federation_config=FEDERATION.get(privacy, ""),
        )
        assert result.returncode == 0 and result.run_dir is not None, result.output
        runs[privacy] = (
            result,
            load_metrics(result.run_dir),  # with curator/metrics.csv (raw diagnostics)
            json.loads((result.run_dir / "ledger.json").read_text()),
        )
    return runs


@pytest.mark.parametrize(
    "privacy",
    ["dp-fedavg-fixed", "dp-fedavg-adaptive", "laplace", "subspace-dp", "dp-fedavg-fixed+secagg"],
)
def test_client_level_epsilon_grows_and_reloads(dp_runs, privacy):
    result, metrics, ledger_doc = dp_runs[privacy]
    train = metrics[metrics["scope"] == "train"].set_index("round")
    assert list(train.index) == [1, 2, 3], result.output
    epsilon = train["dp-epsilon"].to_numpy()
    assert (epsilon > 0).all() and (epsilon[1:] > epsilon[:-1]).all()
    ledger = PrivacyLedger.from_state_dict(ledger_doc["state"])
    assert len(ledger.releases) == 3
    assert ledger.epsilon() == pytest.approx(epsilon[-1], rel=1e-9)
    assert f"(epsilon, delta) = ({epsilon[-1]:.4f}, 1e-05)" in result.output


def test_secure_aggregation_gives_an_epsilon_against_the_server(dp_runs):
    result, _, ledger_doc = dp_runs["dp-fedavg-fixed+secagg"]
    for server_round in (1, 2, 3):
        assert f"SecAgg+ round {server_round}: sum of 3 of 3" in result.output
    models = {m["threat-model"]: m for m in ledger_doc["threat-models"]}
    epsilon = ledger_doc["summary"]["epsilon"]
    assert models["honest-but-curious-server"]["epsilon"] == pytest.approx(epsilon)
    assert {r["mechanism"] for r in ledger_doc["state"]["releases"]} == {"skellam"}


def test_adaptive_clip_norm_moves(dp_runs):
    _, metrics, _ = dp_runs["dp-fedavg-adaptive"]
    clip = metrics[metrics["scope"] == "train"]["dp-clip-norm"].to_numpy()
    assert clip[0] == 0.5 and len(set(clip)) == 3


def test_laplace_reports_basic_composition_beside_the_accountant(dp_runs):
    _, metrics, ledger_doc = dp_runs["laplace"]
    ledger = PrivacyLedger.from_state_dict(ledger_doc["state"])
    assert ledger.basic_composition_epsilon() == pytest.approx(3 * 30.0)
    assert ledger.epsilon() == min(ledger.accountant_epsilon(), 90.0)
    # Against the server: each client's own rounds (here every client, every round).
    train = metrics[metrics["scope"] == "train"]
    assert train["dp-epsilon-local"].iloc[-1] == pytest.approx(ledger.epsilon())


def test_dp_sgd_records_sample_level_guarantees_only(dp_runs):
    result, metrics, ledger_doc = dp_runs["dp-sgd"]
    train = metrics[metrics["scope"] == "train"]
    assert (train["local-epsilon"] > 0).all()
    assert train["local-epsilon"].is_monotonic_increasing
    ledger = PrivacyLedger.from_state_dict(ledger_doc["state"])
    assert ledger.releases == () and len(ledger.local_guarantees) == 3 * 4
    assert "no client-level guarantee" in result.output.lower()


def test_dp_sgd_target_epsilon_holds(dp_runs):
    _, _, ledger_doc = dp_runs["dp-sgd"]
    worst = max(g["epsilon"] for g in ledger_doc["summary"]["local-guarantees"])
    assert 0 < worst <= 5.0


def test_subspace_dp_head_only_charges_pmu_and_keeps_the_body(dp_runs):
    """The ledger charges the PMU rounds (1 and 3) with the update; only the head moved
    away from the warm-started model the server saved (``warm-start.pt``)."""
    import torch

    from tasks.vision.task import DigitsTask

    result, metrics, ledger_doc = dp_runs["subspace-dp"]
    kinds = [r["kind"] for r in ledger_doc["state"]["releases"]]
    assert kinds == ["model-update+pmu-sketch", "model-update", "model-update+pmu-sketch"]
    train = metrics[metrics["scope"] == "train"].set_index("round")
    assert train["subspace-pmu-adopted"].notna().tolist() == [True, False, True]
    warm = json.loads((result.run_dir / "warm-start.json").read_text())
    assert warm["warm-start-accuracy"] > 0.3  # 2 epochs on 180 images; chance is 0.1
    config = json.loads((result.run_dir / "config.json").read_text())["run-config"]
    head = set(DigitsTask(config).head_keys())
    start = torch.load(result.run_dir / "warm-start.pt")
    final = torch.load(result.run_dir / "model.pt")
    assert head and head < set(start)
    for key, value in start.items():
        if key in head:
            assert not torch.equal(final[key], value), key
        else:
            assert torch.equal(final[key], value), key


def test_subspace_dp_part2_fairness_quantization_and_certificates(dp_runs):
    """Group metrics, the fairness allocation, 8-bit quantization charged at its Gaussian
    top-up, and certificates.json consistent with the ledger."""
    from privacy.certificates import gdp_mu_unamplified, tpr_bound_gdp

    result, metrics, ledger_doc = dp_runs["subspace-dp"]
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    low, high = central["eval-accuracy-low"], central["eval-accuracy-high"]
    assert ((central["fairness-gap"] - (low - high).abs()).abs() < 1e-12).all()
    assert "subspace-dp: fairness allocation, group distortions low" in result.output
    train = metrics[metrics["scope"] == "train"].set_index("round")
    bits = train["subspace-quant-bits-per-update"]
    assert bits.nunique() == 1 and bits.iloc[0] % 8 == 0 and bits.iloc[0] > 0
    assert (train["subspace-quant-error"] > 0).all()
    ledger = PrivacyLedger.from_state_dict(ledger_doc["state"])
    assert all("top-up" in r.note for r in ledger.releases)
    doc = json.loads((result.run_dir / "certificates.json").read_text())
    mu = gdp_mu_unamplified(ledger.releases)
    assert doc["gdp-mu"] == pytest.approx(mu)
    for row in doc["mia"]:
        assert row["fpr"] < row["tpr-bound"] <= tpr_bound_gdp(mu, row["fpr"]) + 1e-12
    assert doc["spi"]["k"][0] == 1 and "Certificates:" in result.output


def test_target_epsilon_is_met_with_poisson_sampling_and_adam(dp_runs):
    result, metrics, ledger_doc = dp_runs["dp-fedavg-fixed"]
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
    result, _, ledger_doc = dp_runs["dp-fedavg-fixed"]
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
