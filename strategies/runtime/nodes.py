"""The nodes a round uses: waiting for them, sampling them, and a grid restricted to
a sample.

Every draw is over the nodes' positions in partition order
(:class:`strategies.runtime.partitions.PartitionMap`), so the same generator state picks the
same partitions whatever ids Flower gave their nodes. The generators are the
strategies' own (seeded from the run seed, or secret for DP sampling), advanced draw
by draw from round to round and checkpointed with them.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import cast

import numpy as np
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
