"""Tasks: one module per learning task, usable with or without Flower.

``get(name)`` returns the task class; ``build(run_config)`` builds the configured one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.base import Task
from tasks.finance import FinanceTask
from tasks.lunar_lander import LunarLanderTask
from tasks.movielens import MovieLensTask
from tasks.options import ConfigError
from tasks.vision import CIFAR10Task, DigitsTask, EMNISTTask, MNISTTask

REGISTRY: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        DigitsTask,
        MNISTTask,
        CIFAR10Task,
        EMNISTTask,
        LunarLanderTask,
        FinanceTask,
        MovieLensTask,
    )
}


def get(name: str) -> type[Task]:
    """Return the task class registered under ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"'task' = {name!r} is not valid; valid values: "
            + ", ".join(repr(n) for n in REGISTRY)
        ) from None


def build(run_config: Mapping[str, Any]) -> Task:
    """Build the task named by ``run_config["task"]`` with its options parsed."""
    return get(run_config["task"])(run_config)
