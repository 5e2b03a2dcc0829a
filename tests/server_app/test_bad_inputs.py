"""The remaining bad inputs stop the run early with a one-line error naming the key
(``cluster.k`` above the clients a round trains, an unwritable ``output-dir``, a
corrupted or truncated checkpoint under ``resume-from``), and ``outcome.json`` says
when the last round trained nothing."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from flwr.supercore.task_identity import TaskIdentity

from config.options import ConfigError
from server_app.failures import RunFailed
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33, 44]
# One worker makes the module's shared run once (a module-scoped fixture per worker
# otherwise).
pytestmark = [
    pytest.mark.xdist_group("bad-inputs"),
    pytest.mark.usefixtures("learning_curve_not_rendered"),
]


def _only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


def _outcome(path: Path) -> dict:
    return json.loads((path / "outcome.json").read_text())


def _trained(grid: InProcessGrid) -> bool:
    return any(m.metadata.message_type == "train" for m in grid.sent)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        # 4 nodes x 0.5 = 2 clients a round for 3 models.
        (
            {"fraction-train": 0.5},
            "start-up check: 'cluster.k' = 3 is more than the 2 clients a round trains "
            "('fraction-train' = 0.5 of 4 nodes, at least 'min-train-nodes' = 2): every "
            "round would leave at least 1 of the 3 models untrained. Set 'cluster.k' to at "
            "most 2",
        ),
        # Under DP the cohort is the round's clients.
        (
            {"privacy": "dp-fedavg-fixed", "dp.num-sampled-clients": 2, "dp.clip-norm": 0.5},
            "start-up check: 'cluster.k' = 3 is more than the 2 clients a round trains "
            "('dp.num-sampled-clients' = 2)",
        ),
    ],
    ids=["fedavg-sample", "dp-cohort"],
)
def test_more_clusters_than_clients_a_round_fails_at_start_up(tmp_path, overrides, reason):
    config = run_config(
        **{"output-dir": str(tmp_path), "strategy": "clustered", "cluster.k": 3, **overrides}
    )
    grid = InProcessGrid(config, NODES)
    with pytest.raises(RunFailed, match=r"'cluster\.k' = 3"):
        run_server(config, grid)
    outcome = _outcome(_only_run(tmp_path))
    assert outcome["status"] == "failed"
    assert outcome["reason"].startswith(reason)
    assert not _trained(grid)


def test_as_many_clusters_as_clients_a_round_runs(tmp_path):
    config = run_config(
        **{"output-dir": str(tmp_path), "strategy": "clustered", "cluster.k": 2},
        **{"fraction-train": 0.5, "num-server-rounds": 1},
    )
    run_server(config, InProcessGrid(config, NODES))
    assert _outcome(_only_run(tmp_path))["status"] == "completed"


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_an_unwritable_output_dir_is_named(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory\n")
    output = blocker if where == "a-file" else blocker / "runs"
    config = run_config(**{"output-dir": str(output)})
    grid = InProcessGrid(config, NODES)
    with pytest.raises(ConfigError) as raised:
        run_server(config, grid)
    message = str(raised.value)
    assert message.startswith(f"'output-dir' = '{output}': the run directory cannot be written")
    assert "NotADirectoryError" in message and "\n" not in message
    assert grid.sent == []


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[dict, Path]:
    """A finished one-round run, made once: each test damages a copy of it."""
    # What Flower's runtime sets for a ServerApp (tests/conftest.py sets it per test; a
    # module-scoped fixture runs before that).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    root = tmp_path_factory.mktemp("finished")
    config = run_config(**{"output-dir": str(root), "num-server-rounds": 1})
    run_server(config, InProcessGrid(config, NODES))
    return config, _only_run(root)


def _finished_run(finished: tuple[dict, Path], tmp_path: Path) -> tuple[dict, Path]:
    """A copy of the finished run in ``tmp_path``, and its config."""
    config, path = finished
    copy = Path(shutil.copytree(path, tmp_path / path.name, symlinks=True))
    return {**config, "output-dir": str(tmp_path)}, copy


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not-a-checkpoint"])
def test_a_damaged_checkpoint_names_resume_from_and_the_file(finished, tmp_path, damage):
    config, path = _finished_run(finished, tmp_path)
    file = path / "checkpoint" / "server.pt"
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        file.write_bytes(b"\x00garbage" * 100)
    elif damage == "empty":
        file.write_bytes(b"")
    else:  # a readable torch file that is no checkpoint of this app
        import torch

        torch.save({"format": 3, "round": 2}, file)
    resumed = {**config, "resume-from": str(path)}
    grid = InProcessGrid(resumed, NODES)
    with pytest.raises(ConfigError) as raised:
        run_server(resumed, grid)
    message = str(raised.value)
    assert message.startswith("'resume-from'")
    assert str(file) in message
    expected = (
        "lacks" if damage == "not-a-checkpoint" else "cannot be read (truncated or corrupted?"
    )
    assert expected in message
    assert grid.sent == []
    assert _outcome(path)["status"] == "completed"  # the finished run's record is untouched


def test_a_damaged_config_json_names_resume_from_and_the_file(finished, tmp_path):
    config, path = _finished_run(finished, tmp_path)
    (path / "config.json").write_text('{"run-config": {"task": "dig')
    resumed = {**config, "resume-from": str(path)}
    with pytest.raises(ConfigError, match=r"'resume-from' = .*config.json cannot be read"):
        run_server(resumed, InProcessGrid(resumed, NODES))


def _last_round_lost(tmp_path: Path, **overrides) -> Path:
    # Every node receives its round-2 train message and dies: round 2, the last,
    # aggregates nothing (round 1 did, so the run is not one that never learnt).
    config = run_config(
        **{"output-dir": str(tmp_path), "round-timeout": 1.0, "num-server-rounds": 2},
        **overrides,
    )
    grid = InProcessGrid(config, NODES)
    for node in NODES:
        grid.dies_in_round[node] = 2
    run_server(config, grid)
    return _only_run(tmp_path)


def test_outcome_says_when_the_last_round_trained_nothing(tmp_path):
    path = _last_round_lost(tmp_path)
    outcome = _outcome(path)
    assert outcome["status"] == "completed" and outcome["last-round"] == 2
    assert outcome["empty-last-round"] == (
        "round 2 aggregated no client's update: 4 of 4 clients: no reply"
    )


def test_under_dp_the_empty_last_round_is_only_in_the_curators_record(tmp_path):
    dp = {"privacy": "dp-fedavg-fixed", "dp.num-sampled-clients": 4, "dp.sampling": "fixed"}
    path = _last_round_lost(tmp_path, **dp, **{"dp.clip-norm": 0.5})
    outcome = _outcome(path)
    assert outcome["status"] == "completed"
    # Whether clients contributed depends on their data: no epsilon covers it, so the
    # published outcome says nothing of it; the participation record in curator/ does.
    assert "empty-last-round" not in outcome
    rows = list(csv.DictReader((path / "curator" / "participation.csv").open()))
    last = [row for row in rows if row["round"] == "2"]
    assert len(last) == 4 and all(row["error"] == "no reply" for row in last)


def test_a_last_round_that_trained_says_nothing_more(finished):
    _, path = finished
    assert "empty-last-round" not in _outcome(path)
