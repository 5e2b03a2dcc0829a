"""Node ids -> partition ids: sampling and summation order independent of node ids.

Flower draws fresh node ids in every simulation run (and a SuperNode gets a new one
when it reconnects), so a sample drawn with a seeded generator over sorted *node ids*
picks different clients, and a sum in node-id order adds in a different order, from
run to run. Every strategy here therefore orders nodes by the partition id each
client reports (``node_config["partition-id"]``, what its data is), and only then
samples or sums:

* :meth:`PartitionMap.discover` asks each node it has not seen yet, once, with a
  ``query.partition`` message (the ClientApp answers with ``partition-id``);
* :meth:`PartitionMap.order` sorts node ids by (partition id, node id); nodes that did
  not answer come last, by node id (such a run is reproducible only as far as node ids
  are);
* :meth:`PartitionMap.sort_replies` puts replies in that order before anything is summed;
* :meth:`PartitionMap.check_unique` stops the run when two connected nodes report one
  partition.

One :class:`PartitionMap` serves one run: the base strategy makes it, the wrappers
around it share it (:class:`strategies.base.TrainingWrapper`), and the ServerApp
reads it as ``strategy.partitions``.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log

from protocol import keys
from strategies.errors import DuplicatePartitionError
from strategies.messaging import send_and_receive

QUERY_TYPE = f"{MessageType.QUERY}.{keys.PARTITION_QUERY}"  # "query.partition"


class PartitionMap:
    """Node id -> partition id of one run, learnt from the nodes (module docstring)."""

    def __init__(self) -> None:
        self._partition: dict[int, int] = {}  # node id -> partition id
        self._num_partitions: dict[int, int] = {}  # node id -> the num-partitions it names
        self._errors: dict[int, str] = {}  # node id -> why its partition query failed
        self._asked: set[int] = set()  # nodes already asked (answered or not)

    def num_partitions_of(self, node_id: int) -> int | None:
        """The ``num-partitions`` ``node_id``'s node config names, or None."""
        return self._num_partitions.get(int(node_id))

    def query_error(self, node_id: int) -> str | None:
        """Why ``node_id``'s partition query failed (its ClientApp's error), or None."""
        return self._errors.get(int(node_id))

    def partition_of(self, node_id: int) -> int | None:
        """The partition id ``node_id`` reported, or None."""
        return self._partition.get(int(node_id))

    def record(self, node_id: int, partition_id: int) -> None:
        """Learn ``node_id``'s partition from a reply that carries it (e.g. an edge query)."""
        self._partition[int(node_id)] = int(partition_id)
        self._asked.add(int(node_id))

    def discover(self, grid, node_ids: Iterable[int], *, timeout: float) -> None:
        """Ask every node not asked before for its partition id (one message each, once).

        A node that fails, does not answer within ``timeout`` or sends no valid
        ``partition-id`` is ordered by its node id; a warning names how many.
        """
        unknown = sorted(int(n) for n in node_ids if int(n) not in self._asked)
        if not unknown or not hasattr(grid, "send_and_receive"):
            return
        queries = [
            Message(
                content=RecordDict({keys.CONFIG: ConfigRecord({})}),
                dst_node_id=node,
                message_type=QUERY_TYPE,
            )
            for node in unknown
        ]
        self._asked.update(unknown)
        for reply in send_and_receive(grid, queries, timeout=timeout):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                self._errors[node] = reply.error.reason
                continue
            metrics = reply.content.get(keys.METRICS)
            value = None if metrics is None else metrics.get(keys.PARTITION_ID)
            if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
                self._partition[node] = int(value)
            num = None if metrics is None else metrics.get(keys.NUM_PARTITIONS)
            if isinstance(num, int | float) and not isinstance(num, bool):
                self._num_partitions[node] = int(num)
        missing = [n for n in unknown if n not in self._partition]
        if missing:
            log(
                WARNING,
                "%d node(s) reported no partition id; they are ordered by node id, so runs "
                "are reproducible only if their node ids are the same",
                len(missing),
            )
        self.check_unique(node_ids)

    def check_unique(self, node_ids: Iterable[int]) -> None:
        """Raise :class:`DuplicatePartitionError` if two of ``node_ids`` report one partition.

        Each partition is one unit of privacy (one client's data): two nodes serving it
        would have it sampled, trained on and counted twice, which no sampling
        probability or per-client composition the ledger uses allows for. Only connected
        nodes count (a SuperNode that reconnects gets a new id; its old one is gone)."""
        claimed: dict[int, list[int]] = {}
        for node in sorted({int(n) for n in node_ids}):
            if node in self._partition:
                claimed.setdefault(self._partition[node], []).append(node)
        shared = {p: nodes for p, nodes in claimed.items() if len(nodes) > 1}
        if shared:
            named = "; ".join(
                f"nodes {', '.join(map(str, nodes))} all report partition-id {p}"
                for p, nodes in sorted(shared.items())
            )
            raise DuplicatePartitionError(
                f"{named}. Give every SuperNode its own partition-id (node config "
                "'partition-id=<i> num-partitions=<n>')"
            )

    def client_name(self, node_id: int) -> str:
        """The unit of privacy a node stands for: its partition (``partition-3``), which a
        SuperNode keeps across reconnects and resumed runs, or ``node-<id>``."""
        partition = self.partition_of(node_id)
        return f"partition-{partition}" if partition is not None else f"node-{node_id}"

    def sort_key(self, node_id: int) -> tuple[int, int, int]:
        """(0, partition id, node id) for known nodes, (1, 0, node id) for the others."""
        partition = self._partition.get(int(node_id))
        return (0, partition, int(node_id)) if partition is not None else (1, 0, int(node_id))

    def order(self, node_ids: Iterable[int]) -> list[int]:
        """``node_ids`` sorted by partition id (unknown nodes last, by node id)."""
        return sorted((int(n) for n in node_ids), key=self.sort_key)

    def sort_replies(self, replies: Iterable[Message]) -> list[Message]:
        """Replies in partition order of their senders: sums no longer depend on arrival."""
        return sorted(replies, key=lambda m: self.sort_key(m.metadata.src_node_id))


def partition_map(strategy: object) -> PartitionMap:
    """The run's map: ``partitions`` of the outermost layer of ``strategy``'s chain of
    wrappers (``.strategy``) that has one; a new, empty map if none has (e.g. a bare
    Flower strategy)."""
    layer = strategy
    while layer is not None:
        found = getattr(layer, "partitions", None)
        if isinstance(found, PartitionMap):
            return found
        layer = getattr(layer, "strategy", None)
    return PartitionMap()
