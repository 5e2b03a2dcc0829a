"""Per-example gradients on public data match one backward pass per example."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tasks.vision.data import TensorSplit
from tasks.vision.gradients import per_example_gradients


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU())
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(self.body(x))


def test_matches_one_backward_per_example():
    model = TinyNet()
    split = TensorSplit(
        images=torch.randn(7, 1, 2, 2), labels=torch.tensor([0, 1, 2, 0, 1, 2, 0]), ids=None
    )
    keys = ["body.2.running_mean", "fc.weight", "fc.bias"]
    got = per_example_gradients(model, split, keys, batch_size=3)
    assert got.shape == (7, 5 + 15 + 3)
    model.eval()
    for i in range(7):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(split.images[i : i + 1]), split.labels[i : i + 1])
        loss.backward()
        expected = np.concatenate(
            [np.zeros(5), model.fc.weight.grad.numpy().ravel(), model.fc.bias.grad.numpy()]
        )
        np.testing.assert_allclose(got[i], expected, rtol=1e-5, atol=1e-7)
    assert model.training is False  # restored to the mode it had (eval above)
    assert per_example_gradients(model, split, ["fc.bias"], max_values=6).shape == (2, 3)
    with pytest.raises(ValueError, match="nope"):
        per_example_gradients(model, split, ["nope"])
