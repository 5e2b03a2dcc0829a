"""Federated evaluation in partition order, written once for the strategies that sample
their own nodes (SmartFedProx, hierarchical FedAvg, clustered FedAvg).

A seeded FedAvg-sized sample of the connected nodes evaluates the model, and the replies
are aggregated in partition order, so the metrics do not depend on the node ids Flower
hands out or on the order replies arrive in.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from protocol import keys
from strategies.runtime.partitions import PartitionMap, seeded_sample


class PartitionOrderedEvaluation:
    """``configure_evaluate`` / ``aggregate_evaluate`` for a strategy with ``partitions``,
    ``rng``, ``fraction_evaluate`` and ``min_evaluate_nodes``.

    Hooks: :meth:`evaluation_nodes` (the connected nodes, or None to skip the round),
    :meth:`evaluation_rng`, :meth:`evaluation_messages` (what each picked node
    evaluates; default: the global model with the round in its config) and
    :meth:`evaluation_metrics` (default: the next class's ``aggregate_evaluate``, e.g.
    FedAvg's weighted mean).
    """

    partitions: PartitionMap
    rng: np.random.Generator
    fraction_evaluate: float
    min_evaluate_nodes: int

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The evaluation round: a seeded sample of the connected nodes."""
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.evaluation_nodes(grid)
        if nodes is None:
            return []
        picked = seeded_sample(
            nodes,
            self.fraction_evaluate,
            self.min_evaluate_nodes,
            self.evaluation_rng(),
            self.partitions,
        )
        return self.evaluation_messages(picked, arrays, config, server_round)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The evaluation metrics, the replies taken in partition order."""
        return self.evaluation_metrics(server_round, self.partitions.sort_replies(replies))

    # -- hooks --------------------------------------------------------------------------
    def evaluation_nodes(self, grid: Grid) -> list[int] | None:
        """The connected nodes to sample from; None: no evaluation this round."""
        raise NotImplementedError

    def evaluation_rng(self) -> np.random.Generator:
        """The generator the sample is drawn with."""
        return self.rng

    def evaluation_messages(
        self, nodes: list[int], arrays: ArrayRecord, config: ConfigRecord, server_round: int
    ) -> list[Message]:
        """One evaluate message per node: ``arrays`` and ``config`` with the round."""
        return [evaluate_message(node, arrays, config, server_round) for node in nodes]

    def evaluation_metrics(self, server_round: int, replies: list[Message]) -> MetricRecord | None:
        """The aggregated metrics of the (partition-ordered) replies."""
        return super().aggregate_evaluate(server_round, replies)  # type: ignore[misc]


def evaluate_message(
    node: int, arrays: ArrayRecord, config: ConfigRecord, server_round: int
) -> Message:
    """An evaluate message for ``node`` with its own ConfigRecord (``config`` + round)."""
    own = ConfigRecord({**config, keys.SERVER_ROUND: server_round})
    return Message(
        content=RecordDict({keys.ARRAYS: arrays, keys.CONFIG: own}),
        message_type=MessageType.EVALUATE,
        dst_node_id=node,
        group_id=str(server_round),
    )
