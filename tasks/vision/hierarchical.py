"""Local training under hierarchical FL (frontloaded-dp-hfl) for the vision tasks.

Each edge aggregation asks a client for tau_1 = ``local.local_updates`` local
iterations: mini-batch SGD steps for the baseline and CP-NP (the loader is cycled,
reshuffled on every pass), and for CG-NG / CG-NP tau_1 local epochs of one clipped
step each (``privacy.frontloaded.train_clipped_gradients``, the paper's modes).
For ``vision.lr-decay``, one edge aggregation's local training counts as one epoch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from privacy.frontloaded import train_clipped_gradients
from tasks.base import TRAIN_ACCURACY, TRAIN_LOSS, LocalTraining
from tasks.vision.steps import train_batch

CLIPPED_GRADIENT_MODES = ("cg-ng", "cg-np")


def train_iterations(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    steps: int,
    global_params: list[torch.Tensor],
    proximal_mu: float,
) -> tuple[float, float]:
    """``steps`` mini-batch SGD steps, cycling ``loader``; mean loss and accuracy."""
    model.train()
    total_loss, correct, seen, done = 0.0, 0, 0, 0
    while done < steps:
        for images, labels in loader:
            if done == steps:
                break
            images, labels = images.to(device), labels.to(device)
            loss, right = train_batch(model, images, labels, optimizer, global_params, proximal_mu)
            done += 1
            total_loss += loss
            correct += right
            seen += len(labels)
        if seen == 0:  # an empty loader would never finish
            raise ValueError("cannot train local iterations on an empty training split")
    return total_loss / seen, correct / seen


def train_local_updates(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    local: LocalTraining,
    global_params: list[torch.Tensor],
) -> dict[str, Any]:
    """One edge aggregation's local training: tau_1 iterations in the requested mode."""
    dp = local.front_loaded
    if dp is not None and dp.mode in CLIPPED_GRADIENT_MODES:
        generator = torch.Generator().manual_seed(local.dp_seed)  # secret: CG noise
        return train_clipped_gradients(
            model,
            loader,
            dp=dp,
            local_epochs=int(local.local_updates),
            optimizer=optimizer,
            loss_fn=nn.functional.cross_entropy,
            generator=generator,
            device=device,
            state=local.state,
        )
    loss, accuracy = train_iterations(
        model,
        loader,
        optimizer,
        device,
        int(local.local_updates),
        global_params,
        local.proximal_mu,
    )
    return {TRAIN_LOSS: loss, TRAIN_ACCURACY: accuracy}
