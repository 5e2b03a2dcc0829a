"""Hand-built Flower messages and grids for strategy and mod tests."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from protocol import keys


class FakeGrid:
    """Just enough of flwr's Grid for configure_train/configure_evaluate."""

    def __init__(self, node_ids):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return list(self.node_ids)


def record(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float64)) for k, v in arrays.items()})


def instruction(arrays: dict, config: dict, node_id: int = 1, kind: str = "train") -> Message:
    """A server->client message as configure_train builds it."""
    content = RecordDict({keys.ARRAYS: record(arrays), keys.CONFIG: ConfigRecord(config)})
    return Message(content=content, dst_node_id=node_id, message_type=kind)


def reply_from(node_id: int, arrays: dict | None, metrics: dict, kind: str = "train") -> Message:
    """A client's reply as the server receives it (src_node_id = node_id)."""
    content = RecordDict({keys.METRICS: MetricRecord(metrics)})
    if arrays is not None:
        content[keys.ARRAYS] = record(arrays)
    sent = Message(content=RecordDict(), dst_node_id=node_id, message_type=kind)
    return Message(content, reply_to=sent)


def error_from(node_id: int, reason: str = "boom") -> Message:
    sent = Message(content=RecordDict(), dst_node_id=node_id, message_type="train")
    return Message(Error(code=0, reason=reason), reply_to=sent)


def partition_reply(message: Message, partition_id: int) -> Message:
    """A ClientApp's answer to the ``query.partition`` message (strategies.runtime.partitions)."""
    content = RecordDict({keys.METRICS: MetricRecord({keys.PARTITION_ID: partition_id})})
    return Message(content, reply_to=message)
