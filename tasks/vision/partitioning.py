"""Federated partitioning of a labelled dataset with flwr-datasets partitioners.

Design notes: ``docs/notes.md``, ``tasks.vision.partitioning``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from config.options import ConfigError
from tasks.vision.one_class_split import (  # noqa: F401 (re-exported)
    edge_classes,
    one_class_assignment,
    one_class_partition,
)

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

PARTITIONERS = (
    "iid", "dirichlet", "pathological", "linear", "square", "exponential", "one-class",
    "array-split",
)  # fmt: skip
# The shared peer workload's split, digits only: the central
# test set of scikit-learn's train_test_split(random_state=0), and the training rows in
# that split's order permuted by numpy's default_rng(0) and cut by np.array_split.
ARRAY_SPLIT_SEED = 0
QUANTITY_SKEW = {  # flwr_datasets.partitioner class names
    "linear": "LinearPartitioner",
    "square": "SquarePartitioner",
    "exponential": "ExponentialPartitioner",
}

# Smallest Dirichlet partition accepted: one local train and one local test example.
DIRICHLET_MIN_PARTITION_SIZE = 2


@dataclass(frozen=True)
class PartitionSettings:
    """How the pool is divided among clients (hashable: a cache key).

    Attributes
    ----------
    partitioner : str
        One of ``PARTITIONERS``.
    alpha : float
        Dirichlet concentration (``dirichlet`` only).
    classes_per_client : int
        Classes per client (``pathological`` only).
    test_fraction : float
        Fraction of each partition held out as the client's local test split.
    seed : int
        Run seed: the pool shuffle, Dirichlet draws, class assignment and local split.
    num_edges : int
        Edges of the hierarchical topology, ``hier.num-edges`` (``one-class`` only).
    edge_iid : bool
        ``vision.edge-iid``: every edge covers all classes (``one-class`` only).
    normalize : bool
        ``vision.normalize``: standardise pixels by the dataset's mean and std (digits;
        false: pixels / 16 only, the peer workload's input).
    """

    partitioner: str = "iid"
    alpha: float = 0.5
    classes_per_client: int = 2
    test_fraction: float = 0.2
    seed: int = 42
    num_edges: int = 1
    edge_iid: bool = True
    normalize: bool = True


def build_partitioner(
    settings: PartitionSettings, num_partitions: int, label_column: str = "label"
) -> Partitioner:
    """Return a fresh (dataset-less) flwr-datasets partitioner for ``settings``.

    Parameters
    ----------
    settings : PartitionSettings
        The partitioning mode and its parameters.
    num_partitions : int
        Number of clients.
    label_column : str
        Column holding the class label (used by label-skew modes).

    Returns
    -------
    Partitioner
        Assign its ``dataset`` (or hand it to ``FederatedDataset``) before use.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    # flwr-datasets (with Hugging Face datasets, and matplotlib for its plots) is
    # imported here, not with the module: a ServerApp that builds no partition never
    # loads it (about 0.9 s and 100 MiB per process, bench/BENCHMARKS.md).
    from flwr_datasets import partitioner as fds

    from tasks.vision.one_class import OneClassPartitioner

    mode = settings.partitioner
    if mode in ("iid", "array-split"):  # contiguous shards of the pool's order
        return fds.IidPartitioner(num_partitions=num_partitions)
    if mode == "dirichlet":
        return fds.DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by=label_column,
            alpha=float(settings.alpha),
            min_partition_size=DIRICHLET_MIN_PARTITION_SIZE,
            # True in the reference code of Yurochkin et al.: keeps partition sizes
            # near the mean, which small datasets (digits) need.
            self_balancing=True,
            seed=settings.seed,
        )
    if mode == "pathological":
        return fds.PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by=label_column,
            num_classes_per_partition=settings.classes_per_client,
            class_assignment_mode="first-deterministic",
            seed=settings.seed,
        )
    if mode in QUANTITY_SKEW:
        return getattr(fds, QUANTITY_SKEW[mode])(num_partitions=num_partitions)
    if mode == "one-class":
        return OneClassPartitioner(
            num_partitions=num_partitions,
            partition_by=label_column,
            num_edges=settings.num_edges,
            edge_iid=settings.edge_iid,
            seed=settings.seed,
        )
    raise ConfigError(
        f"'vision.partitioner' = {mode!r} is not valid; valid values: "
        + ", ".join(repr(p) for p in PARTITIONERS)
    )


def check_partition_id(partition_id: int, num_partitions: int) -> None:
    """Raise ValueError unless ``0 <= partition_id < num_partitions``."""
    if num_partitions < 1 or not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} not in [0, {num_partitions})")


def infeasible_partitioning(
    settings: PartitionSettings, num_examples: int, num_partitions: int, err: ValueError
) -> ConfigError:
    """Turn a partitioner's ``ValueError`` into a ConfigError naming the key at fault.

    flwr-datasets raises ``ValueError`` when e.g. an exponential partition would be
    empty, Dirichlet sampling misses the minimum partition size in 10 tries, or more
    clients need a class than it has examples; ``one-class`` also when
    ``hier.num-edges`` exceeds the number of partitions (its message names the key).
    """
    key = {"dirichlet": "vision.alpha", "pathological": "vision.classes-per-client"}
    return ConfigError(
        f"'{key.get(settings.partitioner, 'vision.partitioner')}': partitioner "
        f"{settings.partitioner!r} cannot split {num_examples} examples into "
        f"{num_partitions} partitions ({err}); use fewer partitions or another "
        "'vision.partitioner'"
    )


def split_local(
    num_examples: int, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(num_examples)`` into local train and test positions.

    The test split gets ``round(test_fraction * n)`` examples, clamped so that both
    splits are non-empty whenever ``n >= 2`` (with ``n == 1`` the lone example trains).

    Parameters
    ----------
    num_examples : int
        Size of the partition.
    test_fraction : float
        Target fraction of the local test split.
    rng : numpy.random.Generator
        Source of the permutation.

    Returns
    -------
    tuple of numpy.ndarray
        Sorted train positions and sorted test positions.
    """
    order = rng.permutation(num_examples)
    if num_examples < 2 or test_fraction == 0:  # 0: every example trains (no local test)
        return np.sort(order), np.empty(0, dtype=np.int64)
    num_test = min(max(round(test_fraction * num_examples), 1), num_examples - 1)
    return np.sort(order[num_test:]), np.sort(order[:num_test])


def local_split_rng(settings: PartitionSettings, partition_id: int) -> np.random.Generator:
    """The generator of a client's local train/test split (seed and partition id)."""
    return np.random.default_rng([settings.seed, partition_id])
