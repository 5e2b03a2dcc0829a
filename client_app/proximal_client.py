"""Client side of FedProx and SmartFedProx (seed 001), and FedBN's local layers.

Every train reply carries ``divergence`` (‖w_local − w_global‖ over the model's
parameters, the seed's ``compute_model_divergence``) and ``effective-mu`` (the
proximal weight the client trained with), whatever the strategy, so that FedAvg,
FedProx and SmartFedProx runs can be compared on the same plots. Under SmartFedProx
with ``smart-adaptive-mu`` the client scales the base μ with the seed's formula
(:func:`tasks.adaptive_mu.adaptive_mu`) from its own divergence history, an EMA kept
in ``context.state``; a client without a history yet (a fresh SuperNode) starts from
the server's copy of it (``smart-client-divergence``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from protocol import keys
from tasks.adaptive_mu import adaptive_mu, ema, model_divergence

SMART_STATE = "smart-fedprox"  # context.state ConfigRecord: {"historical-divergence": h}
HISTORY = "historical-divergence"
LOCAL_LAYERS = "local-layers"  # context.state ArrayRecord: FedBN's client-only entries


def historical_divergence(config: ConfigRecord, state: RecordDict) -> float:
    """The client's own EMA of its divergence, else the server's copy (0.0 if unseen)."""
    own = state.get(SMART_STATE)
    if own is not None:
        return float(own[HISTORY])
    return float(config.get(keys.SMART_CLIENT_DIVERGENCE, 0.0))


def effective_mu(config: ConfigRecord, state: RecordDict) -> float:
    """The proximal weight to train with: ``proximal-mu``, adapted under SmartFedProx."""
    base = float(config.get(keys.PROXIMAL_MU, 0.0))
    if not config.get(keys.SMART_ADAPTIVE_MU, False):
        return base
    return adaptive_mu(
        base_mu=base,
        historical_divergence=historical_divergence(config, state),
        global_avg_divergence=float(config[keys.SMART_GLOBAL_DIVERGENCE]),
        local_epochs=int(config[keys.SMART_LOCAL_EPOCHS]),
        mu_min=float(config[keys.SMART_MU_MIN]),
        mu_max=float(config[keys.SMART_MU_MAX]),
    )


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of the model's parameters (the reference point of divergence)."""
    return [p.detach().clone() for p in model.parameters()]


def divergence_metrics(
    model: torch.nn.Module,
    global_params: list[torch.Tensor],
    mu: float,
    config: ConfigRecord,
    state: RecordDict,
) -> dict[str, float]:
    """``divergence`` and ``effective-mu``; under SmartFedProx also the updated EMA
    ``historical-divergence``, which is stored in ``state``."""
    divergence = model_divergence(list(model.parameters()), global_params)
    metrics = {keys.DIVERGENCE: divergence, keys.EFFECTIVE_MU: mu}
    if keys.SMART_EMA_ALPHA in config:
        alpha = float(config[keys.SMART_EMA_ALPHA])
        history = ema(historical_divergence(config, state), divergence, alpha)
        state[SMART_STATE] = ConfigRecord({HISTORY: history})
        metrics[keys.HISTORICAL_DIVERGENCE] = history
    return metrics


def restore_local_layers(model: torch.nn.Module, names: tuple[str, ...], state: RecordDict):
    """Overwrite ``names`` in ``model`` with the client's own copies, once it has some."""
    saved = state.get(LOCAL_LAYERS)
    if names and saved is not None:
        model.load_state_dict(saved.to_torch_state_dict(), strict=False)


def keep_local_layers(model: torch.nn.Module, names: tuple[str, ...], state: RecordDict):
    """Store ``names`` of the trained ``model`` as the client's own copies."""
    if names:
        weights = model.state_dict()
        state[LOCAL_LAYERS] = ArrayRecord(OrderedDict((name, weights[name]) for name in names))
