"""Neural Collaborative Filtering with per-user clients (the Subspace-DP-FL study's MovieLens-1M
experiment) on the synthetic ratings: AUC rises above chance.

Made in process (:func:`tests.inprocess.run_like_flwr`: the run `flwr run` makes, the
same ServerApp and ClientApp without the Flower runtime): NCF's messages are model
arrays and metrics, which the digits, finance and PPO `flwr run`s already carry through
the runtime, so a Flower start-up here would test nothing more."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.inprocess import run_like_flwr

pytestmark = pytest.mark.e2e

TINY = (
    "task='movielens' strategy='fedavg' num-server-rounds=3 fraction-train=1.0 "
    "fraction-evaluate=1.0 movielens.synthetic-users=200 movielens.synthetic-items=200 "
    "movielens.lr=0.005 movielens.local-epochs=2 movielens.device='cpu'"
)


def test_ncf_learns_from_per_user_clients(tmp_path):
    result = run_like_flwr(f"{TINY} output-dir='{tmp_path}'")
    assert result.returncode == 0 and result.run_dir is not None, result.output
    metrics = pd.read_csv(result.run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    assert list(central.index) == [0, 1, 2, 3], result.output
    # Untrained NeuMF ranks at chance; three rounds of FedAvg learn the latent structure.
    assert abs(central.loc[0, "eval-auc"] - 0.5) < 0.1
    assert central.loc[3, "eval-auc"] > 0.6
    assert central.loc[3, "eval-auc"] > central.loc[0, "eval-auc"] + 0.1
    federated = metrics[metrics["scope"] == "federated-eval"]
    assert federated["eval-auc"].between(0, 1).all() and len(federated) == 3
