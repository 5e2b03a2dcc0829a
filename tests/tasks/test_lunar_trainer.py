"""PPO in a warm child process (ppo.trainer-process): the same training, its failures
surfaced, its lifetime bound to the ClientApp's process."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.base import LocalTraining
from tasks.lunar_lander.clients import ClientEnv
from tasks.lunar_lander.logs import load_episodes
from tasks.lunar_lander.task import LunarLanderTask
from tasks.lunar_lander.trainer import (
    TrainerError,
    close_trainer_process,
    train_in_trainer_process,
)
from tests.tasks.test_lunar_lander import TINY, _same_weights, _weights

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_trainer_left():
    yield
    close_trainer_process()


def _two_rounds(task: LunarLanderTask, client: ClientEnv, artifacts: Path) -> tuple:
    """Two rounds of one client, its Adam moments kept: (weights, metrics, local)."""
    model, local, metrics = task.build_model(0), None, []
    for server_round in (1, 2):
        state = {} if local is None else local.state
        tensors = {} if local is None else local.state_tensors
        local = LocalTraining(
            server_round, seed=5 + server_round, state=state, state_tensors=tensors,
            partition_id=1, artifacts_dir=str(artifacts),
        )  # fmt: skip
        metrics.append(task.train(model, client, local))
    return _weights(model), metrics, local


def test_trainer_process_trains_what_this_process_trains(tmp_path):
    # Prepare: two rounds with kept Adam moments and logs, here and in the child
    options = TINY | {"ppo.keep-optimizer": True}
    here = LunarLanderTask(options)
    there = LunarLanderTask(options | {"ppo.trainer-process": True})
    client = here.clients[1]

    # Execute
    weights, metrics, local = _two_rounds(here, client, tmp_path / "here")
    child_weights, child_metrics, child_local = _two_rounds(there, client, tmp_path / "there")

    # Assert: the same weights, Adam moments, client state, metrics and episode logs
    assert _same_weights(weights, child_weights)
    assert local.state == child_local.state and local.state["ppo-timesteps"] == 512
    assert local.state_tensors.keys() == child_local.state_tensors.keys()
    assert all(
        torch.equal(v, child_local.state_tensors[k]) for k, v in local.state_tensors.items()
    )
    for ours, theirs in zip(metrics, child_metrics, strict=True):
        assert ours.pop("train-seconds") > 0 and theirs.pop("train-seconds") > 0
        assert ours == theirs
    episodes = load_episodes(tmp_path / "here")
    assert len(episodes) > 0 and episodes.equals(load_episodes(tmp_path / "there"))


def test_trainer_process_stays_warm_and_leaves_global_state_alone(tmp_path):
    # Prepare
    task = LunarLanderTask(TINY | {"ppo.trainer-process": True})
    torch.manual_seed(11)
    np.random.seed(11)
    expected = (torch.rand(1), np.random.rand())
    torch.manual_seed(11)
    np.random.seed(11)

    # Execute: two rounds in this process's one trainer
    for server_round in (1, 2):
        task.train(task.build_model(0), task.clients[0], LocalTraining(server_round, seed=1))
    from tasks.lunar_lander import trainer

    pids = {t.pid for t in trainer._TRAINER}

    # Assert: one warm child, and this process's RNGs as they were
    assert len(pids) == 1 and trainer._TRAINER[0].process.poll() is None
    assert torch.equal(torch.rand(1), expected[0]) and np.random.rand() == expected[1]


def test_an_error_in_the_trainer_process_is_raised_here_with_its_traceback():
    # Prepare: LunarLander refuses a gravity outside (-12, 0), inside the child
    task = LunarLanderTask(TINY)
    bad = dataclasses.replace(task.clients[1], label="nowhere-00", gravity=-30.0)

    # Execute / Assert
    with pytest.raises(AssertionError) as raised:
        train_in_trainer_process(task.build_model(0), bad, task.config, seed=0)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "raised in the PPO trainer process" in notes and "Traceback" in notes


def test_a_killed_trainer_process_is_named_then_replaced():
    # Prepare
    task = LunarLanderTask(TINY)
    model, client = task.build_model(0), task.clients[0]
    train_in_trainer_process(model, client, task.config, seed=0)
    from tasks.lunar_lander import trainer

    first = trainer._TRAINER[0]
    os.kill(first.pid, signal.SIGKILL)
    first.process.wait()

    # Execute: the call in flight fails by name; the next starts a fresh child
    with pytest.raises(TrainerError, match=f"trainer process {first.pid} exited with code -9"):
        first.train(model, client, task.config, seed=0)
    result = train_in_trainer_process(model, client, task.config, seed=0)

    # Assert
    assert result.timesteps == 256 and trainer._TRAINER[0].pid != first.pid


def test_the_trainer_process_ends_when_its_parent_does(tmp_path):
    # Prepare: a parent that starts its trainer, then dies without closing it
    pid_file = tmp_path / "pid"
    script = (
        "import os, sys\n"
        "from tasks.lunar_lander.trainer import TrainerProcess\n"
        f"open({str(pid_file)!r}, 'w').write(str(TrainerProcess().pid))\n"
        "os._exit(0)\n"
    )

    # Execute
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
    child = int(pid_file.read_text())

    # Assert: its input closed, the child returns (it is not our child: poll /proc)
    deadline = time.monotonic() + 120
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        status = Path(f"/proc/{child}/status")
        if status.exists() and "State:\tZ" in status.read_text():
            break  # exited, awaiting its reaper
        time.sleep(0.2)
    alive = Path(f"/proc/{child}/status")
    assert not alive.exists() or "State:\tZ" in alive.read_text()


def test_trainer_process_option_is_off_by_default_and_parsed():
    assert LunarLanderTask(TINY).trainer_process is False
    assert LunarLanderTask(TINY | {"ppo.trainer-process": True}).trainer_process is True
