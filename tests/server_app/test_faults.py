"""A SuperNode dies mid-run: what every strategy does, with the real ClientApp in process.

Node 33 (partition 2) receives its round-2 train message and dies: it never replies and
leaves the node list, as a SuperNode whose heartbeat stops. Non-private strategies go on
with the survivors; DP-FedAvg (fixed, adaptive, subspace) and Laplace count it as a
zero update and release and charge the round like any other (an aborted round would
be an uncharged, possibly data-dependent release); the hierarchical strategy's edge
aggregates the clients it still has (CP-NP: the lost one as a noised zero delta). Every
run finishes all its rounds, and the missing reply is logged with the round timeout.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pytest

from server_app.failures import RunFailed
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
DEAD, DIES_IN = 33, 2
# Seed 3 samples node DEAD in round DIES_IN under each DP wrapper (checked below): with
# dp.reproducible-noise the DP sample derives from the run seed; fixed-size, so 3 of 4 each round.
DP = {
    "dp.sampling": "fixed",
    "dp.num-sampled-clients": 3,
    "dp.noise-multiplier": 1.0,
    "dp.clip-norm": 0.5,
    "seed": 3,
    "dp.reproducible-noise": True,
}


def _run(tmp_path: Path, **overrides) -> tuple[Path, InProcessGrid]:
    # Every round waits for all 4 nodes, up to a 1 s round timeout, then goes on.
    base = {"output-dir": str(tmp_path), "fraction-train": 1.0, "min-available-nodes": 4}
    base["round-timeout"] = 1.0
    config = run_config(**base, **overrides)
    grid = InProcessGrid(config, NODES)
    grid.dies_in_round[DEAD] = DIES_IN
    run_server(config, grid)
    (path,) = list(tmp_path.iterdir())
    return path, grid


def _train_sent_to(grid: InProcessGrid, node: int) -> list[int]:
    return [
        int(m.content["config"]["server-round"])
        for m in grid.sent
        if m.metadata.message_type == "train" and m.metadata.dst_node_id == node
    ]


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("fedavg", {}),
        ("fedprox", {}),
        ("smart-fedprox", {"smart.cold-start-rounds": 1}),
        ("clustered", {"cluster.k": 2}),
    ],
)
def test_flat_strategies_go_on_with_the_survivors(strategy, extra, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    path, grid = _run(tmp_path, strategy=strategy, **extra)
    metrics = pd.read_csv(path / "metrics.csv")
    assert set(metrics.loc[metrics["scope"] == "train", "round"]) == {1, 2, 3}
    assert (path / "model.pt").exists()
    rows = pd.read_csv(path / "participation.csv")
    dead = rows[rows["node-id"] == DEAD].set_index("round")
    assert dead.loc[DIES_IN, "error"] == "no reply"
    assert not dead.loc[DIES_IN, "replied"]
    assert max(_train_sent_to(grid, DEAD)) == DIES_IN  # not sampled once gone
    survivors = rows[(rows["round"] == DIES_IN) & rows["replied"]]
    assert sorted(survivors["node-id"]) == [11, 22, 44]
    assert f"round {DIES_IN} train: 1 of 4 node(s) sent no reply within 'round-timeout'" in (
        caplog.text
    )
    assert "fewer than 'min-available-nodes' = 4: the round goes on with them" in caplog.text


@pytest.mark.parametrize(
    ("privacy", "extra"),
    [
        ("dp-fedavg-fixed", {}),
        ("dp-fedavg-adaptive", {}),
        ("subspace-dp", {"subspace.rank": 2, "subspace.sketch-dim": 8}),
    ],
)
def test_dp_fedavg_counts_the_dead_client_as_zero_and_charges_every_round(
    privacy, extra, tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    # 4 nodes, 3 sampled per round: after the death exactly 3 are left to sample.
    path, grid = _run(tmp_path, privacy=privacy, **DP, **extra)
    assert DIES_IN in _train_sent_to(grid, DEAD)
    ledger = json.loads((path / "ledger.json").read_text())["state"]
    assert sorted(r["server_round"] for r in ledger["releases"]) == [1, 2, 3]
    assert f"node {DEAD} counts as a zero update: no reply" in caplog.text
    assert "aborted" not in caplog.text
    metrics = pd.read_csv(path / "metrics.csv")
    assert set(metrics.loc[metrics["scope"] == "train", "round"]) == {1, 2, 3}
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    assert central.loc[DIES_IN, "eval-loss"] != central.loc[1, "eval-loss"]  # released
    # Who failed is the curator's record, not a released column.
    assert "dp-failed-clients" not in metrics.columns
    curator = pd.read_csv(path / "curator" / "metrics.csv")
    failed = curator[curator["scope"] == "train"].set_index("round")["dp-failed-clients"]
    assert failed.loc[DIES_IN] == 1.0


def test_laplace_counts_only_the_missing_client_as_zero(tmp_path):
    # Noise small enough that the model stays finite.
    # dp.sampling = "fixed": the wrapped FedAvg samples (here every node).
    laplace = {"dp.sensitivity": 1.0, "dp.epsilon": 100.0, "dp.sampling": "fixed"}
    path, _ = _run(tmp_path, privacy="laplace", **laplace)
    ledger = json.loads((path / "ledger.json").read_text())["state"]
    assert sorted(r["server_round"] for r in ledger["releases"]) == [1, 2, 3]
    rows = pd.read_csv(path / "curator" / "participation.csv")
    assert rows.loc[rows["round"] == 3, "node-id"].tolist() == [11, 22, 44]
    assert not (path / "participation.csv").exists()  # who was sampled: curator only


@pytest.mark.parametrize("privacy", ["none", "cp-np"])
def test_hierarchical_edge_goes_on_without_its_lost_client(privacy, tmp_path):
    # With every client sampled, node 33's edge loses it in round 2 (both edge rounds:
    # the node list is read once per cloud round) and aggregates its other client.
    path, _ = _run(
        tmp_path,
        strategy="hierarchical",
        privacy=privacy,
        **{"hier.client-fraction": 1.0, "hier.edge-rounds": 2},
    )
    tables = path / "curator" if privacy != "none" else path
    edges = pd.read_csv(tables / "edges.csv")
    lost = edges[(edges["round"] == DIES_IN) & (edges["node-id"] == DEAD)]
    assert len(lost) == 2 and not lost["replied-ok"].any()
    edge = lost["edge-id"].iloc[0]
    kept = edges[(edges["round"] == DIES_IN) & (edges["edge-id"] == edge) & edges["replied-ok"]]
    assert len(kept) == 2 and DEAD not in set(kept["node-id"])  # one survivor, two edge rounds
    later = edges[edges["round"] == 3]
    assert DEAD not in set(later["node-id"])
    assert set(later["edge-id"]) == {0, 1}
    metrics = pd.read_csv(path / "metrics.csv")
    assert set(metrics.loc[metrics["scope"] == "train", "round"]) == {1, 2, 3}
    assert {p.name for p in (path / "checkpoint").glob("edge-*.pt")} == {"edge-0.pt", "edge-1.pt"}
    if privacy != "none":
        ledger = json.loads((path / "ledger.json").read_text())["state"]
        assert {r["server_round"] for r in ledger["releases"]} == {1, 2, 3}


@pytest.mark.parametrize("strategy", ["fedavg", "smart-fedprox", "clustered"])
def test_too_few_survivors_end_the_run_after_the_timeout(strategy, tmp_path, caplog):
    # Every round needs all 4 clients: after the death the run stops, it does not hang.
    caplog.set_level(logging.WARNING)
    with pytest.raises(RunFailed, match=r"3 node\(s\) connected within 'round-timeout' = 1 s"):
        _run(tmp_path, strategy=strategy, **{"min-train-nodes": 4})
    assert "Stopping before round 3: 3 node(s) connected within 'round-timeout' = 1 s" in (
        caplog.text
    )
    (path,) = list(tmp_path.iterdir())
    metrics = pd.read_csv(path / "metrics.csv")
    assert set(metrics.loc[metrics["scope"] == "train", "round"]) == {1, 2}
    outcome = json.loads((path / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["last-round"] == 2
    assert "the round needs at least 4" in outcome["reason"]
    assert outcome["checkpoint"] == str(path / "checkpoint" / "global.pt")
    assert not (path / "model.pt").exists()  # a failed run leaves its last good checkpoint
