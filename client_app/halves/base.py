"""The hooks an algorithm's client half may fill in, and the message they act on.

Every hook's default does nothing, so a half overrides only what its algorithm
changes; the ClientApp calls them in table order (:data:`client_app.app.HALVES`, which
also says when each half runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from protocol import keys
from tasks.base import LocalTraining, Task


@dataclass
class Round:
    """One message on this node: the task, its model (weights loaded), the partition."""

    msg: Message
    context: Context
    task: Task
    model: torch.nn.Module
    partition: Any
    pid: int
    kept: dict[str, Any] = field(default_factory=dict)  # a half's values between hooks

    @property
    def config(self) -> ConfigRecord:
        return self.msg.content[keys.CONFIG]


class ClientHalf:
    """One algorithm's client half: hooks around the task's train and evaluate."""

    def without_training(self, msg: Message, context: Context) -> Message | None:
        """A train reply that needs no training (None: train)."""
        return None

    def weights(self, arrays: ArrayRecord, config: ConfigRecord, context: Context):
        """The weights to load instead of the received ``arrays``."""
        return arrays

    def loaded(self, r: Round) -> None:
        """After the weights are loaded into ``r.model``."""

    def seed_entropy(self, config: ConfigRecord) -> tuple[int, ...]:
        """More entropy for this training's local seed (independent streams)."""
        return ()

    def training(self, r: Round) -> dict[str, Any]:
        """Fields of :class:`tasks.base.LocalTraining` this algorithm sets."""
        return {}

    def trained(self, r: Round, metrics: dict[str, float]) -> dict[str, float]:
        """After training (before the state is saved): metrics to add to the reply."""
        return {}

    def reply(self, r: Round, metrics: dict[str, float], local: LocalTraining):
        """The train reply this algorithm sends instead of the trained model (or None)."""
        return None

    def evaluated(self, r: Round, metrics: dict[str, float]) -> None:
        """After evaluation: change the reply's metrics in place."""
