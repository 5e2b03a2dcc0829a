"""Tasks: one module per learning task, usable with or without Flower.

``get(name)`` returns the task class; ``build(run_config)`` builds the configured one.
The task modules (and PyTorch) load on first use of the registry or a task class, so
that ``config.options`` alone is cheap (``python -m lab check`` validates values with it
before anything heavy loads).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any

from config.app import TASK
from config.options import ConfigError

if TYPE_CHECKING:
    from tasks.base import Task

# Task name -> (module, class), in the registry's order: ``get`` imports only the
# module of the task it is asked for (a ClientApp of digits never loads PPO's
# stable-baselines3 and gymnasium). tests/tasks/test_registry.py checks each entry
# against its class's ``name``.
_TASKS = {
    "digits": ("tasks.vision", "DigitsTask"),
    "mnist": ("tasks.vision", "MNISTTask"),
    "cifar10": ("tasks.vision", "CIFAR10Task"),
    "emnist": ("tasks.vision", "EMNISTTask"),
    "lunar-lander": ("tasks.lunar_lander", "LunarLanderTask"),
    "finance": ("tasks.finance", "FinanceTask"),
    "movielens": ("tasks.movielens", "MovieLensTask"),
}
# Class name -> module (Task: the base class, not registered).
_CLASSES = {"Task": "tasks.base", **{cls: module for module, cls in _TASKS.values()}}
__all__ = ["REGISTRY", "ConfigError", "build", "get", *_CLASSES]
_registry: dict[str, type[Task]] = {}  # the tasks imported so far


def _load_registry() -> dict[str, type[Task]]:
    return {name: get(name) for name in _TASKS}


def __getattr__(name: str) -> Any:
    """``REGISTRY`` and the task classes, imported on first use (PEP 562)."""
    if name == "REGISTRY":
        return _load_registry()
    if name in _CLASSES:
        return getattr(import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")


def get(name: str) -> type[Task]:
    """Return the task class registered under ``name`` (importing only its module)."""
    if name not in _registry:
        if name not in _TASKS:
            raise ConfigError(
                f"'task' = {name!r} is not valid; valid values: "
                + ", ".join(repr(n) for n in _TASKS)
            )
        module, cls = _TASKS[name]
        _registry[name] = getattr(import_module(module), cls)
    return _registry[name]


def build(run_config: Mapping[str, Any]) -> Task:
    """Build the task named by the run-config's ``task`` with its options parsed."""
    return get(str(TASK.read(run_config)))(run_config)
