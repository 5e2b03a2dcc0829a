"""The seed's regression MLP for disposable income (seed 001, section 5.1).

26 -> 128 -> 64 -> 32 -> 1: three Linear-BatchNorm1d-ReLU blocks (dropout 0.3 and
0.2 after the first two) and a linear output. BatchNorm (Ioffe & Szegedy, 2015)
makes the model unfit for DP-SGD (per-example gradients are undefined when batch
statistics mix examples); under ``finance.bn = local`` its layers stay on the
clients, as in FedBN (Li et al., 2021, "FedBN: Federated Learning on Non-IID
Features via Local Batch Normalization").
"""

from __future__ import annotations

import torch
from torch import nn

NUM_FEATURES = 26
HIDDEN = (128, 64, 32)
DROPOUT = (0.3, 0.2, 0.0)


class FinanceMLP(nn.Module):
    """MLP regressor; ``forward`` maps ``(batch, 26)`` to ``(batch,)``.

    Parameters
    ----------
    num_features : int
        Input features.
    hidden : tuple of int
        Widths of the hidden Linear-BatchNorm-ReLU blocks.
    dropout : tuple of float
        Dropout after each block (0: none).
    """

    def __init__(
        self,
        num_features: int = NUM_FEATURES,
        hidden: tuple[int, ...] = HIDDEN,
        dropout: tuple[float, ...] = DROPOUT,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for out, rate in zip(hidden, dropout, strict=True):
            layers += [nn.Linear(width, out), nn.BatchNorm1d(out), nn.ReLU()]
            if rate > 0:
                layers.append(nn.Dropout(rate))
            width = out
        layers.append(nn.Linear(width, 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted standardised target, shape ``(batch,)``."""
        return self.layers(x).squeeze(-1)


def build_model(seed: int) -> FinanceMLP:
    """A :class:`FinanceMLP` with PyTorch's default init drawn from ``seed``; the
    global RNG is untouched. On the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FinanceMLP()


def batchnorm_state_keys(model: nn.Module) -> tuple[str, ...]:
    """Every ``state_dict`` key of the BatchNorm layers of ``model`` (weight, bias,
    running mean and variance, batch counter), in ``state_dict`` order."""
    prefixes = tuple(
        f"{name}." for name, module in model.named_modules() if isinstance(module, nn.BatchNorm1d)
    )
    return tuple(key for key in model.state_dict() if key.startswith(prefixes))
