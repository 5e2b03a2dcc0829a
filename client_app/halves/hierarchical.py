"""Hierarchical FL (edge and cloud aggregation), client half.

A node tells the server its edge (:func:`edge_reply`); each edge aggregation k of a
cloud round trains ``local-updates`` iterations on a seed of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from client_app.halves import ClientHalf, Round
from client_app.node import node_partition, setup
from protocol import keys
from tasks.topology import edge_of


def edge_id(
    node_config: Mapping[str, Any], partition_id: int, num_partitions: int, num_edges: int
):
    """The SuperNode's ``edge-id`` if it was started with one, else its partition's."""
    if keys.EDGE_ID in node_config:
        edge = int(node_config[keys.EDGE_ID])
        if not 0 <= edge < num_edges:
            raise ValueError(
                f"node config 'edge-id' = {edge} is not in [0, hier.num-edges = {num_edges})"
            )
        return edge
    return edge_of(partition_id, num_partitions, num_edges)


def edge_reply(msg: Message, context: Context) -> Message:
    """This node's edge, partition and training size (the server's edge query)."""
    task, _, partition, pid = setup(context)
    _, num = node_partition(context.node_config)
    num_edges = int(msg.content[keys.CONFIG][keys.NUM_EDGES])
    metrics = {
        keys.EDGE_ID: edge_id(context.node_config, pid, num, num_edges),
        keys.PARTITION_ID: pid,
        keys.NUM_EXAMPLES: task.train_size(partition),
    }
    return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


class HierarchicalHalf(ClientHalf):
    """An independent seed per edge aggregation; ``local-updates`` iterations (tau_1)."""

    def seed_entropy(self, config: ConfigRecord) -> tuple[int, ...]:
        return (int(config[keys.EDGE_ROUND]),) if keys.EDGE_ROUND in config else ()

    def training(self, r: Round) -> dict:
        if keys.LOCAL_UPDATES not in r.config:
            return {}
        return {"local_updates": int(r.config[keys.LOCAL_UPDATES])}
