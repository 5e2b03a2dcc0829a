"""The seed's regression MLP for disposable income (the SmartFedProx study, section 5.1).

26 -> 128 -> 64 -> 32 -> 1: three Linear-norm-ReLU blocks (dropout 0.3 and 0.2 after
the first two) and a linear output. The normalisation layer is ``norm``:

* ``batch`` (the seed's model, the default without DP-SGD): BatchNorm1d (Ioffe &
  Szegedy, 2015). It normalises with the statistics of the whole batch, so one
  example's output, and hence its gradient, depends on the other examples: per-example
  gradients are undefined and the model is unfit for DP-SGD. Its running mean and
  variance are data-dependent buffers outside the parameters. Under ``finance.bn =
  local`` its layers stay on the clients, as in FedBN (Li et al., 2021, "FedBN:
  Federated Learning on Non-IID Features via Local Batch Normalization").
* ``layer`` (what ``finance.norm = auto`` builds under ``privacy = 'dp-sgd'``):
  LayerNorm (Ba, Kiros & Hinton, 2016) over the block's features. It normalises each
  example on its own, so the per-example gradients Opacus computes (it has a LayerNorm
  grad sampler) depend on that example alone, and it has no running statistics, so
  nothing data-dependent is kept outside the parameters that DP-SGD clips and noises.
  On a ``(batch, features)`` input GroupNorm with one group is the same normalisation
  (Opacus' ``ModuleValidator.fix`` would replace BatchNorm by GroupNorm); LayerNorm is
  the plainer name for it here. It has the same parameters as BatchNorm (``weight``
  and ``bias`` per feature, same names) and neither draws from the RNG at init, so
  one seed gives both models the same Linear weights.
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
