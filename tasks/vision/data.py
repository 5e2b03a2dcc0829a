"""Image datasets as tensors: client partitions and the server's central test set.

``digits`` is scikit-learn's 1797 8x8 handwritten digits (Alpaydin & Kaynak, UCI),
shipped with scikit-learn, so it works offline: a seeded stratified split holds out
``vision.central-test-fraction`` as the central test set and the rest is partitioned.
With a central warm start, ``split_public`` splits the held-out set once more
into public warm-start data and the central test set.

Design notes: ``docs/notes.md``, ``tasks.vision.data``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

from config.options import ConfigError
from tasks.vision.partitioning import (
    ARRAY_SPLIT_SEED,
    PartitionSettings,
    build_partitioner,
    check_partition_id,
    infeasible_partitioning,
    local_split_rng,
    split_local,
)

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner


class DatasetUnavailableError(RuntimeError):
    """A Hugging Face dataset is neither reachable on the Hub nor in the local cache."""


@dataclass(frozen=True)
class DatasetSpec:
    """Where an image dataset lives and how its images become tensors.

    Attributes
    ----------
    name : str
        Task name (``"mnist"``).
    hf_id : str or None
        Hugging Face dataset id; ``None`` for the offline scikit-learn digits.
    image_column, label_column : str
        Column names in the Hugging Face dataset.
    has_test_split : bool
        Whether the dataset has a ``"test"`` split; if not, the central test set is
        carved out of ``"train"`` with ``vision.central-test-fraction``.
    num_classes, in_channels, image_size : int
        Output classes, image channels and (square) image side.
    scale : float
        Raw pixel maximum (255, or 16 for digits); pixels are divided by it.
    mean, std : tuple of float
        Per-channel normalisation applied after scaling.
    """

    name: str
    hf_id: str | None
    image_column: str
    label_column: str
    has_test_split: bool
    num_classes: int
    in_channels: int
    image_size: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]


DIGITS = DatasetSpec("digits", None, "image", "label", False, 10, 1, 8, 16.0, (0.3053,), (0.3760,))
MNIST = DatasetSpec(
    "mnist", "ylecun/mnist", "image", "label", True, 10, 1, 28, 255.0, (0.1307,), (0.3081,)
)
CIFAR10 = DatasetSpec(
    "cifar10", "uoft-cs/cifar10", "img", "label", True, 10, 3, 32, 255.0,
    (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
)  # fmt: skip
# EMNIST ByClass: Flower Labs' parquet FEMNIST (LEAF), the 814k NIST SD19 characters
# in EMNIST's 62 ByClass classes (0-9, A-Z, a-z). It has only a "train" split, and no
# published normalisation constants, hence the neutral 0.5 / 0.5.
EMNIST = DatasetSpec(
    "emnist", "flwrlabs/femnist", "image", "character", False, 62, 1, 28, 255.0, (0.5,), (0.5,)
)


@dataclass(frozen=True)
class TensorSplit:
    """Normalised images and labels of one split.

    Attributes
    ----------
    images : torch.Tensor
        ``float32`` of shape ``(N, C, H, W)``.
    labels : torch.Tensor
        ``int64`` of shape ``(N,)``.
    ids : torch.Tensor or None
        Source row of each example (digits: row of ``load_digits()``), ``None`` where
        the source does not expose it (Hugging Face datasets).
    """

    images: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, positions: np.ndarray) -> TensorSplit:
        """The examples at ``positions``."""
        index = torch.as_tensor(positions, dtype=torch.long)
        ids = None if self.ids is None else self.ids[index]
        return TensorSplit(self.images[index], self.labels[index], ids)

    def positions_of(self, labels: Collection[int]) -> np.ndarray:
        """Positions of the examples whose label is in ``labels``, ascending."""
        return np.flatnonzero(np.isin(self.labels.numpy(), np.fromiter(labels, np.int64)))

    def with_labels(self, labels: Collection[int]) -> TensorSplit:
        """The examples whose label is in ``labels``, in order (possibly none)."""
        return self.subset(self.positions_of(labels))


@dataclass(frozen=True)
class ClientPartition:
    """One client's data: its local train split and local test split."""

    partition_id: int
    num_partitions: int
    train: TensorSplit
    test: TensorSplit


@dataclass(frozen=True)
class CentralTestSet:
    """The held-out test set the server evaluates the global model on."""

    test: TensorSplit


def images_to_tensor(
    images: np.ndarray, spec: DatasetSpec, normalize: bool = True
) -> torch.Tensor:
    """Scale and normalise raw images ``(N, H, W)`` or ``(N, H, W, C)`` to ``(N, C, H, W)``
    (``normalize=False``: scaled to [0, 1] only)."""
    x = torch.as_tensor(np.asarray(images), dtype=torch.float32) / spec.scale
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    if not normalize:
        return x.contiguous()
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    return ((x - mean) / std).contiguous()


def make_loader(
    split: TensorSplit, batch_size: int, *, shuffle: bool, seed: int = 0
) -> DataLoader:
    """A DataLoader over ``split``; shuffling draws from a ``torch.Generator(seed)``."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(split.images, split.labels),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
    )


class ShuffledBatches:
    """The batches ``make_loader(split, batch_size, shuffle=True, seed=seed)`` yields,
    the same tensors from the same draws of its generator, epoch after epoch.

    Hand-written for the one-process engine's many tiny clients: the DataLoader's
    per-batch fetch and collate (one index at a time, then ``torch.stack``) cost more
    than a step on one or two examples. Each pass draws what the DataLoader's draws:
    its iterator's base seed, the sampler's permutation, then (as the exhausted
    sampler does) a second permutation it does not use.
    """

    def __init__(self, split: TensorSplit, batch_size: int, seed: int) -> None:
        if len(split) == 0 or batch_size < 1:
            raise ValueError("ShuffledBatches needs examples and batch_size >= 1")
        self.split, self.batch_size = split, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return -(-len(self.split) // self.batch_size)

    def __iter__(self):
        n, generator = len(self.split), self.generator
        torch.empty((), dtype=torch.int64).random_(generator=generator)  # the base seed
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, self.batch_size):
            index = order[start : start + self.batch_size]
            yield self.split.images[index], self.split.labels[index]
        torch.randperm(n, generator=generator)  # the exhausted sampler's last draw


def ordered_batches(
    split: TensorSplit, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches ``make_loader(split, batch_size, shuffle=False)`` yields: consecutive
    slices of ``split``, contiguous as its collated tensors are, without the DataLoader's
    per-example fetch and ``torch.stack`` (about half of a small model's evaluation)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(split), batch_size):
        stop = start + batch_size
        yield split.images[start:stop].contiguous(), split.labels[start:stop].contiguous()


def split_public(
    held_out: TensorSplit, public_fraction: float, seed: int
) -> tuple[TensorSplit, TensorSplit]:
    """Seeded stratified split of the server's held-out set into (public, central test).

    The public part is server-side warm-start data: no client's data is in it.

    Parameters
    ----------
    held_out : TensorSplit
        The held-out set (digits: the central ids of ``digits_central_split``).
    public_fraction : float
        Share of ``held_out`` that becomes public, in (0, 1).
    seed : int
        The run seed (``random_state`` of scikit-learn's ``train_test_split``).

    Returns
    -------
    tuple of TensorSplit
        The public split and the rest: disjoint, together ``held_out``, each in the
        order of ``held_out``, with every class in both.

    Raises
    ------
    ValueError
        If no stratified split exists (a class with one example, or fewer public or
        remaining examples than classes).
    """
    labels = held_out.labels.numpy()
    public, test = train_test_split(
        np.arange(len(labels)), train_size=public_fraction, stratify=labels, random_state=seed
    )
    return held_out.subset(np.sort(public)), held_out.subset(np.sort(test))


def split_partition(
    data: TensorSplit, settings: PartitionSettings, partition_id: int, num_partitions: int
) -> ClientPartition:
    """Split a partition's examples into local train and test (seeded)."""
    rng = local_split_rng(settings, partition_id)
    train_pos, test_pos = split_local(len(data), settings.test_fraction, rng)
    return ClientPartition(
        partition_id, num_partitions, data.subset(train_pos), data.subset(test_pos)
    )


# --- digits (scikit-learn, offline) ------------------------------------------------


@lru_cache(maxsize=2)
def digits_tensors(normalize: bool = True) -> TensorSplit:
    """All 1797 digits as a ``(1797, 1, 8, 8)`` split with ids ``0..1796``, normalised
    (or, ``normalize=False``, pixels / 16: the peer workload's input)."""
    bunch = load_digits()
    images = images_to_tensor(bunch.images, DIGITS, normalize)
    labels = torch.as_tensor(bunch.target, dtype=torch.long)
    return TensorSplit(images, labels, torch.arange(len(labels)))


def _stratified_split(seed: int, central_test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's stratified ``train_test_split`` of the digits ids, in its order."""
    labels = digits_tensors().labels.numpy()
    return train_test_split(
        np.arange(len(labels)),
        test_size=central_test_fraction,
        stratify=labels,
        random_state=seed,
    )


@lru_cache(maxsize=8)
def digits_central_split(seed: int, central_test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of digits ids into (client pool, central test)."""
    pool, central = _stratified_split(seed, central_test_fraction)
    return np.sort(pool), np.sort(central)


def array_split_pool(central_test_fraction: float) -> np.ndarray:
    """The peer workload's training rows in the order its clients cut them: scikit-learn's
    ``train_test_split(random_state=0)`` order, permuted by ``default_rng(0)``."""
    pool, _ = _stratified_split(ARRAY_SPLIT_SEED, central_test_fraction)
    return pool[np.random.default_rng(ARRAY_SPLIT_SEED).permutation(len(pool))]


@lru_cache(maxsize=8)
def digits_pool(settings: PartitionSettings, central_test_fraction: float) -> np.ndarray:
    """The digits client pool in the order the partitioner cuts it (shuffled with the
    run seed; for ``array-split`` the peer workload's fixed order,
    ``array_split_pool``)."""
    if settings.partitioner == "array-split":
        return array_split_pool(central_test_fraction)
    pool, _ = digits_central_split(settings.seed, central_test_fraction)
    return np.random.default_rng(settings.seed).permutation(pool)


def array_split_shard(values: np.ndarray, sections: int, index: int) -> np.ndarray:
    """``np.array_split(values, sections)[index]`` without cutting the other shards
    (the first ``len(values) % sections`` shards hold one element more). numpy has no
    call for one shard: cutting all 1 000 of them to keep one took 3 ms, paid by most
    messages of a 1 000-client simulation, whose partitions each process sees once."""
    size, extra = divmod(len(values), sections)
    start = index * size + min(index, extra)
    return values[start : start + size + (index < extra)]


# Modes whose partitions are contiguous shards of the pool: flwr-datasets'
# IidPartitioner is ``Dataset.shard(contiguous=True)``, the cut np.array_split makes.
CONTIGUOUS = ("iid", "array-split")


@lru_cache(maxsize=8)
def digits_partitioner(
    settings: PartitionSettings, central_test_fraction: float, num_partitions: int
) -> Partitioner:
    """The partitioner over the digits client pool (``digits_pool``)."""
    pool = digits_pool(settings, central_test_fraction)
    labels = digits_tensors().labels.numpy()[pool]
    import datasets  # with flwr-datasets, only where partitions are built

    partitioner = build_partitioner(settings, num_partitions, DIGITS.label_column)
    partitioner.dataset = datasets.Dataset.from_dict({"id": pool, "label": labels})
    return partitioner


# The partitions of one partitioning are disjoint, so caching all of them costs at most
# one copy of the dataset; a bound below the number of clients (it was 256) made a
# 1 000-client simulation rebuild most partitions on every message.
PARTITION_CACHE = 4096


def check_digits_partitioning(
    settings: PartitionSettings, central_test_fraction: float, num_partitions: int
) -> None:
    """ConfigError when a contiguous partitioning (``iid``, ``array-split``) of the digits
    pool would leave clients without data: more partitions than examples. numpy's
    ``array_split`` would give them empty shards and flwr-datasets' IidPartitioner
    fails on them; either way such a client cannot train. The other partitioners
    check themselves when they are built (``infeasible_partitioning``)."""
    pool = len(digits_pool(settings, central_test_fraction))
    if settings.partitioner in CONTIGUOUS and num_partitions > pool:
        raise ConfigError(
            f"'vision.partitioner': partitioner {settings.partitioner!r} cannot split {pool} "
            f"digits examples into {num_partitions} partitions: {num_partitions - pool} "
            f"clients would hold no data; use at most {pool} SuperNodes"
        )


@lru_cache(maxsize=PARTITION_CACHE)
def load_digits_partition(
    settings: PartitionSettings,
    central_test_fraction: float,
    partition_id: int,
    num_partitions: int,
) -> ClientPartition:
    """Client ``partition_id``'s digits (cached per process)."""
    check_partition_id(partition_id, num_partitions)
    check_digits_partitioning(settings, central_test_fraction, num_partitions)
    pool = digits_pool(settings, central_test_fraction)
    if settings.partitioner in CONTIGUOUS:
        # The shard IidPartitioner returns (tests/tasks/test_partitioning.py checks it
        # for every N), without building it through Hugging Face datasets: that took
        # 2.5 ms per partition, paid by most messages of a 1 000-client simulation.
        ids = array_split_shard(pool, num_partitions, partition_id).astype(np.int64)
    else:
        partitioner = digits_partitioner(settings, central_test_fraction, num_partitions)
        try:
            part = partitioner.load_partition(partition_id)
        except ValueError as err:
            pool_size = partitioner.dataset.num_rows
            raise infeasible_partitioning(settings, pool_size, num_partitions, err) from err
        ids = np.asarray(part["id"], dtype=np.int64)
    data = digits_tensors(settings.normalize).subset(ids)
    return split_partition(data, settings, partition_id, num_partitions)


@lru_cache(maxsize=8)
def load_digits_central_test(
    seed: int, central_test_fraction: float, normalize: bool = True
) -> CentralTestSet:
    """The digits central test set (cached per process); ``seed`` is the split's
    ``random_state`` (the ``array-split`` partitioning passes its fixed 0)."""
    _, central = digits_central_split(seed, central_test_fraction)
    return CentralTestSet(digits_tensors(normalize).subset(central))


# --- label groups (Subspace-DP-FL: digits vs. letters) -------------------------------------

GROUPINGS = ("auto", "none", "digits-letters", "low-high")
GROUP_KEEP_STREAM = 1  # tells the thinning generator apart from the local split's
GROUP_ACCURACY = "eval-accuracy-{}"  # accuracy on the examples of one label group
GROUP_NUM_EXAMPLES = "num-examples-{}"  # how many examples of the group were evaluated
FAIRNESS_GAP = "fairness-gap"  # best minus worst accuracy over groups with an example


def label_groups(grouping: str, num_classes: int) -> dict[str, tuple[int, ...]]:
    """The named label groups of ``grouping``, in order (empty for ``"none"``).

    Parameters
    ----------
    grouping : str
        ``"none"``; ``"digits-letters"`` (EMNIST ByClass: ``digits`` = 0-9,
        ``letters`` = 10-61); ``"low-high"`` (``low`` = labels below
        ``num_classes / 2``, ``high`` = the rest).
    num_classes : int
        Number of labels ``0 .. num_classes - 1``.

    Raises
    ------
    ValueError
        If ``grouping`` is unknown, ``digits-letters`` meets other than 62 classes, or
        ``low-high`` fewer than 2.
    """
    if grouping == "none":
        return {}
    if grouping == "digits-letters":
        if num_classes != 62:
            raise ValueError(f"'grouping' = 'digits-letters' needs 62 classes, got {num_classes}")
        return {"digits": tuple(range(10)), "letters": tuple(range(10, 62))}
    if grouping == "low-high":
        if num_classes < 2:
            raise ValueError(f"'grouping' = 'low-high' needs >= 2 classes, got {num_classes}")
        half = (num_classes + 1) // 2
        return {"low": tuple(range(half)), "high": tuple(range(half, num_classes))}
    raise ValueError(
        f"'grouping' = {grouping!r} is not valid; valid values: 'none', 'digits-letters', "
        "'low-high'"
    )


def group_keep_rng(seed: int, partition_id: int) -> np.random.Generator:
    """The generator that thins client ``partition_id``'s train split (``vision.group-keep``)."""
    return np.random.default_rng([seed, partition_id, GROUP_KEEP_STREAM])


def thin_labels(
    split: TensorSplit, labels: Collection[int], keep: float, rng: np.random.Generator
) -> TensorSplit:
    """Keep a random ``keep`` fraction of the examples whose label is in ``labels``.

    Of the ``m`` matching examples ``max(1, round(keep * m))`` stay (none when
    ``m = 0``), drawn without replacement from ``rng``; every other example stays, and
    the order is kept. ``keep = 1`` returns ``split`` itself.

    Raises
    ------
    ValueError
        If ``keep`` is not in (0, 1].
    """
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"'keep' = {keep!r} is out of range; valid range: (0, 1]")
    matching = split.positions_of(labels)
    if keep == 1.0 or matching.size == 0:
        return split
    num_keep = max(1, round(keep * matching.size))
    dropped = rng.choice(matching, size=matching.size - num_keep, replace=False)
    return split.subset(np.setdiff1d(np.arange(len(split)), dropped))


def group_metrics(
    correct: np.ndarray, counts: np.ndarray, groups: Mapping[str, Collection[int]]
) -> dict[str, float]:
    """Per-group accuracy and example count, and the fairness gap, from per-label tallies.

    Every group reports ``eval-accuracy-<g>`` and ``num-examples-<g>``: a group without
    examples in the split reports accuracy 0.0 with count 0, so that every client
    sends the same keys; weight ``eval-accuracy-<g>`` by ``num-examples-<g>`` when
    averaging over clients. ``fairness-gap`` is the largest minus the smallest
    accuracy over the groups with at least one example (0.0 with fewer than two).

    Parameters
    ----------
    correct, counts : numpy.ndarray
        Right predictions and examples per true label
        (``tally_split``).
    groups : Mapping
        Group name -> its labels (indices into ``correct`` and ``counts``).
    """
    metrics: dict[str, float] = {}
    seen = []
    for name, labels in groups.items():
        index = np.fromiter(labels, dtype=np.int64)
        right, total = int(correct[index].sum()), int(counts[index].sum())
        metrics[GROUP_ACCURACY.format(name)] = right / total if total else 0.0
        metrics[GROUP_NUM_EXAMPLES.format(name)] = total
        if total:
            seen.append(right / total)
    metrics[FAIRNESS_GAP] = max(seen) - min(seen) if seen else 0.0
    return metrics
