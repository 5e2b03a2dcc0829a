"""The vision task copies FedProx's anchor (the received parameters) only when the
proximal term reads it (mu > 0); the trained model does not depend on the copy at mu = 0."""

from __future__ import annotations

import torch

from tasks.base import LocalTraining
from tasks.vision import DigitsTask
from tasks.vision import task as vision_task

CONFIG = {"seed": 42, "vision.batch-size": 16, "vision.lr": 0.02, "vision.local-epochs": 1}


def _train(monkeypatch, mu: float) -> tuple[int, list[torch.Tensor]]:
    """(anchor copies taken, trained parameters) of one epoch on client 0 of 5."""
    copies = []
    original = vision_task.snapshot_parameters

    def counted(model):
        copies.append(1)
        return original(model)

    monkeypatch.setattr(vision_task, "snapshot_parameters", counted)
    task = DigitsTask(CONFIG)
    model = task.build_model(seed=0)
    task.train(model, task.load_partition(0, 5), LocalTraining(1, seed=0, proximal_mu=mu))
    return len(copies), [p.detach().clone() for p in model.parameters()]


def test_the_anchor_is_copied_only_when_mu_is_positive(monkeypatch):
    copies, plain = _train(monkeypatch, 0.0)
    assert copies == 0
    copies, proximal = _train(monkeypatch, 10.0)
    assert copies == 1
    # The proximal term pulls towards the anchor: the same seed trains another model.
    assert any(not torch.equal(a, b) for a, b in zip(plain, proximal, strict=True))
