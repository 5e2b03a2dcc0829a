"""`flwr run` of hierarchical FL (frontloaded-dp-hfl) on digits: 4 SuperNodes in 2 edges, every
client mode (baseline, CG-NG, CG-NP, CP-NP), 2 cloud rounds of 2 edge aggregations.

Every mode is made in process (:func:`tests.inprocess.run_like_flwr`: the same
ServerApp and ClientApp without the Flower runtime): hierarchical FL's messages are
model arrays, configs and metrics, which the digits, finance and PPO `flwr run`s already
carry through the runtime, so a Flower start-up here would test nothing more."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from server_app.results import load_metrics
from tests.inprocess import run_like_flwr

pytestmark = pytest.mark.e2e

TINY = (
    "task='digits' strategy='hierarchical' num-server-rounds=2 fraction-evaluate=1.0 "
    "hier.num-edges=2 hier.edge-rounds=2 hier.local-updates=5 hier.client-fraction=0.5 "
    "dp.clip-norm=2.0 dp.noise-std=0.01 vision.lr=0.1"
)
MODES = ("none", "cg-ng", "cg-np", "cp-np")


@pytest.fixture(scope="module")
def hier_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hier-runs")
    runs = {}
    for mode in MODES:
        result = run_like_flwr(f"{TINY} privacy='{mode}' output-dir='{root}'")
        assert result.returncode == 0 and result.run_dir is not None, result.output
        runs[mode] = result
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_cloud_and_edge_models_are_evaluated(hier_runs, mode):
    run_dir = hier_runs[mode].run_dir
    metrics = load_metrics(run_dir)  # under DP the per-edge counts are the curator's
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    assert list(central.index) == [0, 1, 2], hier_runs[mode].output
    assert central.loc[2, ["edge-0-eval-accuracy", "edge-1-eval-accuracy"]].notna().all()
    train = metrics[metrics["scope"] == "train"].set_index("round")
    assert (train["edge-0-clients"] == 2).all() and (train["edge-1-clients"] == 2).all()
    assert (run_dir / "tensorboard").is_dir()


def _tables(run_dir, mode):
    """Who took part is the curator's under a privacy mechanism."""
    return run_dir if mode == "none" else run_dir / "curator"


@pytest.mark.parametrize("mode", MODES)
def test_every_edge_aggregation_is_recorded(hier_runs, mode):
    tables = _tables(hier_runs[mode].run_dir, mode)
    assert (hier_runs[mode].run_dir / "edges.csv").exists() == (mode == "none")
    edges = pd.read_csv(tables / "edges.csv")
    # 2 cloud rounds x 2 edge aggregations x 2 edges x 1 sampled client (cfrac 0.5 of 2)
    assert len(edges) == 8 and edges["replied-ok"].all()
    assert sorted(edges.groupby(["round", "edge-round"]).size().tolist()) == [2, 2, 2, 2]
    # edges are contiguous blocks of partition ids: 0, 1 -> edge 0; 2, 3 -> edge 1
    assert (edges["edge-id"] == edges["partition-id"] // 2).all()
    members = pd.read_csv(tables / "edge-membership.csv")
    assert sorted(members["partition-id"]) == [0, 1, 2, 3]
    assert (members["edge-id"] == members["partition-id"] // 2).all()


def test_baseline_learns(hier_runs):
    metrics = pd.read_csv(hier_runs["none"].run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    assert central.loc[2, "eval-accuracy"] > central.loc[0, "eval-accuracy"] + 0.2


def test_cp_np_is_accounted_per_edge_aggregation(hier_runs):
    result = hier_runs["cp-np"]
    ledger = json.loads((result.run_dir / "ledger.json").read_text())
    releases = ledger["state"]["releases"]
    assert sum(r["count"] for r in releases) == 4  # 2 cloud rounds x 2 edge aggregations
    assert {r["kind"] for r in releases} == {"edge-aggregation"}
    # z = sigma / C, halved: sampling without replacement counts replace-one neighbours
    assert all(r["noise_multiplier"] == pytest.approx(0.01 / 2.0 / 2) for r in releases)
    epsilon = ledger["summary"]["epsilon"]
    assert epsilon > 0 and ledger["summary"]["unaccounted"] == []
    metrics = pd.read_csv(result.run_dir / "metrics.csv")
    train = metrics[metrics["scope"] == "train"]
    # Both are sound bounds (the edge view holds for every observer); at this tiny
    # sigma dp-accounting's without-replacement amplification bound is the looser one.
    assert (train["dp-epsilon-edge-view"] > 0).all() and (train["dp-epsilon"] > 0).all()
    assert train["dp-epsilon"].is_monotonic_increasing
    # only the noisy delta leaves a CP-NP client: edges average unweighted, and the
    # example count is sent as 1
    replied = pd.read_csv(result.run_dir / "curator" / "participation.csv")
    assert set(replied.columns) == {"round", "node-id", "replied", "error", "num-examples"}
    assert (replied["num-examples"] == 1).all()


@pytest.mark.parametrize("mode", ["cg-ng", "cg-np"])
def test_per_batch_modes_claim_no_guarantee(hier_runs, mode):
    ledger = json.loads((hier_runs[mode].run_dir / "ledger.json").read_text())
    assert ledger["state"]["releases"] == []
    assert len(ledger["summary"]["unaccounted"]) == 2  # one per cloud round
    assert "no formal privacy guarantee" in hier_runs[mode].output
