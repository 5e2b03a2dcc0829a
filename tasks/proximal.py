"""The FedProx proximal term (Li et al., 2020, "Federated Optimization in
Heterogeneous Networks", eq. 2): ``(mu / 2) * ||w - w_global||^2``.

Every task adds it to its local loss when the server sends a non-zero
``proximal-mu`` (Flower's ``FedProx`` strategy puts it in the train config).
"""

from __future__ import annotations

import torch


def snapshot_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of the trainable parameters (the global model at round start)."""
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def proximal_term(
    model: torch.nn.Module, global_params: list[torch.Tensor], mu: float
) -> torch.Tensor:
    """Return ``(mu / 2) * sum_i ||w_i - w_global_i||^2`` over trainable parameters.

    Its gradient with respect to ``w`` is ``mu * (w - w_global)``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if len(params) != len(global_params):
        raise ValueError(
            f"model has {len(params)} trainable tensors, snapshot has {len(global_params)}"
        )
    squared = sum((w - g).pow(2).sum() for w, g in zip(params, global_params, strict=True))
    return 0.5 * mu * squared
