"""Under DP no stop reads the clients' outcomes (``server_app/failures.py``).

A client whose data gives a NaN loss answers with an error reply under server-side
noise; the DP wrapper counts it as a zero update and charges the round. Before, the
failure policy counted the same reply as a failed round and could stop the run, an
event that depends on the clients' data and that no epsilon covered (it showed in
``outcome.json`` and in the length of ``metrics.csv``). The real ServerApp and ClientApp
in one process (:mod:`tests.inprocess`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import tasks
from server_app.failures import FailureWatch
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
SERVER_NOISE = {
    "privacy": "dp-fedavg-fixed",
    "dp.noise-site": "server",
    "dp.sampling": "fixed",
    "dp.clip-norm": 0.1,
    "dp.noise-multiplier": 3.0,
    "num-server-rounds": 3,
}


def _poison(monkeypatch, partitions: set[int]) -> None:
    """The train images of ``partitions`` are NaN: their loss is NaN, their update is
    not finite, and the client's privacy mod answers with an error reply."""
    task = tasks.get("digits")
    original = task.load_partition

    def load_partition(self, partition_id, num_partitions):
        partition = original(self, partition_id, num_partitions)
        if partition_id not in partitions:
            return partition
        images = torch.full_like(partition.train.images, float("nan"))
        train = dataclasses.replace(partition.train, images=images)
        return dataclasses.replace(partition, train=train)

    monkeypatch.setattr(task, "load_partition", load_partition)


def _run(tmp_path: Path, **overrides) -> tuple[Path, InProcessGrid]:
    config = run_config(**{"output-dir": str(tmp_path), **SERVER_NOISE, **overrides})
    grid = InProcessGrid(config, NODES)
    grid.errors_as_replies = True
    run_server(config, grid)  # raises RunFailed if the run stopped as failed
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return path, grid


def _train_replies(grid: InProcessGrid) -> int:
    return sum(1 for m in grid.sent if m.metadata.message_type == "train")


def test_every_client_nan_under_dp_runs_every_round_and_charges_it(tmp_path, monkeypatch):
    # Every client's data gives a NaN loss: before, round 1 stopped the run ("every
    # client failed the same way"); the stop was visible at the top level.
    _poison(monkeypatch, {0, 1, 2, 3})
    path, grid = _run(tmp_path, **{"dp.num-sampled-clients": 4})
    outcome = json.loads((path / "outcome.json").read_text())
    assert outcome["status"] == "completed" and outcome["last-round"] == 3
    assert set(outcome) == {"status", "reason", "last-round", "checkpoint"}
    assert _train_replies(grid) == 3 * 4
    ledger = json.loads((path / "ledger.json").read_text())["state"]
    assert [r["server_round"] for r in ledger["releases"]] == [1, 2, 3]  # every round charged
    curator = pd.read_csv(path / "curator" / "metrics.csv")
    failed = curator[curator["scope"] == "train"]["dp-failed-clients"]
    assert list(failed) == [4.0, 4.0, 4.0]  # each a zero update
    participation = pd.read_csv(path / "curator" / "participation.csv")
    assert participation["error"].str.contains("contains NaN or Inf").all()
    published = pd.read_csv(path / "metrics.csv")
    assert list(published[published["scope"] == "train"]["round"]) == [1, 2, 3]


def test_a_nan_client_sampled_alone_does_not_stop_the_run(tmp_path, monkeypatch):
    # m = 1 of 4 and 'run.max-failed-rounds' = 1: before, the run stopped in the first
    # round that sampled partition 0, so its length told who was sampled.
    _poison(monkeypatch, {0})
    path, grid = _run(
        tmp_path,
        **{"dp.num-sampled-clients": 1, "run.max-failed-rounds": 1, "num-server-rounds": 6},
    )
    outcome = json.loads((path / "outcome.json").read_text())
    assert outcome["status"] == "completed" and outcome["last-round"] == 6
    ledger = json.loads((path / "ledger.json").read_text())["state"]
    assert [r["server_round"] for r in ledger["releases"]] == [1, 2, 3, 4, 5, 6]
    assert _train_replies(grid) == 6


def test_the_watch_reads_no_client_outcome_under_dp():
    failed = [{"replied": False, "error": "<class 'ValueError'>:<'nan'>"}] * 4
    private = FailureWatch(max_failed_rounds=1, private=True)
    assert private.after_train(1, failed, first=True) is None
    assert private.after_train(2, failed, first=False) is None
    assert private.never_contributed(2) is None
    public = FailureWatch(max_failed_rounds=1)
    assert public.after_train(1, failed, first=True).startswith("round 1, every client")
    # The divergence guard still reads the central evaluation of the released model.
    assert private.diverged(1, {"central-eval": {"eval-loss": float("nan")}}) is not None


def test_a_non_finite_central_loss_still_stops_a_dp_run(tmp_path, monkeypatch):
    # The divergence guard reads the central evaluation of the released model only.
    from flwr.app import MetricRecord

    from server_app import app

    original = app.central_eval

    def diverging(*args, **kwargs):
        evaluate = original(*args, **kwargs)

        def wrapped(server_round, arrays):
            metrics = dict(evaluate(server_round, arrays))
            if server_round == 2:
                metrics["eval-loss"] = float("nan")
            return MetricRecord(metrics)

        return wrapped

    monkeypatch.setattr(app, "central_eval", diverging)
    config = run_config(
        **{"output-dir": str(tmp_path), **SERVER_NOISE, "dp.num-sampled-clients": 2}
    )
    with pytest.raises(Exception, match="central-eval 'eval-loss' = nan"):
        run_server(config, InProcessGrid(config, NODES))
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    outcome = json.loads((path / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["last-round"] == 1
