"""``bench/ppo_throughput.py``'s same-work control: a federated run's client-rounds
rebuilt from its run directory and trained again, outside Ray, step for step."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from bench import ppo_throughput
from tasks.base import LocalTraining, local_seed
from tasks.lunar_lander import LunarLanderTask
from tasks.lunar_lander.ppo import flatten_state_dict, unflatten_state_dict
from tests.tasks import test_lunar_lander as lunar

CONFIG = lunar.TINY | {"task": "lunar-lander", "strategy": "fedavg", "ppo.keep-optimizer": True}
ROUNDS = {1: [0, 1], 2: [0, 2]}  # partition 0 trains twice: its Adam state carries over


def _fake_run(run_dir) -> None:
    """What a 2-round FedAvg run leaves behind, trained here as its ClientApps train:
    the clients' logs, the config, participation.csv and the last round's checkpoint."""
    task = LunarLanderTask(CONFIG)
    sent = flatten_state_dict(task.build_model(task.seed).state_dict())
    states: dict[int, tuple[dict, dict]] = {}
    rows = []
    for server_round, partitions in ROUNDS.items():
        trained = []
        for pid in partitions:
            model = task.build_model(0)
            model.load_state_dict(unflatten_state_dict(sent, model.state_dict()))
            state, tensors = states.get(pid, ({}, {}))
            local = LocalTraining(
                server_round=server_round, seed=local_seed(task.seed, server_round, pid),
                state=state, state_tensors=tensors, partition_id=pid,
                artifacts_dir=str(run_dir / "clients"), dp_seed=0,
            )  # fmt: skip
            metrics = task.train(model, task.load_partition(pid, 6), local)
            states[pid] = (local.state, local.state_tensors)
            trained.append(flatten_state_dict(model.state_dict()))
            rows.append({"round": server_round, "num-examples": metrics["num-examples"]})
        sent = trained[0] * np.float32(0.5) + trained[1] * np.float32(0.5)
    (run_dir / "checkpoint").mkdir()
    final = unflatten_state_dict(sent, task.build_model(0).state_dict())
    torch.save(final, run_dir / "checkpoint" / "global.pt")
    (run_dir / "config.json").write_text(json.dumps({"run-config": CONFIG}))
    pd.DataFrame(rows).to_csv(run_dir / "participation.csv", index=False)


def test_replay_trains_the_federated_client_rounds_again_step_for_step(tmp_path):
    # Prepare
    _fake_run(tmp_path)

    # Execute: one process at one thread, as one ClientApp x 1 CPU
    result = ppo_throughput.replay(tmp_path, processes=1, threads=1)

    # Assert: both round-2 client-rounds (one of them from its carried Adam state)
    # played the very episodes of the run
    assert result["client-rounds"] == 2
    assert result["same"] == 2
    assert result["learn-rate"] > 0


def test_replay_refuses_a_run_whose_rounds_it_cannot_rebuild(tmp_path):
    # Prepare: a checkpoint that is not the mean of the last round's trained weights
    _fake_run(tmp_path)
    final = torch.load(tmp_path / "checkpoint" / "global.pt", weights_only=True)
    torch.save({k: v + 1e-6 for k, v in final.items()}, tmp_path / "checkpoint" / "global.pt")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"differs from checkpoint/global\.pt"):
        ppo_throughput.federated_rounds(tmp_path)


def test_replay_refuses_other_strategies(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"run-config": CONFIG | {"strategy": "clustered"}})
    )
    with pytest.raises(ValueError, match="plain FedAvg rounds only"):
        ppo_throughput.federated_rounds(tmp_path)
