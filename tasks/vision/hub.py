"""Hugging Face Hub image datasets through ``flwr_datasets.FederatedDataset``.

Without network access ``datasets.load_dataset`` retries for ~25 s before failing.
Here a short probe of the Hub (``hub_reachable``, 3 s timeout) runs first; when
the Hub cannot be reached (or ``HF_HUB_OFFLINE`` is set) the load runs in offline
mode, so a dataset already in the local Hugging Face cache still loads and a missing
one fails at once with ``DatasetUnavailableError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import TypeVar

import datasets
import datasets.config
import datasets.exceptions
import httpx
import huggingface_hub.constants
import numpy as np
import torch
from flwr_datasets import FederatedDataset
from flwr_datasets.preprocessor import Divider

from tasks.vision.data import (
    PARTITION_CACHE,
    CentralTestSet,
    ClientPartition,
    DatasetSpec,
    DatasetUnavailableError,
    TensorSplit,
    images_to_tensor,
    split_partition,
)
from tasks.vision.partitioning import (
    PartitionSettings,
    build_partitioner,
    check_partition_id,
    infeasible_partitioning,
)

HUB_PROBE_TIMEOUT_S = 3.0
T = TypeVar("T")


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face Hub endpoint answers (below 500) within ``timeout``.

    The request runs in a daemon thread joined with ``timeout``, so a hanging DNS
    look-up (which httpx's timeout does not cover) cannot delay the answer either.
    """
    answered: list[bool] = []

    def probe() -> None:
        try:
            response = httpx.head(huggingface_hub.constants.ENDPOINT, timeout=timeout)
        except (httpx.HTTPError, OSError):
            return
        # A proxy that cannot reach the Hub answers 502/503/504 itself.
        answered.append(response.status_code < 500)

    thread = threading.Thread(target=probe, name="hf-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return any(answered)


@contextmanager
def forced_offline_mode() -> Iterator[None]:
    """Make ``datasets`` and ``huggingface_hub`` use only the local cache, then restore."""
    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def unavailable_message(hf_id: str) -> str:
    """The error text for a dataset that cannot be had offline."""
    return (
        f"Hugging Face dataset {hf_id!r} is not available: the Hugging Face Hub "
        f"({huggingface_hub.constants.ENDPOINT}) could not be reached and the dataset "
        "is not in the local Hugging Face cache. Connect to the internet (or copy the "
        "cache from a machine that has it), or use task `digits`, which works offline "
        "(scikit-learn's digits ship with scikit-learn)."
    )


def from_hub(hf_id: str, load: Callable[[], T]) -> T:
    """Run ``load`` (which reads ``hf_id``), offline and failing fast without the Hub."""
    offline = bool(datasets.config.HF_HUB_OFFLINE) or not hub_reachable()
    if not offline:
        return load()
    try:
        with forced_offline_mode():
            return load()
    except (OSError, datasets.exceptions.DatasetNotFoundError) as err:
        raise DatasetUnavailableError(unavailable_message(hf_id)) from err


@lru_cache(maxsize=8)
def federated_dataset(
    spec: DatasetSpec,
    settings: PartitionSettings,
    central_test_fraction: float | None,
    num_partitions: int,
) -> FederatedDataset:
    """The (lazily loading) FederatedDataset partitioning ``spec``'s train split.

    A dataset without a ``"test"`` split gets one: a ``central_test_fraction`` of the
    seeded-shuffled train split (flwr-datasets ``Divider``).
    """
    divider = None
    if not spec.has_test_split:
        fraction = float(central_test_fraction or 0.0)
        divider = Divider({"train": 1.0 - fraction, "test": fraction}, divide_split="train")
    assert spec.hf_id is not None
    return FederatedDataset(
        dataset=spec.hf_id,
        partitioners={"train": build_partitioner(settings, num_partitions, spec.label_column)},
        preprocessor=divider,
        shuffle=True,
        seed=settings.seed,
    )


def hf_to_split(dataset: datasets.Dataset, spec: DatasetSpec) -> TensorSplit:
    """Decode a Hugging Face split's images and labels into a normalised TensorSplit."""
    columns = [spec.image_column, spec.label_column]
    batch = dataset.with_format("numpy", columns=columns)[:]
    images = batch[spec.image_column]
    if images.dtype == object:  # ragged decode: stack the per-image arrays
        images = np.stack(list(images))
    labels = torch.as_tensor(np.asarray(batch[spec.label_column]), dtype=torch.long)
    return TensorSplit(images_to_tensor(images, spec), labels)


def hub_central_fraction(spec: DatasetSpec, central_test_fraction: float) -> float | None:
    """The central fraction that matters for ``spec`` (None: it has a test split)."""
    return None if spec.has_test_split else central_test_fraction


@lru_cache(maxsize=PARTITION_CACHE)
def load_hub_partition(
    spec: DatasetSpec,
    settings: PartitionSettings,
    central_test_fraction: float | None,
    partition_id: int,
    num_partitions: int,
) -> ClientPartition:
    """Client ``partition_id``'s data from the Hub (cached per process)."""
    check_partition_id(partition_id, num_partitions)
    fds = federated_dataset(spec, settings, central_test_fraction, num_partitions)
    assert spec.hf_id is not None
    try:
        part = from_hub(spec.hf_id, lambda: fds.load_partition(partition_id, "train"))
    except ValueError as err:
        num_rows = fds.partitioners["train"].dataset.num_rows
        raise infeasible_partitioning(settings, num_rows, num_partitions, err) from err
    return split_partition(hf_to_split(part, spec), settings, partition_id, num_partitions)


@lru_cache(maxsize=8)
def load_hub_central_test(
    spec: DatasetSpec, seed: int, central_test_fraction: float | None
) -> CentralTestSet:
    """The Hub dataset's ``"test"`` split (cached per process)."""
    fds = federated_dataset(spec, PartitionSettings(seed=seed), central_test_fraction, 1)
    assert spec.hf_id is not None
    return CentralTestSet(hf_to_split(from_hub(spec.hf_id, lambda: fds.load_split("test")), spec))
