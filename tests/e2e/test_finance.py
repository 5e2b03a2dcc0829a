"""`flwr run` of the tabular regression task (the SmartFedProx study) on 4 SuperNodes: SmartFedProx
with hybrid selection after a one-round cold start, the same under DP-FedAvg with
adaptive clipping (noised divergence reports), FedAvg with FedBN layers, and FedAvg
with sample-level DP-SGD on the LayerNorm MLP.

Every variant is made in process (:func:`tests.inprocess.run_like_flwr`: the same
ServerApp and ClientApp without the Flower runtime): the finance task's messages are model
arrays, configs and metrics (DP-SGD's per-client guarantee among them), which the
digits, privacy and PPO `flwr run`s already carry through the runtime, so a Flower
start-up here would test nothing more."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from tasks.finance import FinanceTask
from tests.inprocess import run_like_flwr

pytestmark = pytest.mark.e2e

TINY = (
    "task='finance' num-server-rounds=4 fraction-train=0.75 fraction-evaluate=1.0 "
    "finance.synthetic-rows=3000 finance.local-epochs=2 finance.partitioning='label-skew' "
    "finance.device='cpu'"
)
VARIANTS = {
    "smart": "strategy='smart-fedprox' fedprox.mu=0.1 smart.cold-start-rounds=1 "
    "smart.exploration-rate=0.0",
    "fedbn": "strategy='fedavg' finance.bn='local'",
    "smart-dp": "strategy='smart-fedprox' fedprox.mu=0.1 smart.cold-start-rounds=1 "
    "smart.exploration-rate=0.0 privacy='dp-fedavg-adaptive' dp.num-sampled-clients=3 "
    "dp.noise-multiplier=0.3",
    "dpsgd": "strategy='fedavg' privacy='dp-sgd' dp.noise-multiplier=1.0",
}
LEARNS = ("smart", "fedbn")


@pytest.fixture(scope="module")
def finance_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("finance-runs")
    runs = {}
    for name, options in VARIANTS.items():
        result = run_like_flwr(f"{TINY} {options} output-dir='{root}'")
        assert result.returncode == 0 and result.run_dir is not None, result.output
        runs[name] = result
    return runs


def _scope(run_dir, scope):
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics[metrics["scope"] == scope].set_index("round")


@pytest.mark.parametrize("name", LEARNS)
def test_global_model_learns_the_regression(finance_runs, name):
    result = finance_runs[name]
    central = _scope(result.run_dir, "central-eval")
    assert list(central.index) == [0, 1, 2, 3, 4], result.output
    assert central.loc[4, "eval-r2"] > central.loc[0, "eval-r2"] + 0.3
    federated = _scope(result.run_dir, "federated-eval")
    assert federated["eval-r2"].notna().all()
    assert "Data: synthetic (seed 42, 3000 rows)" in result.output


def test_smart_fedprox_selects_by_divergence_after_the_cold_start(finance_runs):
    run_dir = finance_runs["smart"].run_dir
    selection = pd.read_csv(run_dir / "selection.csv")
    modes = selection.groupby("round")["mode"].unique()
    assert list(modes.loc[1]) == ["cold-start"]
    assert all(list(modes.loc[r]) == ["hybrid"] for r in (2, 3, 4))
    assert selection.groupby("round").size().tolist() == [3, 3, 3, 3]
    assert selection["replied-ok"].all()
    participation = pd.read_csv(run_dir / "participation.csv")
    assert participation["replied"].all() and len(participation) == 12
    # Adaptive mu: clients whose EMA differs from the mean train with another mu.
    later = participation[participation["round"] > 1]
    assert later["effective-mu"].nunique() > 1
    assert (later["effective-mu"] != 0.1 * 1.1).any()  # base x epoch factor alone
    train = _scope(run_dir, "train")
    assert train["divergence"].gt(0).all()


def test_fedbn_run_still_uploads_batchnorm_for_central_eval(finance_runs):
    run_dir = finance_runs["fedbn"].run_dir
    names = FinanceTask({"finance.bn": "local"}).local_state_keys()
    model = torch.load(run_dir / "model.pt")
    assert set(names) <= set(model)  # still uploaded and averaged, for central eval
    participation = pd.read_csv(run_dir / "participation.csv")
    assert participation["replied"].all()


def test_private_smart_fedprox_selects_from_noised_reports_and_charges_them(finance_runs):
    result = finance_runs["smart-dp"]
    run_dir = result.run_dir
    selection = pd.read_csv(run_dir / "curator" / "selection.csv")  # per client: curator
    modes = selection.groupby("round")["mode"].unique()
    assert list(modes.loc[1]) == ["cold-start"] and list(modes.loc[4]) == ["hybrid"]
    assert selection.groupby("round").size().tolist() == [3, 3, 3, 3]
    assert selection["train-loss"].isna().all()  # clients sent no loss under DP
    ledger = json.loads((run_dir / "ledger.json").read_text())
    releases = ledger["state"]["releases"]
    kinds = [r["kind"] for r in releases]
    assert kinds.count("divergence-report") == 4
    assert kinds.count("model-update+clip-count") == 4
    assert all(r["sampling"] == "none" for r in releases)
    central = _scope(run_dir, "central-eval")
    # Four rounds of 3 clients with no amplification are not enough to learn (the
    # comparison in BENCHMARKS.md measures utility); the released model is evaluated.
    assert list(central.index) == [0, 1, 2, 3, 4]
    assert central["eval-r2"].notna().all()
    assert "no amplification claimed" in result.output


def test_dp_sgd_trains_the_layernorm_mlp_and_reports_sample_level_epsilon(finance_runs):
    result = finance_runs["dpsgd"]
    model = torch.load(result.run_dir / "model.pt")
    assert not any("running_mean" in key for key in model)  # LayerNorm: no BN buffers
    ledger = json.loads((result.run_dir / "ledger.json").read_text())
    guarantees = ledger["state"]["local_guarantees"]
    assert guarantees and all(0 < g["epsilon"] < 100 for g in guarantees)
    sample = next(t for t in ledger["threat-models"] if t["threat-model"] == "trusted-server")
    assert sample["holds"] and sample["unit"] == "sample-level"
    central = _scope(result.run_dir, "central-eval")
    assert central.loc[4, "eval-r2"] > central.loc[0, "eval-r2"] + 0.2
