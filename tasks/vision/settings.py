"""Run-config of the image classification tasks, declared once.

``VisionConfig`` declares every ``vision.*`` key as a field, and
``SubspaceTaskSettings`` the task's side of subspace DP (``subspace.head-only``,
``subspace.warm-start``, ``subspace.public-fraction``); the reference table and
``pyproject.toml`` are generated from them. ``ImageClassificationTask`` reads its
options as one instance of each. ``VISION_OPTIONS``: the declared options, in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from config.options import Option
from config.settings import Settings, setting
from tasks.topology import NUM_EDGES_KEY
from tasks.vision.data import GROUPINGS
from tasks.vision.models import MODEL_NAMES
from tasks.vision.partitioning import ARRAY_SPLIT_SEED, PARTITIONERS, PartitionSettings

# Declared by the app (hierarchical strategy); read here for the `one-class` partitioner.
NUM_EDGES = Option(NUM_EDGES_KEY, 1, "Edges of the client -> edge -> cloud topology.", low=1)


@dataclass(frozen=True)
class VisionConfig(Settings):
    """The run-config of an image classification task: each keyed field declares its
    key once (default, range, help; the README table and ``pyproject.toml`` are
    generated from them), and the task reads its options typed from one instance
    (``auto`` values resolved, the derived fields filled by the task)."""

    PREFIX: ClassVar[str] = "vision"

    partitioner: str = setting(
        "iid",
        "How the train pool is split among clients; `array-split` (digits): the shared "
        "peer workload's fixed split (scikit-learn train_test_split(random_state=0), "
        "default_rng(0).permutation, np.array_split), whatever the seed.",
        choices=PARTITIONERS,
    )
    alpha: float = setting(
        0.5, "Dirichlet concentration (smaller: stronger label skew).", low=0.0, low_open=True
    )
    classes_per_client: int = setting(2, "Classes per client for `pathological`.", low=1)
    edge_iid: bool = setting(
        True, "`one-class`: every edge covers all classes (true) or as few as it can (false)."
    )
    test_fraction: float = setting(
        0.2,
        "Fraction of each client's data held out locally (0: none, every example trains; "
        "federated evaluation then has nothing to evaluate).",
        low=0.0,
        high=0.5,
    )
    normalize: bool = setting(
        True,
        "Standardise pixels by the dataset's mean and std; false (digits only): pixels "
        "scaled to [0, 1], the peer workload's input.",
    )
    central_test_fraction: float = setting(
        0.2,
        "Fraction held out as the central test set (digits; emnist has no test split).",
        low=0.05,
        high=0.5,
    )
    batch_size: int = setting(32, "Mini-batch size of local training and evaluation.", low=1)
    grouping: str = setting(
        "auto",
        "Label groups of the fairness metrics; `auto`: digits-letters (emnist), none "
        "(others); `low-high`: labels below num_classes / 2 vs the rest.",
        choices=GROUPINGS,
    )
    group_keep: float = setting(
        1.0,
        "Fraction of the last label group kept in each client's train split (seeded).",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    model: str = setting(
        "auto",
        "Model; `auto`: lenet (digits, mnist, emnist), cnn (cifar10).",
        choices=("auto", *MODEL_NAMES),
    )
    local_epochs: int = setting(1, "Local epochs per round.", low=1)
    lr: float = setting(0.05, "SGD learning rate.", low=0.0, low_open=True)
    momentum: float = setting(0.9, "SGD momentum.", low=0.0, high=1.0, high_open=True)
    weight_decay: float = setting(0.0, "SGD weight decay (L2).", low=0.0)
    lr_decay: float = setting(
        1.0,
        "LR factor per `vision.lr-decay-epochs` cumulative local epochs (1: constant).",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    lr_decay_epochs: int = setting(1, "Cumulative local epochs between LR decays.", low=1)
    deterministic: bool = setting(
        False, "Deterministic torch algorithms and cuDNN during local training."
    )
    device: str = setting(
        "auto", "Device; `auto`: cuda when available.", choices=("auto", "cpu", "cuda")
    )
    # Derived by the task, not keys of its own:
    num_edges: int = 1
    """``hier.num-edges`` (declared by the app, default 1): edges (one-class)."""
    seed: int = 0
    """Top-level ``seed``."""
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """``vision.grouping`` resolved: group name -> its labels, in order (empty: none)."""

    @property
    def partition_settings(self) -> PartitionSettings:
        """The hashable partitioning key of the data caches (edge options: one-class only)."""
        one_class = self.partitioner == "one-class"
        return PartitionSettings(
            self.partitioner,
            self.alpha,
            self.classes_per_client,
            self.test_fraction,
            self.seed,
            self.num_edges if one_class else 1,
            self.edge_iid or not one_class,
            self.normalize,
        )

    @property
    def central_split_seed(self) -> int:
        """``random_state`` of the central test split: the run seed, or the peer
        workload's fixed 0 under ``array-split``."""
        return ARRAY_SPLIT_SEED if self.partitioner == "array-split" else self.seed


@dataclass(frozen=True)
class SubspaceTaskSettings(Settings):
    """The task's side of subspace DP (``subspace.*``): head-only training and the
    public warm-start split. Declared here, not with the mechanism's own keys
    (``strategies/mechanisms/subspace_dp/settings.py``), because a task imports
    nothing of ``strategies/``; head-only training also runs without subspace DP."""

    PREFIX: ClassVar[str] = "subspace"

    head_only: bool = setting(
        False,
        "Train and share only the model's head (its last linear layer); "
        "the rest stays as warm-started.",
    )
    warm_start: int = setting(
        0, "Epochs of central training on the public split before round 1 (0: none).", low=0
    )
    public_fraction: float = setting(
        0.5,
        "Share of the central held-out set used as public warm-start data when "
        "`subspace.warm-start` > 0 (the rest is the central test set).",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    )


VISION_OPTIONS: tuple[Option, ...] = VisionConfig.options() + SubspaceTaskSettings.options()
