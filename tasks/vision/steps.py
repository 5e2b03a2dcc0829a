"""One SGD step of image classification, shared by epoch- and iteration-based training."""

from __future__ import annotations

import torch
from torch import nn

from tasks.proximal import proximal_term


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
