"""Run-config keys of earlier versions that a later name replaces, refused by name.

Every key is ``PREFIX.field-name`` of the settings class that declares it; the image
tasks' keys were once ``data.*``, ``model.name`` and ``train.*``, and the lunar
lander's learning rates ``ppo.learning-rate*``. A run-config, preset or study naming
an old key stops before any work with one line naming the new one
(:func:`renamed_message`), rather than the generic unknown-key error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

# old key -> the key that replaced it
RENAMED_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "data.partitioner": "vision.partitioner",
        "data.alpha": "vision.alpha",
        "data.classes-per-client": "vision.classes-per-client",
        "data.edge-iid": "vision.edge-iid",
        "data.test-fraction": "vision.test-fraction",
        "data.normalize": "vision.normalize",
        "data.central-test-fraction": "vision.central-test-fraction",
        "data.batch-size": "vision.batch-size",
        "data.groups": "vision.grouping",
        "data.group-keep": "vision.group-keep",
        "model.name": "vision.model",
        "train.local-epochs": "vision.local-epochs",
        "train.lr": "vision.lr",
        "train.momentum": "vision.momentum",
        "train.weight-decay": "vision.weight-decay",
        "train.lr-decay": "vision.lr-decay",
        "train.lr-decay-epochs": "vision.lr-decay-epochs",
        "train.deterministic": "vision.deterministic",
        "train.device": "vision.device",
        "ppo.learning-rate": "ppo.lr",
        "ppo.learning-rate-moon": "ppo.lr-moon",
        "ppo.learning-rate-earth": "ppo.lr-earth",
        "ppo.learning-rate-mars": "ppo.lr-mars",
    }
)


def renamed_message(keys: Iterable[str]) -> str | None:
    """``'train.lr' is now 'vision.lr'`` for each renamed key among ``keys`` (sorted,
    ``; ``-joined, one line); None if none is."""
    old = sorted(k for k in set(keys) if k in RENAMED_KEYS)
    if not old:
        return None
    return "; ".join(f"{k!r} is now {RENAMED_KEYS[k]!r}" for k in old)


def current_keys(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """A run-config recorded by an earlier version (a run's ``config.json``) under
    today's key names, so that resuming or comparing it matches key for key."""
    return {RENAMED_KEYS.get(key, key): value for key, value in recorded.items()}
