"""Which edge each SuperNode belongs to in hierarchical FL: the edge query and its answers.

Edges are logical groups of SuperNodes kept by the server (HierFL, Liu et al. 2020). A
node not registered yet is asked once, with a ``query.edge`` message, for its edge id,
partition id and training-example count; a node whose answer is missing or invalid is
asked again in the next round. :class:`EdgeMembership` keeps the answers (not carried by
a checkpoint: node ids change on resume) and fills the run's partition map with them.
"""

from __future__ import annotations

import math
from logging import INFO, WARNING
from typing import NamedTuple

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from protocol import keys
from protocol.records import InvalidReply
from protocol.replies import is_number, metrics_of
from strategies.runtime.messaging import send_and_receive, size_screen
from strategies.runtime.partitions import PartitionMap

QUERY_TYPE = f"{MessageType.QUERY}.{keys.HIER_QUERY}"  # "query.edge"


class Registration(NamedTuple):
    """A node's answer to the edge query."""

    edge: int
    partition: int
    num_examples: int


def integer_metric(metrics: MetricRecord, key: str, low: int, high: float = math.inf) -> int:
    """``metrics[key]`` as an int in ``[low, high)``, or InvalidReply naming the key."""
    value = metrics.get(key)
    integral = is_number(value) and math.isfinite(value) and value == int(value)
    if not (integral and is_number(value) and low <= value < high):
        raise InvalidReply(f"'{key}' = {value!r} is not an integer in [{low}, {high})")
    return int(value)


def registration_of(reply: Message | None, num_edges: int) -> Registration:
    """The edge query reply's registration, or InvalidReply (none, error, bad values)."""
    if reply is None:
        raise InvalidReply("no reply to the edge query")
    if reply.has_error():
        raise InvalidReply(f"error reply: {reply.error.reason}")
    metrics = metrics_of(reply)
    return Registration(
        integer_metric(metrics, keys.EDGE_ID, 0, num_edges),
        integer_metric(metrics, keys.PARTITION_ID, 0),
        integer_metric(metrics, keys.NUM_EXAMPLES, 0),
    )


class EdgeMembership:
    """The registered nodes' edges, partitions and example counts (see the module
    docstring); ``query_config``: extra entries of the edge query's config."""

    def __init__(self, num_edges: int, partitions: PartitionMap, timeout: float) -> None:
        self.num_edges, self.partitions, self.timeout = num_edges, partitions, timeout
        self.registrations: dict[int, Registration] = {}  # node -> its query answer
        self.query_config: dict = {}

    def members(self) -> dict[int, list[int]]:
        """Edge id -> the registered node ids of that edge (sorted; every edge listed)."""
        members: dict[int, list[int]] = {e: [] for e in range(self.num_edges)}
        for node, registration in sorted(self.registrations.items()):
            members[registration.edge].append(node)
        return members

    def table(self) -> list[dict]:
        """``edge-membership.csv``: every registered node's edge, partition and examples."""
        return [
            {"node-id": node, "edge-id": r.edge, "partition-id": r.partition,
             "num-examples": r.num_examples}
            for node, r in sorted(self.registrations.items())
        ]  # fmt: skip

    def register(self, server_round: int, nodes: list[int], grid: Grid) -> int:
        """Query the unregistered ``nodes`` for their edge; return how many failed."""
        unknown = [n for n in nodes if n not in self.registrations]
        if not unknown:
            return 0
        config = {keys.SERVER_ROUND: server_round, keys.NUM_EDGES: self.num_edges}
        content = RecordDict({keys.CONFIG: ConfigRecord({**config, **self.query_config})})
        queries = [
            Message(content, dst_node_id=n, message_type=QUERY_TYPE, group_id=str(server_round))
            for n in unknown
        ]
        replies: dict[int, Message] = {}
        screen = size_screen(queries)
        for reply in send_and_receive(grid, queries, timeout=self.timeout, screen=screen):
            replies.setdefault(int(reply.metadata.src_node_id), reply)
        failed = 0
        for node in unknown:
            try:
                self.registrations[node] = registration_of(replies.get(node), self.num_edges)
                self.partitions.record(node, self.registrations[node].partition)
            except InvalidReply as err:
                failed += 1
                log(WARNING, "Hierarchical: node %d not registered (asked again): %s", node, err)
        self.partitions.check_unique(nodes)
        sizes = {e: len(m) for e, m in self.members().items()}
        log(INFO, "Hierarchical: %d nodes registered, per edge %s", len(self.registrations), sizes)
        return failed
