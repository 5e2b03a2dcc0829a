"""The nodes a round may use: waiting for them, and a grid restricted to a sample."""

from __future__ import annotations

import time
import weakref
from logging import INFO, WARNING
from typing import cast

from flwr.common.logger import log
from flwr.serverapp import Grid

from strategies.errors import StopTraining
from strategies.runtime.partitions import PartitionMap

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
            time.sleep(poll)
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
