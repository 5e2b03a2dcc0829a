"""Flower Message-API strategies and privacy wrappers, built by name."""

from strategies.errors import StopTraining
from strategies.registry import PRIVACY, STRATEGIES, StrategySettings, build

__all__ = ["PRIVACY", "STRATEGIES", "StopTraining", "StrategySettings", "build"]
