"""Run-config options of the image classification tasks and their parsed form.

``VISION_OPTIONS`` declares every ``data.*``, ``model.*``, ``train.*`` and the
vision-side ``subspace.*`` key (the README's table and ``pyproject.toml`` are generated
from them); ``VisionConfig`` is what ``ImageClassificationTask``
parses them into.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from config.options import Option
from tasks.topology import NUM_EDGES_KEY
from tasks.vision.data import GROUPINGS
from tasks.vision.models import MODEL_NAMES
from tasks.vision.partitioning import ARRAY_SPLIT_SEED, PARTITIONERS, PartitionSettings

# Declared by the app (hierarchical strategy); read here for the `one-class` partitioner.
NUM_EDGES = Option(NUM_EDGES_KEY, 1, "Edges of the client -> edge -> cloud topology.", low=1)

VISION_OPTIONS: tuple[Option, ...] = (
    Option("data.partitioner", "iid",
           "How the train pool is split among clients; `array-split` (digits): the shared "
           "peer workload's fixed split (scikit-learn train_test_split(random_state=0), "
           "default_rng(0).permutation, np.array_split), whatever the seed.",
           choices=PARTITIONERS),
    Option("data.alpha", 0.5, "Dirichlet concentration (smaller: stronger label skew).",
           low=0.0, low_open=True),
    Option("data.classes-per-client", 2, "Classes per client for `pathological`.", low=1),
    Option("data.edge-iid", True,
           "`one-class`: every edge covers all classes (true) or as few as it can (false)."),
    Option("data.test-fraction", 0.2,
           "Fraction of each client's data held out locally (0: none, every example trains; "
           "federated evaluation then has nothing to evaluate).",
           low=0.0, high=0.5),
    Option("data.normalize", True,
           "Standardise pixels by the dataset's mean and std; false (digits only): pixels "
           "scaled to [0, 1], the peer workload's input."),
    Option("data.central-test-fraction", 0.2,
           "Fraction held out as the central test set (digits; emnist has no test split).",
           low=0.05, high=0.5),
    Option("data.batch-size", 32, "Mini-batch size of local training and evaluation.", low=1),
    Option("data.groups", "auto",
           "Label groups of the fairness metrics; `auto`: digits-letters (emnist), none "
           "(others); `low-high`: labels below num_classes / 2 vs the rest.",
           choices=GROUPINGS),
    Option("data.group-keep", 1.0,
           "Fraction of the last label group kept in each client's train split (seeded).",
           low=0.0, high=1.0, low_open=True),
    Option("model.name", "auto", "Model; `auto`: lenet (digits, mnist, emnist), cnn (cifar10).",
           choices=("auto", *MODEL_NAMES)),
    Option("train.local-epochs", 1, "Local epochs per round.", low=1),
    Option("train.lr", 0.05, "SGD learning rate.", low=0.0, low_open=True),
    Option("train.momentum", 0.9, "SGD momentum.", low=0.0, high=1.0, high_open=True),
    Option("train.weight-decay", 0.0, "SGD weight decay (L2).", low=0.0),
    Option("train.lr-decay", 1.0,
           "LR factor per `train.lr-decay-epochs` cumulative local epochs (1: constant).",
           low=0.0, high=1.0, low_open=True),
    Option("train.lr-decay-epochs", 1, "Cumulative local epochs between LR decays.", low=1),
    Option("train.deterministic", False,
           "Deterministic torch algorithms and cuDNN during local training."),
    Option("train.device", "auto", "Device; `auto`: cuda when available.",
           choices=("auto", "cpu", "cuda")),
    Option("subspace.head-only", False,
           "Train and share only the model's head (its last linear layer); "
           "the rest stays as warm-started."),
    Option("subspace.warm-start", 0,
           "Epochs of central training on the public split before round 1 (0: none).",
           low=0),
    Option("subspace.public-fraction", 0.5,
           "Share of the central held-out set used as public warm-start data when "
           "`subspace.warm-start` > 0 (the rest is the central test set).",
           low=0.0, high=1.0, low_open=True, high_open=True),
)  # fmt: skip


@dataclass(frozen=True)
class VisionConfig:
    """Parsed run-config of an image classification task."""

    partitioner: str
    """``data.partitioner``: iid, dirichlet, pathological, linear, square, exponential."""
    alpha: float
    """``data.alpha``: Dirichlet concentration."""
    classes_per_client: int
    """``data.classes-per-client``: classes per client (pathological)."""
    edge_iid: bool
    """``data.edge-iid``: class coverage of the edges (one-class)."""
    num_edges: int
    """``hier.num-edges`` (declared by the app, default 1): edges (one-class)."""
    test_fraction: float
    """``data.test-fraction``: local test split of each client."""
    normalize: bool
    """``data.normalize``: standardise the pixels (false: scaled only, digits)."""
    central_test_fraction: float
    """``data.central-test-fraction``: central test share of a dataset without test split."""
    batch_size: int
    """``data.batch-size``."""
    groups: Mapping[str, tuple[int, ...]]
    """``data.groups`` resolved: group name -> its labels, in order (empty: none)."""
    group_keep: float
    """``data.group-keep``: share of the last group kept in each client's train split."""
    model_name: str
    """``model.name`` with ``auto`` resolved (derived)."""
    local_epochs: int
    """``train.local-epochs``."""
    lr: float
    """``train.lr``."""
    momentum: float
    """``train.momentum``."""
    weight_decay: float
    """``train.weight-decay``."""
    lr_decay: float
    """``train.lr-decay``: LR factor per ``lr_decay_epochs`` cumulative local epochs."""
    lr_decay_epochs: int
    """``train.lr-decay-epochs``."""
    deterministic: bool
    """``train.deterministic``: deterministic algorithms in local training."""
    device: str
    """``train.device`` with ``auto`` resolved to ``cpu`` or ``cuda`` (derived)."""
    head_only: bool
    """``subspace.head-only``: local training updates only the head (last linear layer)."""
    warm_start_epochs: int
    """``subspace.warm-start``: central epochs on the public split before round 1."""
    public_fraction: float
    """``subspace.public-fraction``: public share of the held-out set (with a warm start)."""
    seed: int
    """Top-level ``seed``."""

    @property
    def partition_settings(self) -> PartitionSettings:
        """The hashable partitioning key of the data caches (edge options: one-class only)."""
        one_class = self.partitioner == "one-class"
        return PartitionSettings(
            self.partitioner, self.alpha, self.classes_per_client, self.test_fraction,
            self.seed, self.num_edges if one_class else 1, self.edge_iid or not one_class,
            self.normalize,
        )  # fmt: skip

    @property
    def central_split_seed(self) -> int:
        """``random_state`` of the central test split: the run seed, or the peer
        workload's fixed 0 under ``array-split``."""
        return ARRAY_SPLIT_SEED if self.partitioner == "array-split" else self.seed
