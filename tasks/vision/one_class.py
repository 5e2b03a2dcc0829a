"""The ``one-class`` partitioner: flwr-datasets' interface over
``tasks.vision.one_class_split.one_class_partition`` (kept apart so that importing
the partitioning module does not import flwr-datasets)."""

from __future__ import annotations

import datasets
import numpy as np
from flwr_datasets.partitioner.partitioner import Partitioner

from tasks.vision.one_class_split import one_class_partition


class OneClassPartitioner(Partitioner):
    """flwr-datasets wrapper of ``one_class_partition`` (one class per client).

    Parameters
    ----------
    num_partitions : int
        Number of clients.
    partition_by : str
        Label column.
    num_edges : int
        Number of edges (``hier.num-edges``).
    edge_iid : bool
        ``vision.edge-iid``.
    seed : int
        Seed of the class order and the per-class splits.
    """

    def __init__(
        self, num_partitions: int, partition_by: str, num_edges: int, edge_iid: bool, seed: int
    ) -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._partition_by = partition_by
        self._num_edges = num_edges
        self._edge_iid = edge_iid
        self._seed = seed
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return self._num_partitions

    def partition_indices(self) -> list[np.ndarray]:
        """Row indices of every partition (computed once)."""
        if self._indices is None:
            labels = np.asarray(self.dataset[self._partition_by])
            self._indices = one_class_partition(
                labels,
                self._num_partitions,
                self._num_edges,
                self._edge_iid,
                np.random.default_rng(self._seed),
            )
        return self._indices

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """Partition ``partition_id``: the rows of its single class."""
        return self.dataset.select(self.partition_indices()[partition_id])
