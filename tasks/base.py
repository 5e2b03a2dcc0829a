"""The task protocol: what every task (vision, tabular, RL) offers the app.

A task runs without Flower: notebooks and single-agent baselines call the same
methods the ClientApp and ServerApp call. Models are ``torch.nn.Module``s, so their
``state_dict()`` is what travels between server and clients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from config.app import NUM_SERVER_ROUNDS as NUM_SERVER_ROUNDS
from config.app import SEED as SEED
from config.options import ConfigError, Option, parse_options

# DP-SGD's settings and metric, re-exported: a task's LocalTraining carries them.
from privacy.dpsgd import DPSGD as DPSGD
from privacy.dpsgd import LOCAL_EPSILON as LOCAL_EPSILON
from privacy.mechanisms import secret_seed

# Metric keys every task reports (kebab-case, stable across tasks).
from tasks.metric_keys import EVAL_ACCURACY as EVAL_ACCURACY
from tasks.metric_keys import EVAL_LOSS as EVAL_LOSS
from tasks.metric_keys import EVAL_REWARD as EVAL_REWARD
from tasks.metric_keys import NUM_EXAMPLES as NUM_EXAMPLES
from tasks.metric_keys import TRAIN_ACCURACY as TRAIN_ACCURACY
from tasks.metric_keys import TRAIN_LOSS as TRAIN_LOSS
from tasks.metric_keys import TRAIN_REWARD as TRAIN_REWARD
from tasks.metric_keys import TRAIN_SECONDS as TRAIN_SECONDS

if TYPE_CHECKING:
    from privacy.frontloaded import FrontLoadedDP


def local_seed(run_seed: int, server_round: int, partition_id: int, *more: int) -> int:
    """Seed for one client's local randomness in one round, derived from the run seed.

    Distinct (round, partition, *more) tuples get independent streams (numpy
    SeedSequence); ``more`` distinguishes several trainings in one round (e.g. the
    edge aggregations of hierarchical FL, whose noise must be independent).
    """
    entropy = [run_seed, server_round, partition_id, *more]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed torch's CPU generator, and the CUDA generators when training on CUDA.

    ``torch.manual_seed`` also queues a seed for CUDA, XPU and MTIA even when none is
    in use, and each queued call records a Python stack trace: about 1 ms per call on
    the 2-core machine, paid by every client message (``bench/vs_flower.py``). The CPU
    stream is the same as ``torch.manual_seed``'s.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


@contextmanager
def on_device(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """``model`` on ``device`` inside the block and back on the CPU after; nothing to
    do on the CPU (``Module.to`` walks every module even then: ~0.3 ms per client
    message for a small model)."""
    if device.type == "cpu":
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")


def resolve_device(choice: str, key: str) -> str:
    """Map a ``*.device`` option (``cpu``, ``cuda``, ``auto``) named ``key`` to ``cpu`` or
    ``cuda``; asking for CUDA on a machine without it is an error naming ``key``."""
    available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        raise ConfigError(
            f"{key!r} = 'cuda' but CUDA is not available on this machine; "
            "valid values here: 'auto', 'cpu'"
        )
    if choice == "auto":
        return "cuda" if available else "cpu"
    return choice


@dataclass(frozen=True)
class LocalTraining:
    """What the server asks of one client's local training in one round.

    Attributes
    ----------
    server_round, partition_id : int
        The round being trained (1-based) and the client's partition id.
    seed : int
        Seed of this round's local randomness (from the run seed, round and partition).
    proximal_mu : float
        Weight of FedProx's term ``(mu/2)||w - w_global||^2``; 0 disables it.
    dp_sgd : DPSGD, optional
        Train with sample-level DP-SGD (the task reports ``local-epsilon``).
    state, state_tensors : dict
        The client's persistent JSON state and tensors (e.g. PPO's Adam moments), kept
        by the ClientApp between rounds, updated in place; never sent anywhere.
    artifacts_dir : str, optional
        Directory for the client's own diagnostic files (never sent); ``None``: none.
    local_updates : int, optional
        Hierarchical FL (tau_1): this many mini-batch iterations instead of epochs.
    front_loaded : privacy.frontloaded.FrontLoadedDP, optional
        The front-loaded DP client mode (CG-NG, CG-NP, CP-NP).
    dp_seed : int
        Seed of the randomness a DP guarantee rests on: 63 bits of OS entropy unless
        ``dp.reproducible-noise``; never derived from what the server or others know.
    """

    server_round: int
    seed: int
    proximal_mu: float = 0.0
    dp_sgd: DPSGD | None = None
    state: dict[str, Any] = field(default_factory=dict)
    state_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    partition_id: int = 0
    artifacts_dir: str | None = None
    local_updates: int | None = None
    front_loaded: FrontLoadedDP | None = None
    dp_seed: int = field(default_factory=secret_seed)


class Task(ABC):
    """One learning task: model, data and partitioning, local train and evaluate.

    Subclasses declare their run-config keys in ``OPTIONS``; the constructor parses
    and validates them, so an invalid value fails when the task is built, before
    any data is loaded.
    """

    name: ClassVar[str]
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    SUPPORTS_DP_SGD: ClassVar[bool] = True  # sample-level DP-SGD (Opacus) in train()
    # What one client contributes: the unit a client-level epsilon protects.
    PRIVACY_UNIT: ClassVar[str] = "one client's whole local dataset, in every round"
    # The option holding the local epochs per round (SmartFedProx scales mu by it);
    # None: the task has no epochs (e.g. PPO's env steps), counted as 1.
    EPOCHS_KEY: ClassVar[str | None] = None
    # Trains for LocalTraining.local_updates iterations and runs the frontloaded-dp-hfl client
    # Trains for LocalTraining.local_updates iterations and runs the front-loaded DP client
    # modes (LocalTraining.front_loaded): usable under strategy = "hierarchical".
    HIERARCHICAL: ClassVar[bool] = False

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        self.options = parse_options(run_config, self.OPTIONS)

    def partition_from_node_config(self, node_config: Mapping[str, Any]) -> Any | None:
        """The partition a real SuperNode describes in its ``node_config``, if it does
        (e.g. an RL client's environment); ``None``: use ``load_partition``."""
        return None

    def local_state_keys(self) -> tuple[str, ...]:
        """State-dict keys that stay on the client (e.g. FedBN's BatchNorm layers): the
        ClientApp restores them from its own state after loading the global weights."""
        return ()

    @property
    def head_only(self) -> bool:
        """Whether only the model's head trains and travels (``subspace.head-only``)."""
        return False

    @property
    def warm_start_epochs(self) -> int:
        """Epochs of central training on public data before round 1
        (``subspace.warm-start``; 0: none)."""
        return 0

    def head_keys(self) -> tuple[str, ...]:
        """State-dict keys of the model's head, the only part that trains and travels
        under head-only training (``subspace.head-only``).

        Raises
        ------
        ConfigError
            Here, always: only the vision tasks have a head-only mode.
        """
        raise ConfigError(
            f"task {self.name!r} has no head-only mode ('subspace.head-only'); "
            "valid tasks: 'digits', 'mnist', 'cifar10', 'emnist'"
        )

    def train_size(self, partition: Any) -> int:
        """Training examples in ``partition`` (hierarchical FL weights edges by them)."""
        return len(partition.train)

    def weight_bound(self, partition: Any) -> int | None:
        """The most ``num-examples`` a train reply on ``partition`` reports (the server
        caps that client's weight by it), or None where it counts no data."""
        return self.train_size(partition)

    def num_partitions(self) -> int | None:
        """The number of clients this task's configuration defines, or ``None`` when
        it splits its data among any number of clients."""
        return None

    def check_partitioning(self, num_partitions: int) -> None:
        """Raise ``ConfigError`` when the data cannot be split into
        ``num_partitions`` clients that each hold some (the ServerApp asks at start-up,
        before any message); the default checks nothing."""
        return None

    @abstractmethod
    def build_model(self, seed: int) -> torch.nn.Module:
        """Return a freshly initialised model (weights drawn from ``seed``)."""

    @abstractmethod
    def load_partition(self, partition_id: int, num_partitions: int) -> Any:
        """Return client ``partition_id``'s data: its train and local test splits."""

    @abstractmethod
    def load_central_test(self) -> Any:
        """Return the held-out central test set the server evaluates on."""

    @abstractmethod
    def train(
        self, model: torch.nn.Module, partition: Any, local: LocalTraining
    ) -> dict[str, float]:
        """Train ``model`` in place on the partition's train split.

        Returns metrics including ``num-examples`` and ``train-loss``.
        """

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, data: Any) -> dict[str, float]:
        """Evaluate ``model``; ``data`` is a partition or the central test set.

        Returns metrics including ``num-examples``, ``eval-loss`` and, for
        classification, ``eval-accuracy``.
        """
