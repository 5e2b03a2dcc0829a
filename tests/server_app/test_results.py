"""Run directory: where it goes, what it holds, and that pandas reads it back."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import Array, ArrayRecord
from hypothesis import given
from hypothesis import strategies as st

from server_app import results
from server_app.results import RunDirectory, load_metrics, resolve_output_dir
from server_app.rounds import RoundResult

REPO = Path(__file__).resolve().parents[2]


def test_relative_output_dir_resolves_against_app_source_not_cwd(tmp_path, monkeypatch):
    # The ServerApp runs wherever the SuperLink was started; emulate that.
    monkeypatch.chdir(tmp_path)
    assert results.app_source_dir() == REPO  # installed with `pip install -e .` here
    assert resolve_output_dir("runs") == REPO / "runs"
    assert resolve_output_dir(str(tmp_path / "abs")) == tmp_path / "abs"


def test_relative_output_dir_falls_back_to_cwd_without_install(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(results, "DIST_NAME", "no-such-distribution")
    assert resolve_output_dir("runs") == tmp_path / "runs"


def test_run_directory_layout_and_round_trip(tmp_path):
    run = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    again = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    assert run.path != again.path  # same second: suffixed, never overwritten
    assert run.path.name.endswith("-digits-fedavg-none")
    run.write_config({"task": "digits", "strategy": "fedavg", "privacy": "none", "seed": 3})
    run.record(0, "central-eval", {"eval-accuracy": 0.1, "eval-loss": 2.3})
    run.record(1, "train", {"train-loss": 1.5, "note": "not a number"})
    run.record(1, "central-eval", {"eval-accuracy": 0.5, "eval-loss": 1.2})
    weights = {"w": torch.arange(3.0)}
    run.checkpoint(1, weights)
    run.finish(weights, title="test")

    frame = load_metrics(run.path)
    assert list(frame["round"]) == [0, 1, 1]
    assert list(frame["scope"]) == ["central-eval", "train", "central-eval"]
    assert "note" not in frame.columns
    assert frame["seed"].unique().tolist() == [3]
    assert pd.isna(frame.loc[1, "eval-accuracy"])
    assert json.loads((run.path / "checkpoint" / "state.json").read_text()) == {
        "round": 1,
        "models": [],
    }
    assert torch.equal(torch.load(run.path / "model.pt")["w"], weights["w"])
    assert (run.path / "plots" / "learning_curve.png").stat().st_size > 10_000
    assert not list(run.path.rglob(".*.tmp"))  # atomic writes leave no temporaries


def test_unknown_scope_is_rejected(tmp_path):
    run = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    with pytest.raises(ValueError, match="scope 'eval'"):
        run.record(1, "eval", {})


def test_participation_rows_accumulate_in_participation_csv(tmp_path):
    run = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    arrays = ArrayRecord({"w": Array(np.zeros(1, dtype=np.float32))})
    for server_round, loss in ((1, 0.5), (2, 0.25)):
        rows = [{"round": server_round, "node-id": 9, "replied": True, "train-loss": loss}]
        run.record_round(RoundResult(server_round, arrays, clients=rows))

    frame = pd.read_csv(run.path / "participation.csv")

    assert frame["round"].tolist() == [1, 2]
    assert frame["train-loss"].tolist() == [0.5, 0.25]


def test_metrics_are_also_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    run.record(1, "central-eval", {"eval-accuracy": 0.5})
    run.record(2, "central-eval", {"eval-accuracy": 0.75})
    run.finish({"w": torch.zeros(1)}, title="t")

    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("central-eval/eval-accuracy")

    assert [(s.step, s.value) for s in scalars] == [(1, 0.5), (2, 0.75)]


def test_appended_csv_reads_back_as_a_full_rewrite(tmp_path):
    # Rows with columns missing (an error row, an eval row), then a new column: the
    # file appended round by round equals the rows written in one go.
    run = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    arrays = ArrayRecord({"w": Array(np.zeros(1, dtype=np.float32))})
    rounds = [
        [{"round": 1, "node-id": 7, "replied": True, "error": "", "num-examples": 12}],
        [
            {"round": 2, "node-id": 7, "replied": False, "error": "no reply, timed out"},
            {"round": 2, "node-id": 9, "replied": True, "error": "", "num-examples": 30},
        ],
        [{"round": 3, "node-id": 9, "replied": True, "error": "", "num-examples": 31, "mu": 0.1}],
        [{"round": 4, "node-id": 7, "replied": True, "error": "", "num-examples": 12}],
    ]
    for server_round, clients in enumerate(rounds, start=1):
        train = {"train-loss": 1.0 / server_round} if server_round != 2 else None
        central = {"eval-accuracy": 0.1 * server_round}
        run.record_round(
            RoundResult(server_round, arrays, train=train, central_eval=central, clients=clients)
        )
    for name, rows in (("participation.csv", run.participation), ("metrics.csv", run.rows)):
        whole = tmp_path / f"whole-{name}"
        whole.write_text(pd.DataFrame(rows).to_csv(index=False))
        pd.testing.assert_frame_equal(pd.read_csv(run.path / name), pd.read_csv(whole))
    mu = pd.read_csv(run.path / "participation.csv")["mu"]  # the column came in round 3
    assert mu.isna().tolist() == [True, True, True, False, True] and mu.iloc[3] == 0.1


def test_a_table_built_afresh_is_rewritten_not_appended(tmp_path):
    run = RunDirectory.create(tmp_path, "digits", "clustered", "none")
    history = [{"round": 1, "node-id": 7, "cluster": 0}]
    run.write_rows("clusters.csv", history)
    history.append({"round": 2, "node-id": 7, "cluster": 1})  # grows in place: appended
    run.write_rows("clusters.csv", history)
    assert pd.read_csv(run.path / "clusters.csv")["cluster"].tolist() == [0, 1]
    members = [{"node-id": 9, "edge-id": 1}]  # rebuilt every round (edge-membership.csv)
    run.write_rows("members.csv", members)
    run.write_rows("members.csv", [{"node-id": 9, "edge-id": 0}, {"node-id": 4, "edge-id": 1}])
    frame = pd.read_csv(run.path / "members.csv")
    assert frame.to_dict("records") == [{"node-id": 9, "edge-id": 0}, {"node-id": 4, "edge-id": 1}]


_CELL = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=6),
    st.none(),  # None: the key is missing from the row
)
_COLUMNS = ["round", "scope", "a", "b"]


@given(
    st.lists(st.fixed_dictionaries({c: _CELL for c in _COLUMNS}), min_size=1, max_size=4),
    st.sampled_from([int, float, str, bool, None]),
)
def test_appended_rows_are_the_text_pandas_writes(cells, kind):
    """Whatever the rows hold, an append is pandas' text for them, byte for byte."""
    rows = [{k: v for k, v in row.items() if v is not None} for row in cells]
    if kind is not None:  # one column of one kind throughout: the fast path's case
        make = {int: lambda i: i, float: lambda i: i / 3, str: str, bool: bool}[kind]
        rows = [{**row, "a": make(i)} for i, row in enumerate(rows)]
    want = pd.DataFrame(rows, columns=_COLUMNS).to_csv(index=False, header=False)
    assert results._csv_rows(rows, _COLUMNS) == want


def test_a_rounds_metrics_row_is_appended_without_pandas(tmp_path, monkeypatch):
    run = RunDirectory.create(tmp_path, "digits", "fedavg", "none")
    row = {"round": 1, "scope": "train", "train-loss": 0.25, "num-examples": 12}
    run.write_rows("t.csv", [row])
    monkeypatch.setattr(results.pd, "DataFrame", None)  # any use of pandas now fails
    rows = [row, {**row, "round": 2, "train-loss": float("nan")}, {**row, "round": 3}]
    run.write_rows("t.csv", rows)
    monkeypatch.undo()
    assert (run.path / "t.csv").read_text() == pd.DataFrame(rows).to_csv(index=False)


class _Ledger:
    """What write_ledger reads of a ledger: a summary and a state with releases."""

    def __init__(self) -> None:
        self.releases: list[dict] = []

    def summary(self) -> dict:
        return {"epsilon": 0.5 * len(self.releases), "rounds": len(self.releases)}

    def state_dict(self) -> dict:
        return {"schema": "ledger", "releases": [dict(r) for r in self.releases], "local": []}


def test_ledger_json_is_json_dumps_as_releases_grow_and_change(tmp_path):
    run = RunDirectory.create(tmp_path, "digits", "fedavg", "dp-fedavg-fixed")
    ledger, extra = _Ledger(), {"threat-models": {"server": ["honest"]}}

    def check():
        run.write_ledger(ledger, extra)
        doc = {"summary": ledger.summary(), "state": ledger.state_dict()}
        doc |= {"run-directory": run.layout(), **extra}
        assert (run.path / "ledger.json").read_text() == json.dumps(doc, indent=2) + "\n"

    check()  # no release yet
    for server_round in range(1, 5):
        ledger.releases.append(
            {"server_round": server_round, "z": 1.0 / server_round, "note": 'a "b"\n', "x": None}
        )
        check()
    ledger.releases[1]["z"] = float("nan")  # an earlier release changed: rendered again
    check()
    ledger.releases.append({"server_round": 5, "nested": {"k": [1, 2]}, "z": float("inf")})
    check()
    del ledger.releases[2:]  # fewer releases (a ledger rebuilt): no stale text
    check()
