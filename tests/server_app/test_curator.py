"""The run directory separates what the ε covers from what it does not (``curator/``),
clients send only what the mechanism needs, and the ledger names who each ε holds
against. The real ServerApp and ClientApp in one process (:mod:`tests.inprocess`)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from config.settings import RunOptions
from strategies.mechanisms import threat_models
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
CLIENT_NOISE = {
    "privacy": "dp-fedavg-fixed",
    "dp.noise-site": "client",
    "dp.sampling": "fixed",
    "dp.num-sampled-clients": 3,
    "dp.clip-norm": 0.1,
    "dp.noise-multiplier": 1.0,
}


def _run(tmp_path: Path, **overrides) -> Path:
    # One round: the layout, the columns and the threat-model report are there after it.
    config = run_config(**{"output-dir": str(tmp_path), "num-server-rounds": 1, **overrides})
    run_server(config, InProcessGrid(config, NODES))
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return path


def test_a_dp_run_publishes_only_what_epsilon_covers(tmp_path):
    path = _run(tmp_path, **CLIENT_NOISE)
    top = {p.name for p in path.glob("*.csv")}
    assert top == {"metrics.csv"}
    assert {p.name for p in (path / "curator").glob("*.csv")} == {
        "metrics.csv",
        "participation.csv",
    }
    metrics = pd.read_csv(path / "metrics.csv")
    train = metrics[metrics["scope"] == "train"].dropna(axis=1, how="all")
    assert set(train.columns) == {
        "round",
        "scope",
        "dp-clip-norm",
        "dp-epsilon",
        "dp-epsilon-local",
        "dp-noise-from-seed",
    }
    assert set(metrics["scope"]) == {"train", "central-eval"}  # no federated evaluation
    assert "elapsed-s" not in metrics.columns  # timing depends on the clients' data
    curator = pd.read_csv(path / "curator" / "metrics.csv")
    assert {"elapsed-s", "round-seconds", "dp-failed-clients"} <= set(curator.columns)
    # Clients sent nothing but what the mechanism needs: no loss, no divergence.
    assert "train-loss" not in curator.columns and "divergence" not in curator.columns
    assert set(pd.read_csv(path / "curator" / "participation.csv")["num-examples"]) == {1}

    ledger = json.loads((path / "ledger.json").read_text())
    layout = ledger["run-directory"]
    assert "metrics.csv" in layout["covered-by-epsilon"]
    assert "curator/" in layout["not-covered"]
    assert layout["secret"] == ["checkpoint/server.pt (DP generator state; owner-only)"]
    report = {e["threat-model"]: e for e in ledger["threat-models"]}
    assert report["trusted-server"]["epsilon"] == pytest.approx(train["dp-epsilon"].iloc[-1])
    assert report["local"]["epsilon"] == pytest.approx(train["dp-epsilon-local"].iloc[-1])
    # Who was asked most depends on the secret sample: the curator's, not ledger.json's.
    assert "worst-client" not in report["local"]
    view = json.loads((path / "curator" / "local-view.json").read_text())
    assert view["worst-client"].startswith("partition-")
    assert view["bound"] == pytest.approx(train["dp-epsilon-local"].iloc[-1])
    assert report["honest-but-curious-server"]["holds"]


def test_client_metrics_on_request_go_to_the_curator(tmp_path):
    path = _run(tmp_path, **CLIENT_NOISE, **{"dp.client-metrics": True})
    metrics = pd.read_csv(path / "metrics.csv")
    assert "federated-eval" not in set(metrics["scope"]) and "train-loss" not in metrics
    curator = pd.read_csv(path / "curator" / "metrics.csv")
    assert "federated-eval" in set(curator["scope"])
    assert "train-loss" in curator.columns and "eval-accuracy" in curator.columns


def test_a_run_without_privacy_keeps_one_layout(tmp_path):
    path = _run(tmp_path)
    assert not (path / "curator").exists()
    assert {p.name for p in path.glob("*.csv")} == {"metrics.csv", "participation.csv"}
    metrics = pd.read_csv(path / "metrics.csv")
    assert {"train", "federated-eval", "central-eval"} == set(metrics["scope"])
    assert {"elapsed-s", "train-loss"} <= set(metrics.columns)


@pytest.mark.parametrize(
    ("privacy", "extra", "holds"),
    [
        ("dp-fedavg-fixed", {"dp.num-sampled-clients": 3}, (True, False, False)),
        (
            "dp-fedavg-adaptive",
            {"dp.num-sampled-clients": 3, "dp.noise-site": "client", "dp.sampling": "fixed"},
            (True, False, False),
        ),
        # Fixed sampling: an empty Poisson cohort (0.25^4) would leave no local epsilon.
        ("laplace", {"dp.num-sampled-clients": 3, "dp.sampling": "fixed"}, (True, True, True)),
        # z = 3: DP-SGD's accounting costs less as z grows (the mechanics are the same).
        ("dp-sgd", {"dp.noise-multiplier": 3.0}, (True, True, True)),
    ],
)
def test_every_epsilon_names_who_it_holds_against(privacy, extra, holds, tmp_path):
    path = _run(tmp_path, privacy=privacy, **extra)
    report = json.loads((path / "ledger.json").read_text())["threat-models"]
    assert [e["threat-model"] for e in report] == list(threat_models.THREAT_MODELS)
    assert tuple(e["holds"] for e in report) == holds
    for entry in report:
        if entry["holds"]:
            assert entry["epsilon"] > 0 and entry["delta"] == 1e-5
        else:
            assert entry["basis"].startswith("none: ")
    if privacy == "dp-sgd":
        assert {e["unit"] for e in report} == {"sample-level"}


def test_every_privacy_value_has_a_threat_model_row():
    from server_app.config import TOP_LEVEL

    (privacy,) = [o for o in TOP_LEVEL if o.key == "privacy"]
    for value in privacy.choices:
        for options in ({}, {"dp.noise-site": "client"}, {"dp.per-example": True}):
            if value == "cg-ng" or not options.get("dp.per-example"):
                assert threat_models.row_for(value, RunOptions(options)).privacy == value
