"""Checkpoint and ``resume-from``: a run killed after round k and resumed ends exactly
where the uninterrupted run ends.

Each case runs the ServerApp against the real ClientApp in this process
(:mod:`tests.inprocess`) three times: uninterrupted; killed while it checkpoints round 2
(its metrics of round 2 are on disk, its checkpoint is still round 1's: the hardest
moment); and resumed from that directory with new node ids, as a new Flower run gets.
The resumed run must leave the same final model bit for bit, the same ledger (no
double charge, no lost round), the same metrics with no gap or duplicate round, and
the same per-client tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from server_app.results import TIMING_COLUMNS, RunDirectory
from tasks.options import ConfigError
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33, 44]
NEW_NODES = [505, 606, 707, 808]  # a new run: new ids, same partitions
KILLED_AT = 2

DP = {"dp.num-sampled-clients": 2, "dp.noise-multiplier": 0.3, "dp.clip-norm": 0.5}
CASES = {
    "fedavg": ("fedavg", "none", {"fraction-train": 0.5}),
    "fedprox": ("fedprox", "none", {}),
    "local": ("local", "none", {}),
    "clustered": ("clustered", "none", {"cluster.k": 2}),
    "smart-fedprox": ("smart-fedprox", "none", {"smart.cold-start-rounds": 1}),
    "hierarchical": ("hierarchical", "none", {}),
    "hierarchical-cp-np": ("hierarchical", "cp-np", {}),
    "dp-fedavg-fixed": ("fedavg", "dp-fedavg-fixed", DP),
    "dp-fedavg-adaptive": ("fedavg", "dp-fedavg-adaptive", DP),
    "dp-fedavg-client-noise": ("fedavg", "dp-fedavg-fixed", {**DP, "dp.noise-site": "client"}),
    "subspace-dp": ("fedavg", "subspace-dp", {**DP, "subspace.rank": 2, "subspace.sketch-dim": 8}),
    "laplace": ("fedavg", "laplace", {}),
    "dp-sgd": ("fedavg", "dp-sgd", {}),
}


class Killed(Exception):
    """The ServerApp process dies here."""


def _only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


def _kill_while_checkpointing(monkeypatch, server_round: int) -> None:
    original = RunDirectory.checkpoint

    def checkpoint(self, at_round, *args, **kwargs):
        if at_round == server_round:
            raise Killed(f"killed while checkpointing round {at_round}")
        return original(self, at_round, *args, **kwargs)

    monkeypatch.setattr(RunDirectory, "checkpoint", checkpoint)


def _table(path: Path) -> pd.DataFrame:
    """A CSV without what differs between processes by design: wall time, node ids."""
    frame = pd.read_csv(path)
    dropped = [c for c in frame.columns if c in TIMING_COLUMNS or "node" in c]
    return frame.drop(columns=dropped)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_equals_uninterrupted_run(case, tmp_path, monkeypatch):
    strategy, privacy, extra = CASES[case]
    common = {"strategy": strategy, "privacy": privacy, **extra}

    full = run_config(**common, **{"output-dir": str(tmp_path / "full")})
    run_server(full, InProcessGrid(full, NODES))
    full_dir = _only_run(tmp_path / "full")

    cut = run_config(**common, **{"output-dir": str(tmp_path / "cut")})
    with monkeypatch.context() as patch:
        _kill_while_checkpointing(patch, KILLED_AT)
        with pytest.raises(Killed):
            run_server(cut, InProcessGrid(cut, NODES))
    cut_dir = _only_run(tmp_path / "cut")
    rounds_on_disk = set(pd.read_csv(cut_dir / "metrics.csv")["round"])
    assert KILLED_AT in rounds_on_disk  # the killed round's metrics were written
    assert not (cut_dir / "model.pt").exists()

    resumed = {**cut, "resume-from": str(cut_dir)}
    run_server(resumed, InProcessGrid(resumed, NEW_NODES))
    assert _only_run(tmp_path / "cut") == cut_dir  # continued in place

    want = torch.load(full_dir / "model.pt", weights_only=True)
    got = torch.load(cut_dir / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key

    metrics = pd.read_csv(cut_dir / "metrics.csv")
    assert not metrics.duplicated(["round", "scope"]).any()
    assert sorted(set(metrics["round"])) == sorted(
        set(pd.read_csv(full_dir / "metrics.csv")["round"])
    )
    pd.testing.assert_frame_equal(
        _table(cut_dir / "metrics.csv"), _table(full_dir / "metrics.csv")
    )

    tables = sorted(p.name for p in full_dir.glob("*.csv"))
    assert tables == sorted(p.name for p in cut_dir.glob("*.csv"))
    for name in tables:
        pd.testing.assert_frame_equal(_table(cut_dir / name), _table(full_dir / name), obj=name)

    if privacy != "none":
        ledger_full = json.loads((full_dir / "ledger.json").read_text())
        ledger_cut = json.loads((cut_dir / "ledger.json").read_text())
        assert ledger_cut["state"] == ledger_full["state"]
        assert ledger_cut["summary"] == ledger_full["summary"]


def test_resume_refuses_another_run_config(tmp_path):
    config = run_config(**{"output-dir": str(tmp_path), "num-server-rounds": 1})
    run_server(config, InProcessGrid(config, NODES))
    other = {**config, "resume-from": str(_only_run(tmp_path)), "fedprox.mu": 0.7}
    with pytest.raises(ConfigError, match=r"'fedprox.mu': 0.1 then, 0.7 now"):
        run_server(other, InProcessGrid(other, NODES))


def test_resume_from_a_directory_without_checkpoint_is_refused(tmp_path):
    config = run_config(**{"resume-from": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"'resume-from' = .* is not a run directory"):
        run_server(config, InProcessGrid(config, NODES))
