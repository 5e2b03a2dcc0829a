"""The ``one-class`` split itself: every client one class, classes spread over the edges.

Plain NumPy, apart from both the partitioning module (which re-exports it) and the
flwr-datasets partitioner over it (``tasks.vision.one_class``), so neither imports the
other.
"""

from __future__ import annotations

import warnings

import numpy as np

from tasks.topology import edge_members, edge_start


def edge_classes(
    classes: np.ndarray, edge: int, num_partitions: int, num_edges: int, edge_iid: bool
) -> np.ndarray:
    """The classes dealt to the clients of ``edge`` (in dealing order).

    Edge-iid: all classes. Edge-non-iid: the slice ``[floor(s_e C / n),
    floor(s_{e+1} C / n))`` of ``classes``, ``s_e`` the edge's first partition id: a
    share of the ``C`` classes proportional to the edge's size, at least one class.
    With ``n >= C`` clients, no slice is longer than its edge and the slices cover
    every class; with ``C >= E`` classes, edges share no class.
    """
    if edge_iid:
        return classes
    num_classes = len(classes)
    start = edge_start(edge, num_partitions, num_edges) * num_classes // num_partitions
    stop = edge_start(edge + 1, num_partitions, num_edges) * num_classes // num_partitions
    return classes[start : max(stop, start + 1)]


def one_class_assignment(
    classes: np.ndarray, num_partitions: int, num_edges: int, edge_iid: bool
) -> np.ndarray:
    """The single class of every client: ``assignment[p]`` is client ``p``'s class.

    The ``k``-th client of edge ``e`` gets ``pool[(offset + k) % len(pool)]`` with
    ``pool = edge_classes(...)``. Edge-iid: ``offset`` is the edge's first partition
    id, so client ``p`` gets ``classes[p % C]``: an edge of ``m`` clients covers
    ``min(C, m)`` classes and every class is held by ``floor(n / C)`` or
    ``ceil(n / C)`` clients. Edge-non-iid: ``offset = 0`` within the edge's own slice
    of about ``C / E`` classes, the fewest an edge can cover while every class is
    used (given at least as many clients as classes).
    """
    assignment = np.empty(num_partitions, dtype=classes.dtype)
    for edge, members in enumerate(edge_members(num_partitions, num_edges)):
        pool = edge_classes(classes, edge, num_partitions, num_edges, edge_iid)
        offset = edge_start(edge, num_partitions, num_edges) if edge_iid else 0
        for k, partition_id in enumerate(members):
            assignment[partition_id] = pool[(offset + k) % len(pool)]
    return assignment


def one_class_partition(
    labels: np.ndarray,
    num_partitions: int,
    num_edges: int,
    edge_iid: bool,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Give every client one class; spread the classes over the edges (frontloaded-dp-hfl, -2).

    Classes are dealt by ``one_class_assignment``; a class's examples are split among
    its clients in near-equal parts. A class no client holds is left out, with a warning.

    Parameters
    ----------
    labels : numpy.ndarray
        Label of every example of the pool, shape ``(N,)``.
    num_partitions : int
        Number of clients.
    num_edges : int
        Number of edges (``hier.num-edges``), contiguous blocks of ids.
    edge_iid : bool
        ``vision.edge-iid``: each edge covers as many classes as it can (true) or as few.
    rng : numpy.random.Generator
        Source of the class order and of each class's split.

    Returns
    -------
    list of numpy.ndarray
        Sorted positions into ``labels`` of each partition; disjoint. ValueError if
        ``num_edges`` is out of range or a class has fewer examples than clients.
    """
    labels = np.asarray(labels)
    classes = rng.permutation(np.unique(labels))
    assignment = one_class_assignment(classes, num_partitions, num_edges, edge_iid)
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_partitions
    unused = []
    for label in classes:
        holders = np.flatnonzero(assignment == label)
        examples = rng.permutation(np.flatnonzero(labels == label))
        if len(holders) == 0:
            unused.append(label.item())
            continue
        if len(examples) < len(holders):
            raise ValueError(
                f"class {label!r} has {len(examples)} examples for {len(holders)} clients"
            )
        for partition_id, chunk in zip(
            holders, np.array_split(examples, len(holders)), strict=True
        ):
            parts[partition_id] = np.sort(chunk)
    if unused:
        warnings.warn(
            f"one-class partitioning: classes {sorted(unused)} are held by no client "
            f"({num_partitions} clients); use at least as many clients as classes",
            stacklevel=2,
        )
    return parts
