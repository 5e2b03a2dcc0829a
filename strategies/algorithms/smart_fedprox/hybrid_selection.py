"""SmartFedProx's hybrid client selection ("FedProx with Smart Client Selection",
section 1.4), as pure functions of the nodes' divergence histories and an explicit
generator: rank nodes by smoothed divergence, split them into high / middle / low
thirds, take 30 / 50 / 20 % of the round's clients from them, and fill what a group
cannot give uniformly from the rest."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from strategies.runtime.partitions import PartitionMap, sample_uniform

GROUPS = ("high", "middle", "low")


def smoothed_divergence(history: Sequence[float]) -> float:
    """The SmartFedProx study's smoothed divergence of one node, from its reports d_1..d_t
    (oldest first).

    ``0.5 * d_t + 0.3 * d_{t-1} + 0.2 * mean(d_1..d_{t-2})`` for t >= 3 (section 1.4).
    With fewer reports the weights of the reports there are are renormalised so a
    newcomer is not ranked 20-50 % lower than a veteran with the same divergences:
    t = 2 gives ``5/8 * d_2 + 3/8 * d_1``, t = 1 gives ``d_1``.

    Raises
    ------
    ValueError
        If ``history`` is empty.
    """
    if not history:
        raise ValueError("no divergence reported yet: history is empty")
    if len(history) == 1:
        return float(history[0])
    if len(history) == 2:
        return (5.0 * history[1] + 3.0 * history[0]) / 8.0
    return 0.5 * history[-1] + 0.3 * history[-2] + 0.2 * float(np.mean(history[:-2]))


def fill_unknown(node_ids: Iterable[int], smoothed: dict[int, float]) -> dict[int, float]:
    """The smoothed divergence of every node in ``node_ids``; nodes without one get the
    mean of the known ones among ``node_ids`` (0.0 if none is known)."""
    node_ids = sorted(node_ids)
    known = [smoothed[n] for n in node_ids if n in smoothed]
    mean = float(np.mean(known)) if known else 0.0
    return {n: float(smoothed.get(n, mean)) for n in node_ids}


def hybrid_counts(n: int) -> tuple[int, int, int]:
    """How many of ``n`` come from the high, middle and low groups: round(0.3 n),
    round(0.5 n) (halves rounded up) and the rest."""
    high, middle = (3 * n + 5) // 10, (5 * n + 5) // 10
    return high, middle, n - high - middle


def split_by_divergence(
    values: dict[int, float], rng: np.random.Generator
) -> tuple[list[int], list[int], list[int]]:
    """The nodes sorted by descending divergence, in three equal-as-possible groups
    (high, middle, low; earlier groups take the remainder). Ties are ordered at random."""
    nodes = sorted(values)
    shuffled = [nodes[i] for i in rng.permutation(len(nodes))]
    ranked = sorted(shuffled, key=lambda n: -values[n])  # stable: ties stay shuffled
    # np.array_split's sizes, on a list: node ids are unsigned 64-bit, beyond int64.
    size, extra = divmod(len(ranked), 3)
    ends = np.cumsum([size + (i < extra) for i in range(3)]).tolist()
    return ranked[: ends[0]], ranked[ends[0] : ends[1]], ranked[ends[1] :]


def sample_hybrid_groups(
    node_ids: Iterable[int],
    smoothed: dict[int, float],
    n: int,
    rng: np.random.Generator,
    partitions: PartitionMap | None = None,
) -> dict[int, str]:
    """The SmartFedProx study's hybrid selection (section 1.4): chosen node -> its group.

    Unknown nodes get the mean divergence (:func:`fill_unknown`); the ranked nodes are
    split in three groups (:func:`split_by_divergence`); :func:`hybrid_counts` nodes
    are drawn uniformly from each; a group too small gives all it has and the gap is
    filled uniformly from the nodes not chosen (group ``"fill"``). Uniform draws are
    over partition order (``partitions``; None: ascending node ids).

    Raises
    ------
    ValueError
        If ``n`` is negative or larger than the number of nodes.
    """
    values = fill_unknown(node_ids, smoothed)
    if not 0 <= n <= len(values):
        raise ValueError(f"n = {n} must lie in [0, {len(values)}] (the number of nodes)")
    chosen: dict[int, str] = {}
    groups = split_by_divergence(values, rng)
    for name, members, count in zip(GROUPS, groups, hybrid_counts(n), strict=True):
        for node in sample_uniform(members, min(count, len(members)), rng, partitions):
            chosen[node] = name
    rest = [node for node in values if node not in chosen]
    for node in sample_uniform(rest, n - len(chosen), rng, partitions):
        chosen[node] = "fill"
    return dict(sorted(chosen.items()))


def sample_hybrid(
    node_ids: Iterable[int],
    smoothed: dict[int, float],
    n: int,
    rng: np.random.Generator,
    partitions: PartitionMap | None = None,
) -> list[int]:
    """The ``n`` nodes of :func:`sample_hybrid_groups`, sorted."""
    return list(sample_hybrid_groups(node_ids, smoothed, n, rng, partitions))
