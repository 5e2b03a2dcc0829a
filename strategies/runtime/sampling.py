"""Client sampling with an explicit generator, over nodes in partition order.

Every draw is over the nodes' positions in partition order
(:class:`strategies.runtime.partitions.PartitionMap`), so the same generator state picks the
same partitions whatever ids Flower gave their nodes. The generators are the
strategies' own (seeded from the run seed, or secret for DP sampling), advanced draw
by draw from round to round and checkpointed with them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from strategies.runtime.partitions import PartitionMap


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
