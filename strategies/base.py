"""The base of every strategy wrapper: it intercepts only the training half of the
wrapped strategy's rounds and shares the wrapped strategy's partition map."""

from __future__ import annotations

from abc import ABC
from collections.abc import Iterable
from typing import cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from protocol import keys
from strategies.runtime.partitions import PartitionMap


class TrainingWrapper(Strategy, ABC):
    """A strategy around ``self.strategy`` that intercepts only the training half.

    Evaluation is the wrapped strategy's; subclasses implement ``configure_train``,
    ``aggregate_train`` and ``summary`` (ending with ``self.strategy.summary()``).
    ``partitions`` is the wrapped strategy's map (a new one around a strategy without
    one), so that the whole chain orders nodes alike.
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        wrapped = getattr(strategy, "partitions", None)
        self.partitions = wrapped if isinstance(wrapped, PartitionMap) else PartitionMap()

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation round."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's evaluation metrics."""
        return self.strategy.aggregate_evaluate(server_round, replies)


def add_to_config(messages: Iterable[Message], extra: dict) -> list[Message]:
    """Add ``extra`` to the train config of every message (each gets its own record)."""
    messages = list(messages)
    for message in messages:
        message.content[keys.CONFIG] = ConfigRecord(
            {**cast(ConfigRecord, message.content[keys.CONFIG]), **extra}
        )
    return messages
