"""Node ids -> partition ids, and the nodes a round uses: sampling and summation order
independent of node ids.

A :class:`PartitionMap` learns which partition each node holds. Every draw of the
round's nodes (waiting for them, sampling them, a grid restricted to a sample) is over
the nodes' positions in partition order, so the same generator state picks the same
partitions whatever ids Flower gave their nodes. The generators are the strategies' own
(seeded from the run seed, or secret for DP sampling), advanced draw by draw from round
to round and checkpointed with them.

Design notes: ``docs/notes.md``, ``strategies.runtime.partitions``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from protocol import keys
from protocol.replies import MAX_NUM_EXAMPLES
from strategies.errors import DuplicatePartitionError, StopTraining
from strategies.runtime.messaging import is_simulation_grid, send_and_receive, size_screen

QUERY_TYPE = f"{MessageType.QUERY}.{keys.PARTITION_QUERY}"  # "query.partition"
SPOT_CHECKS = 8  # simulation: nodes asked to confirm the registration order


class PartitionMap:
    """Node id -> partition id of one run, learnt from the nodes (module docstring)."""

    def __init__(self) -> None:
        self._partition: dict[int, int] = {}  # node id -> partition id
        self._num_partitions: dict[int, int] = {}  # node id -> the num-partitions it names
        self._errors: dict[int, str | None] = {}  # node id -> why its partition query failed
        self._asked: set[int] = set()  # nodes already asked (answered or not)
        self._size: dict[int, int] = {}  # node id -> training examples it reported at start-up
        self._notes: dict[int, str] = {}  # this round: node id -> what became of its reply

    def size_of(self, node_id: int) -> int | None:
        """The training-set size ``node_id`` reported before round 1 (a partition query
        or an edge query answer with ``num-examples``), or None: the most its replies
        may weigh."""
        return self._size.get(int(node_id))

    def record_size(self, node_id: int, size: int) -> None:
        """Learn ``node_id``'s training-set size (see :meth:`size_of`)."""
        self._size[int(node_id)] = int(size)

    def note(self, node_id: int, what: str) -> None:
        """Note what became of ``node_id``'s reply this round ("": aggregated as sent;
        else ``"rejected: <reason>"``, a clipped weight, a reply a robust rule left
        out). The ServerApp's participation record takes the notes (:meth:`take_notes`)."""
        node = int(node_id)
        if what and self._notes.get(node):
            what = f"{self._notes[node]}; {what}"
        self._notes[node] = what or self._notes.get(node, "")

    def take_notes(self) -> dict[int, str]:
        """The round's notes (:meth:`note`), cleared."""
        notes, self._notes = self._notes, {}
        return notes

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
        """Learn the partition id of every node not asked before (once per node).

        In a simulation the ids come from the order Flower registered its virtual
        SuperNodes in, spot-checked on a few nodes (:meth:`_from_registration`); otherwise
        every such node is asked, one message each. A node that fails, does not answer
        within ``timeout`` or sends no valid ``partition-id`` is ordered by its node id;
        a warning names how many.
        """
        unknown = sorted(int(n) for n in node_ids if int(n) not in self._asked)
        if not unknown or not hasattr(grid, "send_and_receive"):
            return
        if not self._from_registration(grid, unknown, timeout):
            self._query(grid, unknown, timeout)
        missing = [n for n in unknown if n not in self._partition]
        if missing:
            log(
                WARNING,
                "%d node(s) reported no partition id; they are ordered by node id, so runs "
                "are reproducible only if their node ids are the same",
                len(missing),
            )
        self.check_unique(node_ids)

    def _query(self, grid, nodes: list[int], timeout: float) -> dict[int, int]:
        """Ask ``nodes`` for their partition ids (one ``query.partition`` message each);
        return what each answered."""
        queries = [
            Message(
                content=RecordDict({keys.CONFIG: ConfigRecord({})}),
                dst_node_id=node,
                message_type=QUERY_TYPE,
            )
            for node in nodes
        ]
        self._asked.update(nodes)
        answered = {}
        screen = size_screen(queries)
        for reply in send_and_receive(grid, queries, timeout=timeout, screen=screen):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                self._errors[node] = reply.error.reason
                continue
            metrics = reply.content.get(keys.METRICS)
            value = None if metrics is None else metrics.get(keys.PARTITION_ID)
            if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
                self._partition[node] = answered[node] = int(value)
            num = None if metrics is None else metrics.get(keys.NUM_PARTITIONS)
            if isinstance(num, int | float) and not isinstance(num, bool):
                self._num_partitions[node] = int(num)
            size = None if metrics is None else metrics.get(keys.NUM_EXAMPLES)
            if isinstance(size, int | float) and not isinstance(size, bool):
                if size == int(size) and 0 <= size <= MAX_NUM_EXAMPLES:
                    self._size[node] = int(size)
                else:
                    log(
                        WARNING,
                        "node %d: partition size %r ignored (not an integer in [0, %d])",
                        node,
                        size,
                        MAX_NUM_EXAMPLES,
                    )
        return answered

    def _from_registration(self, grid, unknown: list[int], timeout: float) -> bool:
        """In a Flower simulation, take each node's partition id from the order the
        simulation registered its virtual SuperNodes in, and check it on a few of them;
        return whether it held (else nothing is kept and every node is asked).

        Flower 1.41's simulation registers its N nodes one after the other and gives the
        i-th ``partition-id = i`` and ``num-partitions = N``
        (``flwr/server/superlink/fleet/vce/vce_api.py``, ``_register_nodes``); its
        in-memory LinkState lists nodes in that order. Reading it replaces N query
        messages, which Flower's simulation engine delivers at a cost that grows as N²
        (8 s of a 1 000-node run's start-up; ``bench/vs_flower.py``).
        :data:`SPOT_CHECKS` nodes spread over the order are still asked: an engine that
        numbers its nodes otherwise fails the check, and then every node is asked as on
        a deployment. In a simulation no two nodes share a
        partition, so nothing :meth:`check_unique` would catch is skipped.
        """
        order = _registration_order(grid)
        if order is None or not set(unknown) <= set(order):
            return False
        wanted = set(unknown)
        assumed = {node: index for index, node in enumerate(order) if node in wanted}
        step = max(1, len(unknown) // SPOT_CHECKS)
        checked = unknown[::step][:SPOT_CHECKS]
        answered = self._query(grid, checked, timeout)
        sizes = {self._num_partitions.get(node) for node in answered}
        if any(answered.get(n) != assumed[n] for n in checked) or sizes != {len(order)}:
            log(
                WARNING,
                "the simulation's node order does not give the partition ids (%d of %d "
                "spot-checked nodes differ); asking every node",
                sum(answered.get(n) != assumed[n] for n in checked),
                len(checked),
            )
            self._asked.difference_update(checked)
            return False
        self._asked.update(unknown)
        self._partition.update(assumed)
        self._num_partitions.update(dict.fromkeys(assumed, len(order)))
        log(
            INFO,
            "Partition ids of %d nodes from the simulation's registration order (%d asked, "
            "all as registered)",
            len(assumed),
            len(checked),
        )
        return True

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


def _registration_order(grid) -> list[int] | None:
    """The node ids of a Flower simulation in the order it registered them, or None
    (not a simulation, or a LinkState that does not tell)."""
    if not is_simulation_grid(grid):
        return None
    try:
        return [int(info.node_id) for info in grid.state.get_node_info()]
    except (AttributeError, TypeError):
        return None


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


# -- the nodes a round uses: waiting for them, sampling them, a grid of a sample ---
# The run's partition map -> the nodes that were there when a wait ran out short.
_SHORT: weakref.WeakKeyDictionary[PartitionMap, frozenset[int]] = weakref.WeakKeyDictionary()


class GridView:
    """A grid that shows the wrapped strategy only ``node_ids`` (it samples all of them).

    Everything except ``get_node_ids`` is the underlying grid's.
    """

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid = grid
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


def grid_view(grid: Grid, node_ids: list[int]) -> Grid:
    """A :class:`GridView`, typed as the ``Grid`` it stands in for."""
    return cast(Grid, GridView(grid, node_ids))


def wait_for_nodes(
    grid: Grid,
    needed: int,
    partitions: PartitionMap,
    *,
    timeout: float,
    poll: float = 1.0,
    discover: bool = True,
) -> list[int]:
    """The connected node ids, once at least ``needed`` are there or ``timeout`` passed,
    in the run's partition order (``partitions``). ``discover``: ask new nodes for
    their partition id (once); strategies that learn it from their own query
    (hierarchical) pass False.

    A wait that ran out with too few nodes is not repeated while no node has joined
    since: after a SuperNode is lost for good, only the first round waits ``timeout``
    for it (a restarted one rejoins and is sampled from the next round on), not every
    remaining round. The memory is the run's (kept with its ``partitions``)."""
    nodes = sorted(grid.get_node_ids())
    short = _SHORT.get(partitions)
    if len(nodes) < needed and short is not None and set(nodes) <= short:
        log(
            INFO,
            "%d node(s) connected, %d needed: no node joined since a wait of "
            "'round-timeout' ended with these, so this one does not wait again",
            len(nodes),
            needed,
        )
    else:
        deadline = time.monotonic() + timeout
        while len(nodes) < needed and time.monotonic() < deadline:
            log(INFO, "Waiting for nodes: %d connected, %d needed", len(nodes), needed)
            time.sleep(max(0.0, min(poll, deadline - time.monotonic())))  # not past it
            nodes = sorted(grid.get_node_ids())
        if len(nodes) < needed:
            _SHORT[partitions] = frozenset(nodes)
        else:
            _SHORT.pop(partitions, None)
    if discover:
        partitions.discover(grid, nodes, timeout=timeout)
    return partitions.order(nodes)


def nodes_for_round(
    grid: Grid,
    partitions: PartitionMap,
    *,
    min_available: int,
    min_sample: int,
    timeout: float,
    discover: bool = True,
) -> list[int]:
    """The nodes a round samples from, in partition order: wait up to ``timeout`` for
    ``min_available`` nodes; then go on with those connected, with a warning, as long
    as at least ``min_sample`` are (a SuperNode that died leaves the survivors); else
    end the run (``StopTraining``) rather than wait forever."""
    nodes = wait_for_nodes(
        grid,
        max(min_available, min_sample),
        partitions,
        timeout=timeout,
        discover=discover,
    )
    if len(nodes) < min_sample:
        raise StopTraining(
            f"{len(nodes)} node(s) connected within 'round-timeout' = {timeout:g} s, the "
            f"round needs at least {min_sample}"
        )
    if len(nodes) < min_available:
        log(
            WARNING,
            "%d node(s) connected within 'round-timeout' = %g s, fewer than "
            "'min-available-nodes' = %d: the round goes on with them",
            len(nodes),
            timeout,
            min_available,
        )
    return nodes


# -- sampling ---------------------------------------------------------------------
def _ordered(node_ids: Iterable[int], partitions: PartitionMap | None) -> list[int]:
    """``node_ids`` in partition order; ascending ids without a map (or for items that
    are not nodes, e.g. edge ids)."""
    if partitions is None:
        return sorted(int(n) for n in node_ids)
    return partitions.order(node_ids)


def sample_uniform(
    node_ids: Iterable[int],
    size: int,
    rng: np.random.Generator,
    partitions: PartitionMap | None = None,
) -> list[int]:
    """``size`` distinct nodes drawn uniformly without replacement, in partition order
    (module docstring); ``partitions`` None: in ascending id order."""
    ordered = _ordered(node_ids, partitions)
    picked = rng.choice(len(ordered), size=size, replace=False)
    return [ordered[i] for i in sorted(picked)]


def poisson_sample(
    node_ids: Iterable[int],
    rate: float,
    rng: np.random.Generator,
    partitions: PartitionMap | None = None,
) -> list[int]:
    """Each node independently with probability ``rate`` (Poisson sampling), in
    partition order; one uniform draw per node, in that order, from ``rng``."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"sampling rate must be in (0, 1], got {rate!r}")
    ordered = _ordered(node_ids, partitions)
    taken = rng.random(len(ordered)) < rate
    return [node for node, take in zip(ordered, taken, strict=True) if take]


def fedavg_sample_size(available: int, fraction: float, minimum: int) -> int:
    """Flower's FedAvg sample size: ``int(available * fraction)``, at least ``minimum``,
    at most ``available``."""
    return min(available, max(int(available * fraction), minimum))


def seeded_sample(
    node_ids: list[int],
    fraction: float,
    minimum: int,
    rng: np.random.Generator,
    partitions: PartitionMap,
) -> list[int]:
    """FedAvg's sample of the connected ``node_ids`` (:func:`fedavg_sample_size`),
    drawn uniformly with the strategy's generator ``rng`` (:func:`sample_uniform`)."""
    size = fedavg_sample_size(len(node_ids), fraction, minimum)
    return sample_uniform(node_ids, size, rng, partitions)


def dp_cohort(
    nodes: list[int],
    expected: int,
    rng: np.random.Generator,
    partitions: PartitionMap | None,
    *,
    poisson: bool,
    uniform: bool,
) -> tuple[list[int] | None, int]:
    """(the nodes a DP wrapper samples, their number): a Poisson sample at rate m/N, or
    exactly m without replacement; None (and m) when the wrapped strategy selects them
    itself (``uniform`` False: data-dependent selection, no amplification claimed)."""
    if poisson:
        picked = poisson_sample(nodes, expected / len(nodes), rng, partitions)
        return picked, len(picked)
    if uniform:
        return sample_uniform(nodes, expected, rng, partitions), expected
    return None, expected
