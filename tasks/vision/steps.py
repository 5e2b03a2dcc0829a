"""The loops of image classification: one SGD step (shared by epoch- and iteration-based
training), one training epoch, one evaluation pass with per-label tallies."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from tasks.proximal import proximal_term
from tasks.vision.data import TensorSplit, ordered_batches


def train_batch(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    global_params: list[torch.Tensor],
    proximal_mu: float,
) -> tuple[float, int]:
    """One step on a batch (plus the FedProx term when ``proximal_mu`` > 0); returns the
    batch's summed cross-entropy (without the proximal term) and its correct count."""
    optimizer.zero_grad()
    logits = model(images)
    loss = nn.functional.cross_entropy(logits, labels)
    if proximal_mu > 0:
        (loss + proximal_term(model, global_params, proximal_mu)).backward()
    else:
        loss.backward()
    optimizer.step()
    return loss.item() * len(labels), int((logits.argmax(dim=1) == labels).sum())


def train_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    global_params: list[torch.Tensor],
    proximal_mu: float,
) -> tuple[float, float]:
    """One pass over ``loader``; returns mean cross-entropy (no proximal term) and accuracy.

    An empty batch (possible under Poisson sampling) still makes an optimizer step:
    under DP-SGD that step releases pure noise, as the accountant assumes.
    """
    model.train()
    total_loss, correct, seen = 0.0, 0, 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        loss, right = train_batch(model, images, labels, optimizer, global_params, proximal_mu)
        if len(labels) == 0:
            continue
        total_loss += loss
        correct += right
        seen += len(labels)
    return (total_loss / seen, correct / seen) if seen else (0.0, 0.0)


@torch.no_grad()
def tally_split(
    model: nn.Module, split: TensorSplit, batch_size: int, device: torch.device, num_classes: int
) -> tuple[float, np.ndarray, np.ndarray]:
    """One evaluation pass of ``model`` over ``split``.

    Returns
    -------
    tuple
        The summed cross-entropy, and two int64 arrays of length ``num_classes``: right
        predictions and examples, per true label.
    """
    model.eval()
    total_loss = 0.0
    correct = torch.zeros(num_classes, dtype=torch.long)
    counts = torch.zeros(num_classes, dtype=torch.long)
    for images, labels in ordered_batches(split, batch_size):
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        total_loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        right = labels[logits.argmax(dim=1) == labels]
        correct += torch.bincount(right, minlength=num_classes).cpu()
        counts += torch.bincount(labels, minlength=num_classes).cpu()
    return total_loss, correct.numpy(), counts.numpy()
