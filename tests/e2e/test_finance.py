"""`flwr run` of the tabular regression task (seed 001) on 4 SuperNodes: SmartFedProx
with hybrid selection after a one-round cold start, and FedAvg with FedBN layers."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from tasks.finance import FinanceTask

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
}


@pytest.fixture(scope="module")
def finance_runs(flower, tmp_path_factory):
    root = tmp_path_factory.mktemp("finance-runs")
    runs = {}
    for name, options in VARIANTS.items():
        result = flower.run(f"{TINY} {options} output-dir='{root}'")
        assert result.returncode == 0 and result.run_dir is not None, result.output
        runs[name] = result
    return runs


def _scope(run_dir, scope):
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics[metrics["scope"] == scope].set_index("round")


@pytest.mark.parametrize("name", list(VARIANTS))
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
