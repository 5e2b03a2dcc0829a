"""Strategy and privacy registries: ``name -> factory``.

The ServerApp validates ``strategy`` and ``privacy`` against these names and builds
the strategy with :func:`build`. Privacy wrappers take the base strategy and return
a strategy (``"none"`` returns it unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from strategies.local import LocalTraining


@dataclass(frozen=True)
class StrategySettings:
    """What every strategy factory needs, already validated by the ServerApp."""

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    proximal_mu: float


def _sampling(s: StrategySettings) -> dict:
    return {
        "fraction_train": s.fraction_train,
        "fraction_evaluate": s.fraction_evaluate,
        "min_train_nodes": s.min_train_nodes,
        "min_evaluate_nodes": s.min_evaluate_nodes,
        "min_available_nodes": s.min_available_nodes,
    }


STRATEGIES: dict[str, Callable[[StrategySettings], Strategy]] = {
    "fedavg": lambda s: FedAvg(**_sampling(s)),
    "fedprox": lambda s: FedProx(**_sampling(s), proximal_mu=s.proximal_mu),
    "local": lambda s: LocalTraining(**_sampling(s)),
}

PRIVACY: dict[str, Callable[[Strategy, StrategySettings], Strategy]] = {
    "none": lambda strategy, _settings: strategy,
}


def build(strategy: str, privacy: str, settings: StrategySettings) -> Strategy:
    """Build the base strategy ``strategy`` wrapped by the privacy strategy ``privacy``."""
    base = STRATEGIES[strategy](settings)
    return PRIVACY[privacy](base, settings)
