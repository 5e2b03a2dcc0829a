"""Image classification tasks (digits, MNIST, CIFAR-10, EMNIST ByClass).

``digits`` needs no network; the others load from the Hugging Face Hub through
flwr-datasets and raise ``DatasetUnavailableError`` at once when offline.
"""

import sys

from tasks.vision import data
from tasks.vision.data import (
    CentralTestSet,
    ClientPartition,
    DatasetSpec,
    DatasetUnavailableError,
    TensorSplit,
)
from tasks.vision.models import build_model
from tasks.vision.partitioning import PartitionSettings
from tasks.vision.settings import VisionConfig
from tasks.vision.task import (
    TRAIN_ACCURACY,
    CIFAR10Task,
    DigitsTask,
    EMNISTTask,
    ImageClassificationTask,
    MNISTTask,
)


def clear_caches() -> None:
    """Forget every cached dataset, partitioner and partition of this process."""
    cached = [
        data.digits_tensors,
        data.digits_central_split,
        data.digits_pool,
        data.digits_partitioner,
        data.load_digits_partition,
        data.load_digits_central_test,
    ]
    hub = sys.modules.get("tasks.vision.hub")  # imported by the first Hub dataset only
    if hub is not None:
        cached += [hub.federated_dataset, hub.load_hub_partition, hub.load_hub_central_test]
    for function in cached:
        function.cache_clear()


__all__ = [
    "TRAIN_ACCURACY",
    "CIFAR10Task",
    "CentralTestSet",
    "ClientPartition",
    "DatasetSpec",
    "DatasetUnavailableError",
    "DigitsTask",
    "EMNISTTask",
    "ImageClassificationTask",
    "MNISTTask",
    "PartitionSettings",
    "TensorSplit",
    "VisionConfig",
    "build_model",
    "clear_caches",
]
