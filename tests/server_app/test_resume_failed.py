"""``resume-from`` a failed run never hides the failure.

A round is committed before it is evaluated. When its model then fails the divergence
guard, its checkpoint is marked rejected and ``resume-from`` refuses it, naming the
reason and the last good round; the guard's reference values are in the checkpoint, so
a run killed before the mark could be written fails again when its resumed round is
evaluated; and a resumed run's ``outcome.json`` lists the outcomes of the runs it
continues (``previous-outcomes``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from config.options import ConfigError
from server_app.failures import RunFailed
from server_app.results import RunDirectory
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
NEW_NODES = [55, 66, 77, 88]
# The app's default factor (the in-process harness turns the ratio check off) and a
# learning rate that makes digits diverge within a few rounds.
DIVERGING = {"num-server-rounds": 6, "vision.lr": 1e4, "run.divergence-factor": 1000.0}


class Killed(Exception):
    """The ServerApp process dies here."""


def _only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


def _outcome(path: Path) -> dict:
    return json.loads((path / "outcome.json").read_text())


def _server_pt(path: Path) -> dict:
    return torch.load(path / "checkpoint" / "server.pt", weights_only=True)


def _first_run(tmp_path: Path, **overrides) -> tuple[dict, Path]:
    config = run_config(**{"output-dir": str(tmp_path), **DIVERGING, **overrides})
    with pytest.raises(RunFailed, match="the global model diverged"):
        run_server(config, InProcessGrid(config, NODES))
    return config, _only_run(tmp_path)


def test_resume_of_a_diverged_run_is_refused_naming_the_reason_and_last_round(tmp_path):
    config, path = _first_run(tmp_path)
    outcome = _outcome(path)
    last = outcome["last-round"]
    saved = _server_pt(path)
    # The diverged round was committed (before its evaluation), then marked rejected.
    assert saved["round"] == last + 1
    assert saved["rejected"] == {"reason": outcome["reason"], "last-round": last}
    # The guard's reference: central evaluation's round-0 loss, as metrics.csv has it.
    metrics = pd.read_csv(path / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    reference = {(s, k): v for s, k, v in saved["guard"]["reference"]}
    assert reference[("central-eval", "eval-loss")] == pytest.approx(central.loc[0, "eval-loss"])

    resumed = {**config, "resume-from": str(path)}
    grid = InProcessGrid(resumed, NEW_NODES)
    pattern = (
        rf"'resume-from' = .*: that run failed after round {last + 1}: round {last + 1}: "
        rf".*diverged.*'last-round' = {last}"
    )
    with pytest.raises(ConfigError, match=pattern):
        run_server(resumed, grid)
    assert grid.sent == []  # refused before any client was asked anything
    assert _outcome(path) == outcome  # still failed, as it was
    assert not (path / "model.pt").exists()


def test_a_run_killed_before_the_mark_fails_again_when_resumed(tmp_path, monkeypatch):
    # Killed between the diverged round's commit and its rejection: the checkpoint holds
    # the diverged model unmarked, as every checkpoint did before rounds were marked.
    def dying(self, server_round, server_state, reason):
        raise Killed(f"killed while rejecting round {server_round}")

    with monkeypatch.context() as patch:
        patch.setattr(RunDirectory, "reject", dying)
        config = run_config(**{"output-dir": str(tmp_path), **DIVERGING})
        with pytest.raises(Killed):
            run_server(config, InProcessGrid(config, NODES))
    path = _only_run(tmp_path)
    killed = _outcome(path)
    assert killed["status"] == "failed" and "Killed" in killed["reason"]
    diverged_round = int(_server_pt(path)["round"])
    assert "rejected" not in _server_pt(path)

    resumed = {**config, "resume-from": str(path)}
    grid = InProcessGrid(resumed, NEW_NODES)
    with pytest.raises(RunFailed, match="the global model diverged"):
        run_server(resumed, grid)
    outcome = _outcome(path)
    # The guard fired on the resumed round with the first run's reference (round 0),
    # not with the diverged round's own loss as its reference.
    assert outcome["status"] == "failed"
    assert outcome["last-round"] == diverged_round - 1
    first = float(re.search(r"its first value ([0-9.e+-]+)", outcome["reason"]).group(1))
    metrics = pd.read_csv(path / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    assert first == pytest.approx(central.loc[0, "eval-loss"], rel=1e-3)
    assert outcome["previous-outcomes"] == [killed]
    # Nothing trained after the diverged round; no final model; the mark is there now.
    assert all(m.metadata.message_type != "train" for m in grid.sent)
    assert not (path / "model.pt").exists()
    assert _server_pt(path)["rejected"]["last-round"] == diverged_round - 1
    state = json.loads((path / "checkpoint" / "state.json").read_text())
    assert state["round"] == diverged_round - 1  # the last good model stays


def test_a_resumed_run_keeps_the_earlier_failure_in_its_outcome(tmp_path, monkeypatch):
    # A run that died in round 2 (a crash, not a verdict on the model) may go on; its
    # outcome then says completed and keeps how the earlier run ended.
    original = RunDirectory.record_round

    def dying(self, result, *args, **kwargs):
        if result.server_round == 2:
            raise Killed("killed writing round 2")
        return original(self, result, *args, **kwargs)

    config = run_config(**{"output-dir": str(tmp_path)})
    with monkeypatch.context() as patch:
        patch.setattr(RunDirectory, "record_round", dying)
        with pytest.raises(Killed):
            run_server(config, InProcessGrid(config, NODES))
    path = _only_run(tmp_path)
    killed = _outcome(path)
    assert killed["status"] == "failed"

    resumed = {**config, "resume-from": str(path)}
    run_server(resumed, InProcessGrid(resumed, NEW_NODES))
    outcome = _outcome(path)
    assert outcome["status"] == "completed" and outcome["last-round"] == 3
    assert outcome["previous-outcomes"] == [killed]
    assert (path / "model.pt").exists()


def test_under_dp_a_diverged_round_stays_charged_and_is_not_resumed(tmp_path):
    # Noise that swamps 4 clients' updates: central eval loss far above 1000 x round 0's.
    dp = {
        "privacy": "dp-fedavg-fixed",
        "dp.num-sampled-clients": 4,
        "dp.sampling": "fixed",
        "dp.noise-multiplier": 1.0,
        "dp.clip-norm": 100.0,
        "dp.reproducible-noise": True,
        "run.divergence-factor": 1000.0,
        "num-server-rounds": 3,
    }
    config = run_config(**{"output-dir": str(tmp_path), **dp})
    with pytest.raises(RunFailed, match="the global model diverged"):
        run_server(config, InProcessGrid(config, NODES))
    path = _only_run(tmp_path)
    outcome = _outcome(path)
    diverged_round = outcome["last-round"] + 1
    saved = _server_pt(path)
    assert saved["round"] == diverged_round and saved["rejected"]
    ledger = json.loads((path / "ledger.json").read_text())["state"]
    # The diverged round was released (its central evaluation) and charged.
    assert [r["server_round"] for r in ledger["releases"]] == list(range(1, diverged_round + 1))
    resumed = {**config, "resume-from": str(path)}
    with pytest.raises(ConfigError, match=f"'last-round' = {diverged_round - 1}"):
        run_server(resumed, InProcessGrid(resumed, NEW_NODES))
    assert json.loads((path / "ledger.json").read_text())["state"] == ledger  # nothing more
