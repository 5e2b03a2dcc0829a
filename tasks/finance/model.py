"""The regression MLP for disposable income of the SmartFedProx study (section 5.1).

Design notes: ``docs/notes.md``, ``tasks.finance.model``.
"""

from __future__ import annotations

import torch
from torch import nn

NUM_FEATURES = 26
HIDDEN = (128, 64, 32)
DROPOUT = (0.3, 0.2, 0.0)
NORMS = ("batch", "layer")  # FinanceMLP's normalisation layers
_NORM_LAYERS: dict[str, type[nn.Module]] = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}


class FinanceMLP(nn.Module):
    """MLP regressor; ``forward`` maps ``(batch, 26)`` to ``(batch,)``.

    Parameters
    ----------
    num_features : int
        Input features.
    hidden : tuple of int
        Widths of the hidden Linear-norm-ReLU blocks.
    dropout : tuple of float
        Dropout after each block (0: none).
    norm : str
        ``batch`` (BatchNorm1d) or ``layer`` (LayerNorm, DP-SGD compatible).
    """

    def __init__(
        self,
        num_features: int = NUM_FEATURES,
        hidden: tuple[int, ...] = HIDDEN,
        dropout: tuple[float, ...] = DROPOUT,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if norm not in _NORM_LAYERS:
            raise ValueError(f"norm = {norm!r} is not valid; valid values: {NORMS}")
        norm_layer = _NORM_LAYERS[norm]
        layers: list[nn.Module] = []
        width = num_features
        for out, rate in zip(hidden, dropout, strict=True):
            layers += [nn.Linear(width, out), norm_layer(out), nn.ReLU()]
            if rate > 0:
                layers.append(nn.Dropout(rate))
            width = out
        layers.append(nn.Linear(width, 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted standardised target, shape ``(batch,)``."""
        return self.layers(x).squeeze(-1)


def build_model(seed: int, norm: str = "batch") -> FinanceMLP:
    """A ``FinanceMLP`` with normalisation ``norm`` and PyTorch's default init
    drawn from ``seed``; the global RNG is untouched. On the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FinanceMLP(norm=norm)


def batchnorm_state_keys(model: nn.Module) -> tuple[str, ...]:
    """Every ``state_dict`` key of the BatchNorm layers of ``model`` (weight, bias,
    running mean and variance, batch counter), in ``state_dict`` order."""
    prefixes = tuple(
        f"{name}." for name, module in model.named_modules() if isinstance(module, nn.BatchNorm1d)
    )
    return tuple(key for key in model.state_dict() if key.startswith(prefixes))
