"""MovieLens-1M recommendations with NCF, one or more users per client (Subspace-DP-FL).

Subspace-DP-FL: "MovieLens-1M
Recommendations: Neural Collaborative Filtering (NCF), per-user personalized datasets,
AUC-based evaluation".

Design notes: ``docs/notes.md``, ``tasks.movielens.task``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from config.options import ConfigError, Option
from config.settings import Settings, setting
from tasks.base import (
    EVAL_LOSS,
    NUM_EXAMPLES,
    SEED,
    TRAIN_LOSS,
    LocalTraining,
    Task,
    resolve_device,
)
from tasks.movielens.data import (
    CENTRAL_TEST,
    EVAL_NEGATIVES,
    LOCAL_TEST,
    TRAIN,
    PreparedRatings,
    describe_source,
    prepared_ratings,
    sample_negatives,
)
from tasks.movielens.model import NeuMF, build_model, heldout_auc, hit_rate, score_pairs
from tasks.proximal import proximal_term, snapshot_parameters

EVAL_AUC = "eval-auc"
EVAL_HR10 = "eval-hr10"
HIT_RATE_CUTOFF = 10
PARTITION_STREAM = 0x05E2


@dataclass(frozen=True)
class MovieLensConfig(Settings):
    """The run-config of the movielens task: each keyed field declares its
    ``movielens.*`` key once (default, range, help); the task reads its options as one
    instance, ``auto`` resolved and the seed filled in."""

    PREFIX: ClassVar[str] = "movielens"

    data_path: str = setting(
        "",
        "MovieLens-1M `ratings.dat` (or its directory); "
        "empty: synthetic ratings with latent structure.",
    )
    synthetic_users: int = setting(600, "Users of the synthetic ratings.", low=10)
    synthetic_items: int = setting(400, "Items (movies) of the synthetic ratings.", low=200)
    positive_threshold: int = setting(
        4, "A rating >= this is a positive interaction.", low=1, high=5
    )
    negatives: int = setting(
        4, "Sampled negatives per training positive.", low=1, high=EVAL_NEGATIVES
    )
    embedding_dim: int = setting(16, "NeuMF embedding width d (MLP tower 2d -> d).", low=1)
    batch_size: int = setting(256, "Mini-batch size of local training.", low=1)
    local_epochs: int = setting(1, "Local epochs per round.", low=1)
    lr: float = setting(1e-3, "Adam learning rate.", low=0.0, low_open=True)
    device: str = setting(
        "auto", "Device; `auto`: cuda when available.", choices=("auto", "cpu", "cuda")
    )
    """``auto`` resolved to ``cpu`` or ``cuda`` by the task."""

    # Derived by the task, not a key of its own:
    seed: int = 0
    """Top-level ``seed``."""


MOVIELENS_OPTIONS: tuple[Option, ...] = MovieLensConfig.options()


@dataclass(frozen=True)
class PositiveInteractions:
    """Training positives of some users, and what negative sampling must avoid.

    Attributes
    ----------
    users, items : numpy.ndarray
        ``int64 (N,)``: the positive (user, item) pairs.
    rated_keys : numpy.ndarray
        Sorted keys ``user * num_items + item`` of everything these users rated
        (held-out items included): never sampled as negatives.
    num_items : int
        Size of the item catalogue.
    """

    users: np.ndarray
    items: np.ndarray
    rated_keys: np.ndarray
    num_items: int

    def __len__(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class HeldOut:
    """Held-out positives, one per user, with their evaluation negatives.

    Attributes
    ----------
    users, positives : numpy.ndarray
        ``int64 (N,)``.
    negatives : numpy.ndarray
        ``int64 (N, 99)``: distinct items the user never rated.
    """

    users: np.ndarray
    positives: np.ndarray
    negatives: np.ndarray

    def __len__(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class MovieLensPartition:
    """One client's users with their training positives and local-test positives."""

    partition_id: int
    num_partitions: int
    users: np.ndarray
    train: PositiveInteractions
    test: HeldOut


@dataclass(frozen=True)
class MovieLensCentralTest:
    """The server's held-out positive of every user (with >= 2 positives)."""

    test: HeldOut


def partition_users(
    num_users: int, partition_id: int, num_partitions: int, seed: int
) -> np.ndarray:
    """Sorted users whose rank in a seeded permutation is ``partition_id`` mod
    ``num_partitions`` (one user each when ``num_partitions == num_users``)."""
    if not 1 <= num_partitions <= num_users:
        raise ValueError(
            f"num_partitions must be in [1, {num_users}] (users), got {num_partitions}"
        )
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} not in [0, {num_partitions})")
    ranked = np.random.default_rng([seed, PARTITION_STREAM]).permutation(num_users)
    return np.sort(ranked[partition_id::num_partitions])


def heldout_split(data: PreparedRatings, rows: np.ndarray, role: int) -> HeldOut:
    """The held-out interactions with ``role`` among the sorted ``rows``."""
    rows = rows[data.role[rows] == role]
    at = np.searchsorted(data.heldout, rows)
    return HeldOut(data.ratings.users[rows], data.ratings.items[rows], data.heldout_negatives[at])


def training_positives(data: PreparedRatings, rows: np.ndarray) -> PositiveInteractions:
    """The training positives among ``rows`` (all ratings of some users), and the keys
    of all those ratings."""
    ratings, num_items = data.ratings, data.ratings.num_items
    mine = rows[data.role[rows] == TRAIN]
    rated = np.sort(ratings.users[rows] * num_items + ratings.items[rows])
    return PositiveInteractions(ratings.users[mine], ratings.items[mine], rated, num_items)


@lru_cache(maxsize=1024)
def load_partition_data(
    cfg: MovieLensConfig, partition_id: int, num_partitions: int
) -> MovieLensPartition:
    """Client ``partition_id`` of ``num_partitions`` (cached per process)."""
    data = prepared_ratings(
        cfg.data_path, cfg.synthetic_users, cfg.synthetic_items, cfg.seed, cfg.positive_threshold
    )
    users = partition_users(data.ratings.num_users, partition_id, num_partitions, cfg.seed)
    rows = data.rows_of(users)
    return MovieLensPartition(
        partition_id,
        num_partitions,
        users,
        training_positives(data, rows),
        heldout_split(data, rows, LOCAL_TEST),
    )


def training_instances(
    train: PositiveInteractions, negatives: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One epoch's shuffled (users, items, labels): every positive (label 1) and
    ``negatives`` fresh never-rated items per positive (label 0)."""
    sampled = sample_negatives(train.users, train.rated_keys, train.num_items, negatives, rng)
    users = np.concatenate([train.users, np.repeat(train.users, negatives)])
    items = np.concatenate([train.items, sampled.ravel()])
    labels = np.concatenate([np.ones(len(train)), np.zeros(sampled.size)]).astype(np.float32)
    order = rng.permutation(len(users))
    return users[order], items[order], labels[order]


def train_epoch(
    model: nn.Module,
    instances: tuple[np.ndarray, np.ndarray, np.ndarray],
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    proximal: tuple[list[torch.Tensor], float],
) -> float:
    """One pass over ``instances`` in order; returns the mean BCE per instance,
    without the proximal term. ``proximal`` is (global parameters, mu)."""
    global_params, mu = proximal
    device = next(model.parameters()).device
    users, items, labels = (torch.from_numpy(a).to(device) for a in instances)
    model.train()
    total = 0.0
    for start in range(0, len(labels), batch_size):
        batch = slice(start, start + batch_size)
        optimizer.zero_grad()
        logits = model(users[batch], items[batch])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels[batch])
        objective = loss + proximal_term(model, global_params, mu) if mu > 0 else loss
        objective.backward()
        optimizer.step()
        total += loss.item() * len(logits)
    return total / len(labels) if len(labels) else 0.0


def heldout_metrics(model: nn.Module, test: HeldOut, loss_negatives: int) -> dict[str, float]:
    """``eval-auc``, ``eval-hr10``, ``eval-loss`` and ``num-examples`` on ``test``;
    all 0.0 when it is empty (zero weight in any weighted average)."""
    if len(test) == 0:
        return {NUM_EXAMPLES: 0, EVAL_LOSS: 0.0, EVAL_AUC: 0.0, EVAL_HR10: 0.0}
    positive = score_pairs(model, test.users, test.positives)
    negative = score_pairs(
        model, np.repeat(test.users[:, None], EVAL_NEGATIVES, 1), test.negatives
    )
    logits = torch.from_numpy(np.concatenate([positive[:, None], negative[:, :loss_negatives]], 1))
    labels = torch.zeros_like(logits)
    labels[:, 0] = 1.0
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return {
        NUM_EXAMPLES: len(test),
        EVAL_LOSS: float(loss),
        EVAL_AUC: float(heldout_auc(positive, negative).mean()),
        EVAL_HR10: float(hit_rate(positive, negative, HIT_RATE_CUTOFF).mean()),
    }


class MovieLensTask(Task):
    """Federated NCF on MovieLens-1M or its synthetic twin, clients = groups of users.

    Options are ``MOVIELENS_OPTIONS`` (``movielens.*``) plus the top-level ``seed``.
    ``load_partition`` returns a ``MovieLensPartition``, ``load_central_test`` a
    ``MovieLensCentralTest``; ``evaluate`` accepts either, or a bare
    ``HeldOut``. ``num-examples`` of training is the client's number of training
    positives (each trained with ``movielens.negatives`` sampled negatives).
    """

    name = "movielens"
    OPTIONS: ClassVar[tuple[Option, ...]] = MOVIELENS_OPTIONS
    # No DP-SGD: its sample-level guarantee would cover one (user, item) instance of a
    # training set that is re-drawn every epoch (fresh negatives), which Opacus's
    # fixed-dataset Poisson sampling does not model; with users as clients, the
    # client-level mechanisms (dp-fedavg-*, laplace, subspace-dp) give the meaningful
    # user-level guarantee.
    SUPPORTS_DP_SGD: ClassVar[bool] = False
    PRIVACY_UNIT: ClassVar[str] = "all ratings of the client's users, in every round"
    EPOCHS_KEY: ClassVar[str | None] = "movielens.local-epochs"

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        super().__init__(run_config)
        declared = MovieLensConfig.from_options(self.options)
        self.config = replace(
            declared,
            device=resolve_device(declared.device, "movielens.device"),
            seed=int(SEED.read(run_config)),
        )

    @property
    def data_source(self) -> str:
        """The ``ratings.dat`` path, or ``"synthetic (seed S, U users, I items)"``."""
        cfg = self.config
        return describe_source(cfg.data_path, cfg.synthetic_users, cfg.synthetic_items, cfg.seed)

    @property
    def device(self) -> torch.device:
        """The device local training and evaluation run on."""
        return torch.device(self.config.device)

    def prepared(self) -> PreparedRatings:
        """The loaded ratings with their splits (cached per process)."""
        cfg = self.config
        return prepared_ratings(
            cfg.data_path, cfg.synthetic_users, cfg.synthetic_items, cfg.seed,
            cfg.positive_threshold,
        )  # fmt: skip

    def build_model(self, seed: int) -> NeuMF:
        """A fresh ``NeuMF`` sized to the data's users and
        items (loads the data), weights drawn from ``seed``."""
        ratings = self.prepared().ratings
        return build_model(ratings.num_users, ratings.num_items, self.config.embedding_dim, seed)

    def load_partition(self, partition_id: int, num_partitions: int) -> MovieLensPartition:
        """Client ``partition_id`` of ``num_partitions`` (at most one per user; out of range:
        ValueError from ``partition_users``, which is never cached)."""
        return load_partition_data(self.config, partition_id, num_partitions)

    def load_central_test(self) -> MovieLensCentralTest:
        """Every user's latest positive, held by the server."""
        data = self.prepared()
        return MovieLensCentralTest(heldout_split(data, data.heldout, CENTRAL_TEST))

    def train(
        self, model: nn.Module, partition: MovieLensPartition, local: LocalTraining
    ) -> dict[str, float]:
        """``movielens.local-epochs`` epochs of Adam on the BCE, in place.

        The parameters received are the proximal anchor; negatives and the shuffling
        draw from ``numpy.random.default_rng(local.seed)``. ``train-loss`` is the mean
        BCE per instance of the last epoch, without the proximal term. The model is
        back on the CPU on return.

        Raises
        ------
        ConfigError
            If ``local.dp_sgd`` is set (see ``SUPPORTS_DP_SGD``).
        """
        if local.dp_sgd is not None:
            raise ConfigError(
                "movielens does not support dp-sgd (re-sampled negatives make the training "
                "set differ every epoch); use a client-level mechanism instead, e.g. "
                "privacy='dp-fedavg-fixed' or privacy='laplace'"
            )
        cfg = self.config
        rng = np.random.default_rng(local.seed)
        model.to(self.device)
        try:
            proximal = (snapshot_parameters(model), local.proximal_mu)
            optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
            loss = 0.0
            for _ in range(cfg.local_epochs if len(partition.train) else 0):
                instances = training_instances(partition.train, cfg.negatives, rng)
                loss = train_epoch(model, instances, optimizer, cfg.batch_size, proximal)
        finally:
            model.to("cpu")
        return {NUM_EXAMPLES: len(partition.train), TRAIN_LOSS: float(loss)}

    def evaluate(
        self, model: nn.Module, data: MovieLensPartition | MovieLensCentralTest | HeldOut
    ) -> dict[str, float]:
        """``eval-auc``, ``eval-hr10``, ``eval-loss`` and ``num-examples`` (held-out
        users) on a partition's local test, the central test or a bare split."""
        if isinstance(data, MovieLensPartition | MovieLensCentralTest):
            test = data.test
        elif isinstance(data, HeldOut):
            test = data
        else:
            raise TypeError(f"cannot evaluate on {type(data).__name__}")
        model.to(self.device)
        try:
            return heldout_metrics(model, test, self.config.negatives)
        finally:
            model.to("cpu")
