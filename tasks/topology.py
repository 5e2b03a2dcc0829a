"""Client-to-edge topology of hierarchical federated learning (client -> edge -> cloud).

The clients (partitions ``0 .. n-1``) are grouped into ``E`` edges (run-config key
``hier.num-edges``) in contiguous blocks: edge ``e`` holds the partitions
``[floor(e n / E), floor((e + 1) n / E))``, so edge sizes differ by at most one and
every partition lies in exactly one edge. frontloaded-dp-hfl (after HierFL,
Liu et al., 2020, "Client-Edge-Cloud Hierarchical Federated Learning") draws the
members of each edge at random; here the assignment is a pure function of the ids, so
every process (ServerApp, each ClientApp, partitioning) derives the same one without
communication. Data heterogeneity across edges is the partitioner's job (see the
``one-class`` mode of ``tasks.vision.partitioning``).

Pure Python: no numpy, torch or Flower.
"""

from __future__ import annotations

NUM_EDGES_KEY = "hier.num-edges"


def check_num_edges(num_partitions: int, num_edges: int) -> None:
    """Raise ValueError unless ``1 <= num_edges <= num_partitions``.

    Parameters
    ----------
    num_partitions : int
        Number of clients (partitions), at least 1.
    num_edges : int
        Number of edges (``hier.num-edges``).
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if isinstance(num_edges, bool) or not isinstance(num_edges, int):
        raise ValueError(f"'{NUM_EDGES_KEY}' must be an integer, got {num_edges!r}")
    if not 1 <= num_edges <= num_partitions:
        raise ValueError(
            f"'{NUM_EDGES_KEY}' = {num_edges} is out of range for {num_partitions} "
            f"partitions; valid range: [1, {num_partitions}]"
        )


def edge_start(edge: int, num_partitions: int, num_edges: int) -> int:
    """First partition id of ``edge``: ``floor(edge * num_partitions / num_edges)``."""
    return edge * num_partitions // num_edges


def edge_of(partition_id: int, num_partitions: int, num_edges: int) -> int:
    """The edge that holds ``partition_id``.

    Parameters
    ----------
    partition_id : int
        Client id in ``[0, num_partitions)``.
    num_partitions : int
        Number of clients.
    num_edges : int
        Number of edges (``hier.num-edges``), in ``[1, num_partitions]``.

    Returns
    -------
    int
        The edge ``e`` with ``floor(e n / E) <= partition_id < floor((e + 1) n / E)``.

    Raises
    ------
    ValueError
        If ``num_edges`` or ``partition_id`` is out of range.
    """
    check_num_edges(num_partitions, num_edges)
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} not in [0, {num_partitions})")
    # The largest e with floor(e n / E) <= p is floor(((p + 1) E - 1) / n).
    return ((partition_id + 1) * num_edges - 1) // num_partitions


def edge_members(num_partitions: int, num_edges: int) -> list[list[int]]:
    """The partition ids of every edge, in edge order.

    Parameters
    ----------
    num_partitions : int
        Number of clients.
    num_edges : int
        Number of edges (``hier.num-edges``), in ``[1, num_partitions]``.

    Returns
    -------
    list of list of int
        ``members[e]`` is the contiguous, ascending block of edge ``e``.
    """
    check_num_edges(num_partitions, num_edges)
    return [
        list(
            range(
                edge_start(e, num_partitions, num_edges),
                edge_start(e + 1, num_partitions, num_edges),
            )
        )
        for e in range(num_edges)
    ]
