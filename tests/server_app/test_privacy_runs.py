"""Each privacy mechanism's run on digits as `flwr run` makes it, in this process
(:func:`tests.inprocess.run_like_flwr`): epsilon per round in metrics.csv, ledger.json
that reloads to the same epsilon, the final privacy summary, and what each mechanism
adds. ``tests/e2e/test_privacy_runs.py`` runs the mechanisms the Flower runtime takes
part in (the audit's canary SuperNodes, SecAgg+) through `flwr run` itself, with the
checks of :func:`check_epsilon_grows_and_reloads`."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from privacy.accounting import PrivacyLedger
from server_app.results import load_metrics
from tests.inprocess import run_like_flwr

# One worker makes the runs once (a module-scoped fixture per worker otherwise).
pytestmark = [
    pytest.mark.xdist_group("privacy-runs"),
    pytest.mark.usefixtures("learning_curve_not_rendered"),
]

# Mechanics with noise that may swamp 4 clients: no divergence ratio check (it is
# tested in tests/server_app/test_failure_policy.py).
TINY = (
    "num-server-rounds=3 fraction-train=1.0 vision.local-epochs=1 vision.momentum=0.0 "
    "run.divergence-factor=0.0"
)
DPSGD_TARGET = 1.0
RUNS = {
    "dp-fedavg-adaptive": "dp.num-sampled-clients=3 dp.noise-multiplier=1.0 "
    "dp.noise-site='client' dp.sampling='fixed' dp.clip-count-stddev=1.0 dp.clip-norm=0.5",
    "laplace": "dp.sensitivity=1.0 dp.epsilon=30.0 dp.sampling='fixed'",
    # A low target: DP-SGD's calibration and accounting cost less at the larger z it
    # gives (a run: 15 s of CPU at epsilon 5, 4 s at epsilon 1).
    "dp-sgd": f"dp.target-epsilon={DPSGD_TARGET} dp.clip-norm=1.0",
    # Head-only after a 2-epoch warm start on the public split; PMU in rounds 1 and 3;
    # the public U split by the fairness program over two label groups; 8-bit updates.
    # Poisson cohorts of 3 expected of 4: a round samples nobody with probability
    # 0.25^4. z = 1: these are mechanics, and a PLD event costs more as z falls (here
    # 18 s at z = 0.1, 2 s at z = 0.5).
    "subspace-dp": "dp.num-sampled-clients=3 dp.noise-multiplier=1.0 dp.clip-norm=0.5 "
    "subspace.head-only=true subspace.warm-start=2 subspace.rank=2 subspace.sketch-dim=8 "
    "subspace.pmu-every=2 subspace.init='public' subspace.allocation='fairness' "
    "vision.grouping='low-high' subspace.quantize-bits=8",
}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-runs")
    runs = {}
    for privacy, options in RUNS.items():
        result = run_like_flwr(f"{TINY} privacy='{privacy}' {options} output-dir='{root}'")
        runs[privacy] = finished(result)
    return runs


def finished(result):
    """(the run, its metrics with curator/metrics.csv's raw diagnostics, ledger.json) of
    a run that completed."""
    assert result.returncode == 0 and result.run_dir is not None, result.output
    return (
        result,
        load_metrics(result.run_dir),
        json.loads((result.run_dir / "ledger.json").read_text()),
    )


def check_epsilon_grows_and_reloads(result, metrics, ledger_doc) -> None:
    """A client-level epsilon in every one of 3 rounds, growing; ledger.json reloads to
    the last; the summary prints it."""
    train = metrics[metrics["scope"] == "train"].set_index("round")
    assert list(train.index) == [1, 2, 3], result.output
    epsilon = train["dp-epsilon"].to_numpy()
    assert (epsilon > 0).all() and (epsilon[1:] > epsilon[:-1]).all()
    ledger = PrivacyLedger.from_state_dict(ledger_doc["state"])
    assert len(ledger.releases) == 3
    assert ledger.epsilon() == pytest.approx(epsilon[-1], rel=1e-9)
    assert f"(epsilon, delta) = ({epsilon[-1]:.4f}, 1e-05)" in result.output


@pytest.mark.parametrize("privacy", ["dp-fedavg-adaptive", "laplace", "subspace-dp"])
def test_client_level_epsilon_grows_and_reloads(dp_runs, privacy):
    check_epsilon_grows_and_reloads(*dp_runs[privacy])


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
    assert 0 < worst <= DPSGD_TARGET


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
    # Over the rounds whose Poisson cohort was not empty (who took part: the curator's).
    taking_part = pd.read_csv(result.run_dir / "curator" / "participation.csv")
    with_updates = sorted(set(taking_part.loc[taking_part["replied"], "round"]))
    errors = train["subspace-quant-error"].dropna()
    assert list(errors.index) == with_updates and (errors > 0).all()
    ledger = PrivacyLedger.from_state_dict(ledger_doc["state"])
    assert all("top-up" in r.note for r in ledger.releases)
    doc = json.loads((result.run_dir / "certificates.json").read_text())
    mu = gdp_mu_unamplified(ledger.releases)
    assert doc["gdp-mu"] == pytest.approx(mu)
    for row in doc["mia"]:
        assert row["fpr"] < row["tpr-bound"] <= tpr_bound_gdp(mu, row["fpr"]) + 1e-12
    assert doc["spi"]["k"][0] == 1 and "Certificates:" in result.output
