"""``bench/ppo_twin.py``: every client-round trained again by the ClientApp's twin
process (the same call, the same episodes), the staged app that runs it, and the
bench's arithmetic."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from flwr.supercore.object_ref import validate

from bench import ppo_twin, twin_clientapp
from tasks.base import LocalTraining, local_seed
from tasks.lunar_lander import LunarLanderTask
from tests.tasks import test_lunar_lander as lunar

CONFIG = lunar.TINY | {"ppo.keep-optimizer": True}


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """Two rounds of one client through the twin wrapper, and the same two rounds
    trained plainly (the reference)."""
    clients = tmp_path_factory.mktemp("run") / "clients"
    task = LunarLanderTask(CONFIG)
    partition = task.load_partition(1, task.num_partitions())
    wrapped, plain = task.build_model(0), task.build_model(0)
    kept: dict = {"wrapped": ({}, {}), "plain": ({}, {})}
    metrics = []
    try:
        for server_round in (1, 2):
            for side, model in (("wrapped", wrapped), ("plain", plain)):
                state, tensors = kept[side]
                local = LocalTraining(
                    server_round=server_round, seed=local_seed(task.seed, server_round, 1),
                    state=state, state_tensors=tensors, partition_id=1,
                    artifacts_dir=str(clients) if side == "wrapped" else None, dp_seed=0,
                )  # fmt: skip
                train = twin_clientapp.twin_train if side == "wrapped" else twin_clientapp._train
                result = train(task, model, partition, local)
                if side == "wrapped":
                    metrics.append(result)
    finally:
        twin_clientapp.close_twin()
    return {"clients": clients, "wrapped": wrapped, "plain": plain, "metrics": metrics}


def test_the_clientapp_trains_once_as_it_would_without_its_twin(twice):
    # Assert: the same weights as plain training, round after round (the twin trained
    # copies: the ClientApp's model and kept Adam state are its own)
    wrapped, plain = twice["wrapped"].state_dict(), twice["plain"].state_dict()
    assert all(torch.equal(wrapped[k], plain[k]) for k in plain)
    # only the ClientApp's own episode logs, one per round; the twin writes none
    logs = sorted(p.name for p in twice["clients"].glob("*.npz"))
    assert logs == ["earth-00-round-0001.npz", "earth-00-round-0002.npz"]


def test_each_client_round_leaves_both_sides_of_the_same_call_taking_turns(twice):
    # Execute
    paired = ppo_twin.pairs(twice["clients"].parent)

    # Assert: the same episodes (and every metric but the seconds) on both sides
    assert list(paired["round"]) == [1, 2]
    assert list(paired["first"]) == ["clientapp", "twin"]  # the cold twin goes second
    assert paired["same"].all()
    for server_round, ours in zip((1, 2), twice["metrics"], strict=True):
        path = twice["clients"] / f"twin-round-{server_round}-partition-1.json"
        record = json.loads(path.read_text())
        theirs = record["twin"]["metrics"]
        assert record["clientapp"]["metrics"] == ours
        assert {k: v for k, v in theirs.items() if k != "train-seconds"} == {
            k: v for k, v in ours.items() if k != "train-seconds"
        }
        assert theirs["train-seconds"] > 0 and record["added-seconds"] >= theirs["train-seconds"]
    assert (paired["steps"] == 256).all()


def test_summary_is_the_twins_learn_time_over_the_runs_own_wall_time():
    # Prepare: round 1 is left out; rounds 2 and 3 took 30 s of wall time, 8 s of which
    # the pairing added
    paired = pd.DataFrame(
        {
            "round": [1, 2, 3],
            "steps": [100, 100, 100],
            "clientapp-learn": [9.0, 10.0, 8.0],
            "twin-learn": [1.0, 8.0, 10.0],
            "added": [50.0, 4.0, 4.0],
            "same": [True, True, False],
        }
    )

    # Execute
    result = ppo_twin.summary(paired, seconds=30.0)

    # Assert: 22 s the run's own; the twins learned for 18 s, the ClientApp for 18 s
    assert result["ratio"] == pytest.approx(18 / 22)
    assert result["in-learn"] == pytest.approx(18 / 22)
    assert result["learn-ratio"] == pytest.approx((0.8 * 1.25) ** 0.5)  # geometric mean
    assert result["run-rate"] == pytest.approx(200 / 22)
    assert result["plain-rate"] == pytest.approx(200 / 18)
    assert (result["same"], result["client-rounds"]) == (1, 2)


def test_the_staged_app_runs_the_twin_clientapp(tmp_path):
    # Execute
    ppo_twin.stage_twin_app(tmp_path)

    # Assert: the component is the twin's, shipped in the FAB, and Flower finds it
    text = (tmp_path / "pyproject.toml").read_text()
    assert 'clientapp = "bench.twin_clientapp:app"' in text
    assert '"bench/twin_clientapp.py",' in text and "client_app.app:app" not in text
    assert (tmp_path / "bench" / "twin_clientapp.py").is_file()
    assert validate("bench.twin_clientapp:app", project_dir=tmp_path) == (True, None)


def test_the_component_is_a_copy_that_installs_the_wrapper_where_it_runs(monkeypatch):
    # Prepare
    from client_app.app import app as clientapp

    monkeypatch.setattr(LunarLanderTask, "train", twin_clientapp._train)

    # Execute: what a ClientApp process does with each message, before handling it
    with twin_clientapp.app._lifespan(None):
        installed = LunarLanderTask.train

    # Assert
    assert installed is twin_clientapp.twin_train
    assert twin_clientapp.app is not clientapp
    assert clientapp._lifespan is not twin_clientapp.app._lifespan  # the app's own untouched
    assert twin_clientapp.app._registered_funcs is clientapp._registered_funcs  # its handlers


def test_the_control_pairs_two_twins_on_the_same_call_and_trains_nothing(monkeypatch, tmp_path):
    # Prepare
    monkeypatch.setattr(LunarLanderTask, "train", twin_clientapp._train)  # restored after
    monkeypatch.setattr(twin_clientapp, "_CONTROL", False)
    task = LunarLanderTask(CONFIG)
    partition = task.load_partition(1, task.num_partitions())
    model = task.build_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin_clientapp.install(control=True)
    try:
        # Execute: two rounds of one client under the control
        for server_round in (1, 2):
            local = LocalTraining(
                server_round=server_round, seed=local_seed(task.seed, server_round, 1),
                partition_id=1, artifacts_dir=str(tmp_path / "clients"), dp_seed=0,
            )  # fmt: skip
            metrics = twin_clientapp.twin_train(task, model, partition, local)
        processes = [twin.process.pid for twin in twin_clientapp._TWIN]
    finally:
        twin_clientapp.close_twin()

    # Assert: two twins played the same episodes; the ClientApp's model and state as
    # they came, and no episode log of its own
    paired = ppo_twin.pairs(tmp_path)
    assert len(set(processes)) == 2 and paired["same"].all() and len(paired) == 2
    assert metrics["num-examples"] == 256 and not local.state and not local.state_tensors
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not list((tmp_path / "clients").glob("*.npz"))


def test_the_control_stages_its_own_component(monkeypatch, tmp_path):
    # Prepare
    monkeypatch.setattr(LunarLanderTask, "train", twin_clientapp._train)  # restored after
    monkeypatch.setattr(twin_clientapp, "_CONTROL", False)

    # Execute
    ppo_twin.stage_twin_app(tmp_path, "control_app")

    # Assert
    text = (tmp_path / "pyproject.toml").read_text()
    assert 'clientapp = "bench.twin_clientapp:control_app"' in text
    assert validate("bench.twin_clientapp:control_app", project_dir=tmp_path) == (True, None)
    with twin_clientapp.control_app._lifespan(None):
        assert twin_clientapp._CONTROL and LunarLanderTask.train is twin_clientapp.twin_train


def test_at_once_the_ratio_is_the_apps_share_in_learn_times_the_twins_time_over_its(
    monkeypatch, tmp_path
):
    # Prepare: the app's own run spent 90 % of each process's time in PPO.learn; in the
    # run with twins, rounds 2..3 took the twins 27 s and the ClientApps 30 s
    runs = {None: {"in-learn": 0.9, "waiting": 0.05, "steady": 2000.0, "epochs": 9.9}}
    paired = pd.DataFrame(
        {
            "round": [1, 1, 2, 2, 3, 3],
            "steps": [100] * 6,
            "clientapp-learn": [5.0, 5.0, 10.0, 5.0, 10.0, 5.0],
            "twin-learn": [1.0, 1.0, 8.0, 5.0, 9.0, 5.0],
            "same": [True] * 6,
        }
    )

    class Simulation:
        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

    def federated(_sim, _args, cpus, _out, app=None):
        assert cpus == 1  # ClientApps of one CPU
        return runs.get(app, {"run-dir": tmp_path})

    monkeypatch.setattr(ppo_twin, "LocalSimulation", Simulation)
    monkeypatch.setattr(ppo_twin, "federated", federated)
    monkeypatch.setattr(ppo_twin, "stage_twin_app", lambda path: path)
    monkeypatch.setattr(ppo_twin, "pairs", lambda _run_dir: paired)
    monkeypatch.setattr(ppo_twin.os, "cpu_count", lambda: 2)
    args = SimpleNamespace(rounds=3, clients_per_round=2)

    # Execute
    row, _ = ppo_twin.at_once_repeat(args, str(tmp_path))

    # Assert
    assert row["ratio"] == pytest.approx(0.9 * 27 / 30)
    assert row["run-rate"] == pytest.approx(1000.0)  # per process, of 2 at once
    assert row["plain-rate"] == pytest.approx(400 / 27)
    assert (row["same"], row["client-rounds"], row["waiting"]) == (4, 4, 0.05)
    with pytest.raises(SystemExit, match="5 twin records, 6 client-rounds"):
        ppo_twin.check_count(args, paired.iloc[:5])
