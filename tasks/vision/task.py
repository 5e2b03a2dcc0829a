"""Image classification tasks: digits (offline), MNIST, CIFAR-10 and EMNIST ByClass.

Local training is plain SGD with momentum on the cross-entropy loss, plus the FedProx
proximal term (Li et al., 2020) when the server sends ``proximal_mu > 0``, or, when
the server asks for it, sample-level DP-SGD (Abadi et al., 2016) through
``privacy.dpsgd``.

As in frontloaded-dp-hfl (after HierFL), the learning rate can decay
exponentially with the client's cumulative local epochs (``vision.lr-decay`` every
``vision.lr-decay-epochs``; ``decayed_lr``), and ``vision.deterministic`` runs local
training with deterministic torch algorithms and cuDNN (frontloaded-dp-hfl's
Reproducibility section; ``deterministic_torch``).

Design notes: ``docs/notes.md``, ``tasks.vision.task``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from config.options import ConfigError, Option
from privacy.dpsgd import calibrated_settings, train_private
from tasks.base import (
    DPSGD,
    EVAL_ACCURACY,
    EVAL_LOSS,
    NUM_EXAMPLES,
    SEED,
    TRAIN_ACCURACY,
    TRAIN_LOSS,
    LocalTraining,
    Task,
    local_seed,
    on_device,
    resolve_device,
    seed_torch,
)
from tasks.proximal import snapshot_parameters
from tasks.vision.data import (
    CIFAR10,
    DIGITS,
    EMNIST,
    MNIST,
    CentralTestSet,
    ClientPartition,
    DatasetSpec,
    ShuffledBatches,
    TensorSplit,
    check_digits_partitioning,
    group_keep_rng,
    group_metrics,
    label_groups,
    load_digits_central_test,
    load_digits_partition,
    make_loader,
    split_public,
    thin_labels,
)
from tasks.vision.gradients import per_example_gradients
from tasks.vision.hierarchical import train_local_updates
from tasks.vision.models import (
    build_model,
    head_parameter_names,
    train_head_only,
)
from tasks.vision.settings import NUM_EDGES, VISION_OPTIONS, SubspaceTaskSettings, VisionConfig
from tasks.vision.steps import tally_split, train_epoch

EPOCHS_DONE_KEY = "local-epochs-done"  # in the client's persistent state: the LR schedule
WARM_START_LOSS = "warm-start-loss"
WARM_START_ACCURACY = "warm-start-accuracy"


def decayed_lr(lr: float, decay: float, decay_epochs: int, epochs_done: int) -> float:
    """``lr * decay ** floor(epochs_done / decay_epochs)`` (frontloaded-dp-hfl's decay).

    ``epochs_done`` counts the client's local epochs before the current one, over all
    the rounds it trained in.
    """
    return lr * decay ** (epochs_done // decay_epochs)


@contextmanager
def deterministic_torch(enabled: bool) -> Iterator[None]:
    """Use deterministic torch algorithms and cuDNN inside the block, then restore.

    Sets ``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic = True``
    and ``cudnn.benchmark = False``. CUDA's cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG``
    for determinism: it is set to ``:4096:8`` if unset, and left set (it only sizes
    cuBLAS workspaces). Does nothing when ``enabled`` is false.
    """
    if not enabled:
        yield
        return
    cudnn = torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        cudnn.deterministic, cudnn.benchmark = saved[2], saved[3]


def evaluation_split(data: ClientPartition | CentralTestSet | TensorSplit) -> TensorSplit:
    """The split to evaluate on: a partition's local test split, or the central test set."""
    if isinstance(data, ClientPartition | CentralTestSet):
        return data.test
    if isinstance(data, TensorSplit):
        return data
    raise TypeError(f"cannot evaluate on {type(data).__name__}")


class ImageClassificationTask(Task):
    """Image classification on one dataset (``SPEC``), partitioned among clients.

    Options are the flat keys of ``VISION_OPTIONS`` (``vision.*`` and the task's
    ``subspace.*``) plus the top-level ``seed``. ``load_partition`` returns a
    ``ClientPartition``, ``load_central_test`` a
    ``CentralTestSet``; ``evaluate`` accepts either.
    """

    EPOCHS_KEY: ClassVar[str | None] = "vision.local-epochs"
    HIERARCHICAL: ClassVar[bool] = True
    OPTIONS: ClassVar[tuple[Option, ...]] = VISION_OPTIONS
    SPEC: ClassVar[DatasetSpec]
    DEFAULT_MODEL: ClassVar[str] = "lenet"
    GROUPINGS: ClassVar[tuple[str, ...]] = ("auto", "none", "low-high")  # vision.grouping
    DEFAULT_GROUPING: ClassVar[str] = "none"  # what vision.grouping = auto means

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        super().__init__(run_config)
        seed = SEED.read(run_config)
        declared = VisionConfig.from_options(self.options)
        self.config = replace(
            declared,
            num_edges=int(NUM_EDGES.read(run_config)),
            groups=MappingProxyType(self._resolve_groups(declared.grouping)),
            model=self.DEFAULT_MODEL if declared.model == "auto" else declared.model,
            device=resolve_device(declared.device, "vision.device"),
            seed=int(seed),
        )
        self.subspace = SubspaceTaskSettings.from_options(self.options)
        self._check_classes_per_client()
        self._check_group_keep()
        self._check_digits_only()
        self._thinned: dict[tuple[int, int], ClientPartition] = {}
        self._head_keys: tuple[str, ...] | None = None
        self._public_and_test: tuple[TensorSplit, TensorSplit] | None = None

    def _check_digits_only(self) -> None:
        """The peer workload's options exist for the offline digits alone."""
        cfg = self.config
        for key, used in (
            ("vision.partitioner", cfg.partitioner == "array-split"),
            ("vision.normalize", not cfg.normalize),
        ):
            if used and self.SPEC.hf_id is not None:
                value = "'array-split'" if key == "vision.partitioner" else "false"
                raise ConfigError(
                    f"{key!r} = {value} is the shared peer workload's (digits); valid tasks: "
                    "'digits'"
                )

    def _check_classes_per_client(self) -> None:
        cfg, num_classes = self.config, self.SPEC.num_classes
        if cfg.partitioner == "pathological" and cfg.classes_per_client > num_classes:
            raise ConfigError(
                f"'vision.classes-per-client' = {cfg.classes_per_client} exceeds the "
                f"{num_classes} classes of {self.name}; valid range: [1, {num_classes}]"
            )

    def _resolve_groups(self, grouping: str) -> dict[str, tuple[int, ...]]:
        """The label groups ``vision.grouping`` names for this dataset (``auto`` resolved)."""
        if grouping not in self.GROUPINGS:
            raise ConfigError(
                f"'vision.grouping' = {grouping!r} is not valid for {self.name}; valid values: "
                + ", ".join(repr(g) for g in self.GROUPINGS)
            )
        grouping = self.DEFAULT_GROUPING if grouping == "auto" else grouping
        return label_groups(grouping, self.SPEC.num_classes)

    def _check_group_keep(self) -> None:
        cfg = self.config
        if cfg.group_keep < 1.0 and not cfg.groups:
            raise ConfigError(
                f"'vision.group-keep' = {cfg.group_keep} thins the last label group, but "
                f"{self.name} has none ('vision.grouping' resolves to 'none'); set "
                "'vision.group-keep' = 1 or 'vision.grouping' to one of "
                + ", ".join(repr(g) for g in self.GROUPINGS if g not in ("auto", "none"))
            )

    def groups(self) -> dict[str, tuple[int, ...]]:
        """The label groups of the fairness metrics, name -> labels (empty: none)."""
        return dict(self.config.groups)

    @property
    def device(self) -> torch.device:
        """The device local training and evaluation run on."""
        return torch.device(self.config.device)

    def build_model(self, seed: int) -> nn.Module:
        """A fresh model (``vision.model``) for this dataset, weights drawn from ``seed``."""
        spec = self.SPEC
        return build_model(
            self.config.model, spec.in_channels, spec.num_classes, spec.image_size, seed
        )

    def load_partition(self, partition_id: int, num_partitions: int) -> ClientPartition:
        """Client ``partition_id`` of ``num_partitions``: local train and test splits.

        With ``vision.group-keep`` < 1 the train split keeps only that fraction of the
        last label group's examples (``thin_labels``, seeded
        by the run seed and ``partition_id``); the local test split is untouched.
        """
        cfg = self.config
        if cfg.group_keep == 1.0:
            return self._load_partition(partition_id, num_partitions)
        key = (partition_id, num_partitions)
        if key not in self._thinned:
            partition = self._load_partition(partition_id, num_partitions)
            last = list(cfg.groups.values())[-1]
            rng = group_keep_rng(cfg.seed, partition_id)
            train = thin_labels(partition.train, last, cfg.group_keep, rng)
            self._thinned[key] = replace(partition, train=train)
        return self._thinned[key]

    def check_partitioning(self, num_partitions: int) -> None:
        """Digits (shipped with scikit-learn, so the server has it): ConfigError when a
        contiguous partitioning would leave clients without data. A Hub dataset is
        checked where its partitions are built, on the clients."""
        if self.SPEC.hf_id is None:
            cfg = self.config
            check_digits_partitioning(
                cfg.partition_settings, cfg.central_test_fraction, num_partitions
            )

    def _load_partition(self, partition_id: int, num_partitions: int) -> ClientPartition:
        """The (cached) partition as the partitioner made it."""
        cfg = self.config
        if self.SPEC.hf_id is None:
            return load_digits_partition(
                cfg.partition_settings, cfg.central_test_fraction, partition_id, num_partitions
            )
        from tasks.vision import hub  # Hugging Face datasets: only for Hub datasets

        central = hub.hub_central_fraction(self.SPEC, cfg.central_test_fraction)
        return hub.load_hub_partition(
            self.SPEC, cfg.partition_settings, central, partition_id, num_partitions
        )

    @property
    def head_only(self) -> bool:
        return self.subspace.head_only

    @property
    def warm_start_epochs(self) -> int:
        return self.subspace.warm_start

    def head_keys(self) -> tuple[str, ...]:
        """State-dict keys of the head: weight and bias of the last ``nn.Linear`` of a
        freshly built ``vision.model`` (``head_parameter_names``)."""
        if self._head_keys is None:
            self._head_keys = head_parameter_names(self.build_model(self.config.seed))
        return self._head_keys

    def load_central_test(self) -> CentralTestSet:
        """The server's held-out test set; with ``subspace.warm-start`` > 0 only its part
        that is not public (the rest of ``load_public``)."""
        if self.subspace.warm_start == 0:
            return self._load_held_out()
        return CentralTestSet(self._split_held_out()[1])

    def load_public(self) -> TensorSplit:
        """The public warm-start data: a seeded stratified ``subspace.public-fraction``
        of the server's held-out set (``split_public``).

        Raises
        ------
        ConfigError
            If ``subspace.warm-start`` is 0 (there is no public split then).
        """
        if self.subspace.warm_start == 0:
            raise ConfigError(
                "'subspace.warm-start' = 0: there is no public split without a warm start; "
                "valid range for one: [1, inf)"
            )
        return self._split_held_out()[0]

    def _load_held_out(self) -> CentralTestSet:
        """The whole held-out set (digits: central ids; Hub: the test split)."""
        cfg = self.config
        if self.SPEC.hf_id is None:
            return load_digits_central_test(
                cfg.central_split_seed, cfg.central_test_fraction, cfg.normalize
            )
        from tasks.vision import hub

        central = hub.hub_central_fraction(self.SPEC, cfg.central_test_fraction)
        return hub.load_hub_central_test(self.SPEC, cfg.seed, central)

    def _split_held_out(self) -> tuple[TensorSplit, TensorSplit]:
        """(public, central test) parts of the held-out set, split once per task."""
        if self._public_and_test is None:
            fraction, held_out = self.subspace.public_fraction, self._load_held_out().test
            try:
                self._public_and_test = split_public(held_out, fraction, self.config.seed)
            except ValueError as err:
                raise ConfigError(
                    f"'subspace.public-fraction' = {fraction} cannot split the "
                    f"{len(held_out)} held-out examples of {self.name} by class ({err}); "
                    "valid range: (0, 1), leaving each class an example on both sides"
                ) from err
        return self._public_and_test

    def public_gradients(
        self, model: nn.Module, keys: Sequence[str], labels: Collection[int] | None = None
    ) -> np.ndarray:
        """Per-example gradients (n, d) on ``load_public`` w.r.t. the state-dict
        entries ``keys`` (``per_example_gradients``): the
        public geometry ``subspace.init = "public"`` starts from.

        With ``labels`` (e.g. one group of ``groups``) only the public examples
        whose label is in it are used.

        Raises
        ------
        ValueError
            If no public example has a label in ``labels``.
        """
        public = self.load_public()
        if labels is not None:
            public = public.with_labels(labels)
            if len(public) == 0:
                raise ValueError(
                    f"'labels' = {sorted(labels)}: no public example of {self.name} has one "
                    f"of these labels; valid labels: 0 .. {self.SPEC.num_classes - 1}"
                )
        return per_example_gradients(model, public, keys, batch_size=self.config.batch_size)

    def warm_start(self, model: nn.Module) -> dict[str, float]:
        """``subspace.warm-start`` epochs of SGD on ``load_public``, in place.

        Central training of the whole model before round 1 with ``vision.lr`` (no decay),
        ``vision.momentum``, ``vision.weight-decay`` and ``vision.batch-size``; shuffling
        and dropout draw from a seed derived from the run seed (round 0, in which no
        client trains), the global RNG is restored. The model is back on the CPU.

        Returns
        -------
        dict
            ``warm-start-loss`` and ``warm-start-accuracy`` of the last epoch; empty,
            with ``model`` untouched, when ``subspace.warm-start`` is 0.
        """
        cfg, device = self.config, self.device
        if self.subspace.warm_start == 0:
            return {}
        seed = local_seed(cfg.seed, 0, 0)
        loader = make_loader(self.load_public(), cfg.batch_size, shuffle=True, seed=seed)
        model.to(device)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        loss, accuracy = 0.0, 0.0
        try:
            with self._seeded(seed):
                for _ in range(self.subspace.warm_start):
                    loss, accuracy = train_epoch(model, loader, optimizer, device, [], 0.0)
        finally:
            model.to("cpu")
        return {WARM_START_LOSS: float(loss), WARM_START_ACCURACY: float(accuracy)}

    @contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """Training context: the global RNG forked and seeded with ``seed``, and
        ``vision.deterministic``; a missing deterministic kernel becomes a ConfigError."""
        cfg, device = self.config, self.device
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with (
                torch.random.fork_rng(devices=rng_devices),
                deterministic_torch(cfg.deterministic),
            ):
                seed_torch(seed, device)
                yield
        except RuntimeError as err:
            if cfg.deterministic and "deterministic" in str(err):
                raise ConfigError(
                    f"'vision.deterministic' = true, but vision.model = {cfg.model!r} "
                    f"uses an operation without a deterministic implementation on "
                    f"{device.type} ({err}); set 'vision.deterministic' = false or pick "
                    "another 'vision.model'"
                ) from err
            raise

    def _head_only(self, model: nn.Module) -> AbstractContextManager[None]:
        """``train_head_only`` if ``subspace.head-only``."""
        return (
            train_head_only(model, self.head_keys()) if self.subspace.head_only else nullcontext()
        )

    def train(
        self, model: nn.Module, partition: ClientPartition, local: LocalTraining
    ) -> dict[str, float]:
        """``vision.local-epochs`` epochs of SGD on the partition's train split, in place.

        The parameters received are the proximal anchor; shuffling, Poisson sampling,
        DP-SGD noise and dropout draw from ``local.seed`` (the global RNG is restored
        on return). With ``local.dp_sgd`` the model trains with DP-SGD, the
        accountant history in ``local.state`` is extended and the cumulative
        ``local-epsilon`` is reported. The learning rate follows ``decayed_lr``
        over the client's cumulative epochs (``local.state``). With
        ``subspace.head-only`` only the head trains: every other state-dict tensor is
        unchanged on return (``train_head_only``). The model
        is back on the CPU on return.
        """
        cfg = self.config
        loader: DataLoader | ShuffledBatches
        if local.dp_sgd is None and local.local_updates is None and len(partition.train):
            # Plain epochs: the DataLoader's batches without its per-batch machinery.
            loader = ShuffledBatches(partition.train, cfg.batch_size, local.seed)
        else:
            loader = make_loader(partition.train, cfg.batch_size, shuffle=True, seed=local.seed)
        with on_device(model, self.device), self._seeded(local.seed), self._head_only(model):
            metrics = self._train_epochs(model, loader, local)
        return {NUM_EXAMPLES: len(partition.train), **metrics}

    def _train_epochs(
        self, model: nn.Module, loader: Any, local: LocalTraining
    ) -> dict[str, float]:
        """Run the local epochs, with DP-SGD if ``local.dp_sgd``; return the metrics."""
        cfg = self.config
        # FedProx's anchor (the received parameters): copied only when mu > 0 reads it.
        global_params = snapshot_parameters(model) if local.proximal_mu > 0 else []
        optimizer = torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        if local.dp_sgd is not None:
            return self._train_private(model, loader, optimizer, global_params, local)
        if local.local_updates is not None:  # hierarchical FL: tau_1 iterations
            epochs_done = int(local.state.get(EPOCHS_DONE_KEY, 0))
            lr = decayed_lr(cfg.lr, cfg.lr_decay, cfg.lr_decay_epochs, epochs_done)
            for group in optimizer.param_groups:
                group["lr"] = lr
            metrics = train_local_updates(
                model, loader, optimizer, self.device, local, global_params
            )
            self._count_epochs(local.state, epochs_done + 1)
            return metrics
        loss, accuracy = self._run_epochs(
            model, loader, optimizer, global_params, local.proximal_mu, local.state
        )
        return {TRAIN_LOSS: loss, TRAIN_ACCURACY: accuracy}

    def _run_epochs(
        self,
        model: nn.Module,
        loader: Any,
        optimizer: torch.optim.Optimizer,
        global_params: list[torch.Tensor],
        proximal_mu: float,
        state: dict[str, Any],
    ) -> tuple[float, float]:
        """``vision.local-epochs`` passes at the decayed LR; loss and accuracy of the last.

        Counts the epochs in ``state[EPOCHS_DONE_KEY]`` (the client's cumulative epochs)
        under a decaying schedule.
        """
        cfg = self.config
        loss, accuracy = 0.0, 0.0
        epochs_done = int(state.get(EPOCHS_DONE_KEY, 0))
        for _ in range(cfg.local_epochs):
            lr = decayed_lr(cfg.lr, cfg.lr_decay, cfg.lr_decay_epochs, epochs_done)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, accuracy = train_epoch(
                model, loader, optimizer, self.device, global_params, proximal_mu
            )
            epochs_done += 1
        self._count_epochs(state, epochs_done)
        return float(loss), float(accuracy)

    def _count_epochs(self, state: dict[str, Any], epochs_done: int) -> None:
        """Keep the client's epoch count when the LR schedule decays (the schedule is
        all it is for). Without decay the state stays empty, so a FedAvg client writes
        no state file per message (0.5 ms of each message of a 1 000-client run)."""
        if self.config.lr_decay != 1.0:
            state[EPOCHS_DONE_KEY] = epochs_done

    def _train_private(
        self,
        model: nn.Module,
        loader: DataLoader,
        optimizer: torch.optim.Optimizer,
        global_params: list[torch.Tensor],
        local: LocalTraining,
    ) -> dict[str, float]:
        """DP-SGD epochs (``privacy.dpsgd.train_private``); extends the accountant
        history in ``local.state``. The proximal gradient goes on the public path."""

        def run_epochs(
            private_loader: DataLoader, private_optimizer: torch.optim.Optimizer
        ) -> dict[str, float]:
            loss, accuracy = self._run_epochs(
                model, private_loader, private_optimizer, global_params, 0.0, local.state
            )
            return {TRAIN_LOSS: loss, TRAIN_ACCURACY: accuracy}

        return train_private(
            model, optimizer, loader, local, epochs=self.config.local_epochs,
            global_params=global_params, run_epochs=run_epochs,
            model_name=self.config.model,
        )  # fmt: skip

    def _calibrated(self, local: LocalTraining, sample_rate: float) -> DPSGD:
        """``local.dp_sgd`` with the noise multiplier for its target epsilon, if any
        (``privacy.dpsgd.calibrated_settings`` over ``vision.local-epochs``)."""
        return calibrated_settings(local, sample_rate=sample_rate, epochs=self.config.local_epochs)

    def evaluate(
        self, model: nn.Module, data: ClientPartition | CentralTestSet | TensorSplit
    ) -> dict[str, float]:
        """Loss and accuracy on a partition's local test split or the central test set.

        With label groups (``vision.grouping``) also each group's ``eval-accuracy-<g>`` and
        ``num-examples-<g>`` and the ``fairness-gap``
        (``group_metrics``), from the same forward pass. All
        metrics are 0.0 on an empty split.
        """
        cfg, split = self.config, evaluation_split(data)
        with on_device(model, self.device):
            total_loss, correct, counts = tally_split(
                model, split, cfg.batch_size, self.device, self.SPEC.num_classes
            )
        n = len(split)
        metrics: dict[str, float] = {
            NUM_EXAMPLES: n,
            EVAL_LOSS: total_loss / n if n else 0.0,
            EVAL_ACCURACY: int(correct.sum()) / n if n else 0.0,
        }
        if cfg.groups:
            metrics.update(group_metrics(correct, counts, cfg.groups))
        return metrics


class DigitsTask(ImageClassificationTask):
    """scikit-learn's 8x8 digits (1797 images, 10 classes); works offline."""

    name = "digits"
    SPEC = DIGITS


class MNISTTask(ImageClassificationTask):
    """MNIST (Hugging Face ``ylecun/mnist``), 28x28 grayscale, 10 classes."""

    name = "mnist"
    SPEC = MNIST


class CIFAR10Task(ImageClassificationTask):
    """CIFAR-10 (Hugging Face ``uoft-cs/cifar10``), 32x32 RGB, 10 classes."""

    name = "cifar10"
    SPEC = CIFAR10
    DEFAULT_MODEL = "cnn"


class EMNISTTask(ImageClassificationTask):
    """EMNIST ByClass, 62 classes (Hugging Face ``flwrlabs/femnist``), 28x28 grayscale."""

    name = "emnist"
    SPEC = EMNIST
    GROUPINGS = ("auto", "none", "digits-letters", "low-high")
    DEFAULT_GROUPING = "digits-letters"
