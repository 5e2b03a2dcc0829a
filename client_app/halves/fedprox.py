"""FedProx and SmartFedProx, client half: the proximal weight and the divergence.

Every train reply carries ``divergence`` (‖w_local − w_global‖) and ``effective-mu``
whatever the strategy, so that FedAvg, FedProx and SmartFedProx runs compare on the
same plots. Under SmartFedProx with ``smart-adaptive-mu`` the client adapts μ
(:func:`tasks.adaptive_mu.adaptive_mu`) from an EMA of its own divergence kept in
``context.state``, starting from the server's copy (``smart-client-divergence``).
"""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, RecordDict

from client_app.halves import ClientHalf, Round
from protocol import keys
from tasks.adaptive_mu import adaptive_mu, ema, model_divergence

SMART_STATE = "smart-fedprox"  # context.state ConfigRecord: {"historical-divergence": h}
HISTORY = "historical-divergence"


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


class FedProxHalf(ClientHalf):
    """Trains with the (adapted) proximal weight; replies the divergence it reached."""

    def training(self, r: Round) -> dict:
        r.kept["received"] = parameters(r.model)
        r.kept["mu"] = effective_mu(r.config, r.context.state)
        return {"proximal_mu": r.kept["mu"]}

    def trained(self, r: Round, metrics: dict[str, float]) -> dict[str, float]:
        received, mu = r.kept["received"], r.kept["mu"]
        return divergence_metrics(r.model, received, mu, r.config, r.context.state)
