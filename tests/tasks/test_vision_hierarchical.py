"""Vision tasks under hierarchical FL: tau_1 local iterations, in every client mode."""

from __future__ import annotations

import pytest
import torch

from privacy.frontloaded import FrontLoadedDP
from tasks.base import NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.vision import DigitsTask


@pytest.fixture(scope="module")
def task():
    return DigitsTask({"vision.batch-size": 8, "vision.momentum": 0.0})


def _count_steps(monkeypatch) -> list[int]:
    steps = []
    original = torch.optim.SGD.step

    def counted(self, *args, **kwargs):
        steps.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", counted)
    return steps


@pytest.mark.parametrize("mode", [None, "cp-np"])
def test_tau_1_minibatch_steps_cycle_the_loader(task, monkeypatch, mode):
    partition = task.load_partition(0, 20)  # ~58 train rows: ~8 batches of 8
    batches = -(-len(partition.train) // 8)
    steps = _count_steps(monkeypatch)
    dp = FrontLoadedDP(mode=mode, clip=1.0, sigma=0.0) if mode else None
    local = LocalTraining(server_round=1, seed=0, local_updates=batches + 3, front_loaded=dp)

    metrics = task.train(task.build_model(0), partition, local)

    assert len(steps) == batches + 3  # more than one pass: the loader was cycled
    assert metrics[NUM_EXAMPLES] == len(partition.train) and metrics[TRAIN_LOSS] > 0
    assert local.state == {}  # no LR decay: nothing to count


def test_one_edge_aggregation_counts_one_lr_epoch():
    task = DigitsTask({"vision.batch-size": 8, "vision.lr-decay": 0.5})
    local = LocalTraining(server_round=1, seed=0, local_updates=3)
    task.train(task.build_model(0), task.load_partition(0, 20), local)
    assert local.state["local-epochs-done"] == 1


@pytest.mark.parametrize("mode", ["cg-ng", "cg-np"])
def test_clipped_gradient_modes_take_one_step_per_local_epoch(task, monkeypatch, mode):
    partition = task.load_partition(1, 20)
    steps = _count_steps(monkeypatch)
    local = LocalTraining(
        server_round=1,
        seed=0,
        local_updates=4,
        front_loaded=FrontLoadedDP(mode=mode, clip=2.0, sigma=0.01),
    )

    metrics = task.train(task.build_model(0), partition, local)

    assert len(steps) == 4 and metrics["optimizer-steps"] == 4
    assert metrics["noise-std"] == 0.01
