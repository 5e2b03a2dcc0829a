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

# Class name -> module, in the registry's order (Task: the base class, not registered).
_CLASSES = {
    "Task": "tasks.base",
    "DigitsTask": "tasks.vision",
    "MNISTTask": "tasks.vision",
    "CIFAR10Task": "tasks.vision",
    "EMNISTTask": "tasks.vision",
    "LunarLanderTask": "tasks.lunar_lander",
    "FinanceTask": "tasks.finance",
    "MovieLensTask": "tasks.movielens",
}
__all__ = ["REGISTRY", "ConfigError", "build", "get", *_CLASSES]
_registry: dict[str, type[Task]] = {}


def _load_registry() -> dict[str, type[Task]]:
    if not _registry:
        for name, module in _CLASSES.items():
            if name != "Task":
                cls = getattr(import_module(module), name)
                _registry[cls.name] = cls
    return _registry


def __getattr__(name: str) -> Any:
    """``REGISTRY`` and the task classes, imported on first use (PEP 562)."""
    if name == "REGISTRY":
        return _load_registry()
    if name in _CLASSES:
        return getattr(import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")


def get(name: str) -> type[Task]:
    """Return the task class registered under ``name``."""
    registry = _load_registry()
    try:
        return registry[name]
    except KeyError:
        raise ConfigError(
            f"'task' = {name!r} is not valid; valid values: "
            + ", ".join(repr(n) for n in registry)
        ) from None


def build(run_config: Mapping[str, Any]) -> Task:
    """Build the task named by the run-config's ``task`` with its options parsed."""
    return get(str(TASK.read(run_config)))(run_config)
