"""Disposable-income regression on the Indian personal-finance table (the SmartFedProx study).

Each client trains the study's MLP (``tasks.finance.model``) with Adam on the MSE
of the standardised target, plus the FedProx proximal term (Li et al., 2020) when
the server sends ``proximal_mu > 0``. Clients hold the study's non-IID partitions
(``tasks.finance.partitioning``) of the table's client pool; the server evaluates
on a held-out central test set. Metrics: MSE on the standardised target and R²
(R² is invariant to the target's affine scaling, so it equals R² in rupees).

Design notes: ``docs/notes.md``, ``tasks.finance.task``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from config.options import ConfigError, Option
from config.settings import Settings, setting
from privacy.dpsgd import train_private
from tasks.base import (
    EVAL_LOSS,
    NUM_EXAMPLES,
    SEED,
    TRAIN_LOSS,
    LocalTraining,
    Task,
    resolve_device,
    seed_torch,
)
from tasks.finance.data import (
    PARTITION_STREAM,
    SPLIT_STREAM,
    PreparedData,
    describe_source,
    prepared_data,
)
from tasks.finance.model import NORMS, batchnorm_state_keys, build_model
from tasks.finance.partitioning import parse_scheme, partition_rows, split_local
from tasks.proximal import proximal_term, snapshot_parameters

EVAL_MSE = "eval-mse"
EVAL_R2 = "eval-r2"
EVAL_CHUNK = 4096  # rows per forward pass in evaluation (eval-mode BN: no batch effect)
PRIVACY_KEY, DP_SGD = "privacy", "dp-sgd"  # the top-level key finance.norm = auto reads


@dataclass(frozen=True)
class FinanceConfig(Settings):
    """The run-config of the finance task: each keyed field declares its ``finance.*``
    key once (default, range, help); the task reads its options as one instance,
    ``auto`` values resolved and the derived fields filled in."""

    PREFIX: ClassVar[str] = "finance"

    data_path: str = setting(
        "",
        "CSV of Kaggle's Indian personal finance data; empty: a synthetic table with its schema.",
    )
    synthetic_rows: int = setting(20000, "Rows of the synthetic table.", low=100)
    central_test_fraction: float = setting(
        0.2, "Share of rows held out for the server.", low=0.05, high=0.5
    )
    test_fraction: float = setting(
        0.2, "Share of each client's rows held out locally.", low=0.05, high=0.5
    )
    partitioning: str = setting(
        "multi-key+label-skew+quantity-skew",
        "`iid` or a `+`-joined combination of multi-key, label-skew, quantity-skew.",
    )
    batch_size: int = setting(64, "Mini-batch size of local training.", low=2)
    local_epochs: int = setting(3, "Local epochs per round.", low=1)
    lr: float = setting(1e-3, "Adam learning rate.", low=0.0, low_open=True)
    bn: str = setting(
        "average",
        "BatchNorm layers: `average` (federated) or `local` (FedBN: kept on each client).",
        choices=("average", "local"),
    )
    norm: str = setting(
        "auto",
        "Normalisation in the MLP: `batch` (BatchNorm) or `layer` (LayerNorm, per example: "
        "DP-SGD can train it); `auto`: `layer` under privacy = `dp-sgd`, else `batch`.",
        choices=("auto", *NORMS),
    )
    """``auto`` resolved to ``batch`` or ``layer`` by the task."""
    device: str = setting(
        "auto", "Device; `auto`: cuda when available.", choices=("auto", "cpu", "cuda")
    )
    """``auto`` resolved to ``cpu`` or ``cuda`` by the task."""

    # Derived by the task, not keys of its own:
    scheme: tuple[str, ...] = ()
    """``partitioning`` parsed into its parts, ``()`` for iid."""
    seed: int = 0
    """Top-level ``seed``."""


FINANCE_OPTIONS: tuple[Option, ...] = FinanceConfig.options()


@dataclass(frozen=True)
class RegressionSplit:
    """Standardised features and target of some rows.

    Attributes
    ----------
    features : torch.Tensor
        ``float32 (N, 26)``.
    target : torch.Tensor
        ``float32 (N,)``.
    ids : torch.Tensor
        ``int64 (N,)``: the rows of the table.
    """

    features: torch.Tensor
    target: torch.Tensor
    ids: torch.Tensor

    def __len__(self) -> int:
        return int(self.target.shape[0])


@dataclass(frozen=True)
class FinancePartition:
    """One client's data: its local train and test splits."""

    partition_id: int
    num_partitions: int
    train: RegressionSplit
    test: RegressionSplit


@dataclass(frozen=True)
class FinanceCentralTest:
    """The held-out rows the server evaluates the global model on."""

    test: RegressionSplit


def rows_split(data: PreparedData, rows: np.ndarray) -> RegressionSplit:
    """The rows ``rows`` of ``data`` as tensors."""
    return RegressionSplit(
        torch.from_numpy(data.features[rows]),
        torch.from_numpy(data.target[rows]),
        torch.from_numpy(np.asarray(rows, dtype=np.int64)),
    )


def partition_positions(cfg: FinanceConfig, num_partitions: int) -> list[np.ndarray]:
    """Each client's positions in the pool (``partition_rows``, seeded by the run);
    ConfigError when a client would get too few rows."""
    data = prepared_data(cfg.data_path, cfg.synthetic_rows, cfg.seed, cfg.central_test_fraction)
    rng = np.random.default_rng([cfg.seed, PARTITION_STREAM])
    pool = data.pool
    return partition_rows(data.keys[pool], data.brackets[pool], num_partitions, cfg.scheme, rng)


@lru_cache(maxsize=8)
def load_partitions(cfg: FinanceConfig, num_partitions: int) -> tuple[FinancePartition, ...]:
    """Every client's partition for ``num_partitions`` clients (cached per process)."""
    data = prepared_data(cfg.data_path, cfg.synthetic_rows, cfg.seed, cfg.central_test_fraction)
    pool = data.pool
    partitions = []
    for pid, part in enumerate(partition_positions(cfg, num_partitions)):
        rows = pool[part]
        split_rng = np.random.default_rng([cfg.seed, SPLIT_STREAM, pid])
        train, test = split_local(len(rows), cfg.test_fraction, split_rng)
        partitions.append(
            FinancePartition(
                pid, num_partitions, rows_split(data, rows[train]), rows_split(data, rows[test])
            )
        )
    return tuple(partitions)


def training_batches(
    num_rows: int, batch_size: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """A shuffled epoch's batches of row positions; a batch of one row (which
    BatchNorm cannot train on) is dropped."""
    order = torch.randperm(num_rows, generator=generator)
    return [batch for batch in order.split(batch_size) if len(batch) > 1]


def split_batches(
    split: RegressionSplit, batches: list[torch.Tensor]
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """(features, target) of each batch of row positions of ``split``."""
    return ((split.features[batch], split.target[batch]) for batch in batches)


def train_epoch(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    proximal: tuple[list[torch.Tensor], float],
) -> float:
    """One pass over the (features, target) ``batches``; returns the mean squared
    error per trained row, without the proximal term. ``proximal`` is (global
    parameters, mu).

    An empty batch (possible under DP-SGD's Poisson sampling) still makes an optimizer
    step: under DP-SGD that step releases pure noise, as the accountant assumes.
    """
    global_params, mu = proximal
    model.train()
    total, seen = 0.0, 0
    for features, target in batches:
        x, y = features.to(device), target.to(device)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        objective = loss + proximal_term(model, global_params, mu) if mu > 0 else loss
        objective.backward()
        optimizer.step()
        if len(y) == 0:
            continue
        total += loss.item() * len(y)
        seen += len(y)
    return total / seen if seen else 0.0


@torch.no_grad()
def predict(model: nn.Module, features: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Eval-mode predictions of ``model`` for ``features``, as a CPU ``(N,)`` tensor."""
    model.eval()
    chunks = [model(x.to(device)).reshape(-1).cpu() for x in features.split(EVAL_CHUNK)]
    return torch.cat(chunks) if chunks else torch.empty(0)


def resolve_norm(choice: str, dp_sgd: bool) -> str:
    """``finance.norm`` with ``auto`` resolved: ``layer`` under DP-SGD, else ``batch``."""
    if choice == "auto":
        return "layer" if dp_sgd else "batch"
    return choice


def regression_metrics(prediction: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """Mean squared error and R² = 1 - SSE / SST (computed in float64).

    As scikit-learn's ``r2_score`` (``force_finite=True``): a constant target gives
    1.0 if predicted exactly, else 0.0; no rows give (0.0, 0.0).
    """
    prediction, target = prediction.astype(np.float64), target.astype(np.float64)
    if len(target) == 0:
        return 0.0, 0.0
    sse = float(np.sum((prediction - target) ** 2))
    sst = float(np.sum((target - target.mean()) ** 2))
    r2 = 1.0 - sse / sst if sst > 0 else float(sse == 0)
    return sse / len(target), r2


class FinanceTask(Task):
    """Federated regression of disposable income (the SmartFedProx study).

    Options are ``FINANCE_OPTIONS`` (``finance.*``) plus the top-level ``seed``
    and ``privacy`` (which ``finance.norm = auto`` reads).
    ``load_partition`` returns a ``FinancePartition``, ``load_central_test`` a
    ``FinanceCentralTest``; ``evaluate`` accepts either, or a bare
    ``RegressionSplit``.
    """

    name = "finance"
    OPTIONS: ClassVar[tuple[Option, ...]] = FINANCE_OPTIONS
    SUPPORTS_DP_SGD: ClassVar[bool] = True  # with finance.norm = layer (auto's choice)
    EPOCHS_KEY: ClassVar[str | None] = "finance.local-epochs"

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        super().__init__(run_config)
        self.under_dp_sgd = run_config.get(PRIVACY_KEY) == DP_SGD
        """Whether the run-config's top-level ``privacy`` is ``dp-sgd``."""
        declared = FinanceConfig.from_options(self.options)
        self.config = replace(
            declared,
            scheme=parse_scheme(declared.partitioning),
            norm=resolve_norm(declared.norm, self.under_dp_sgd),
            device=resolve_device(declared.device, "finance.device"),
            seed=int(SEED.read(run_config)),
        )
        self._check_norm(declared.norm)

    def _check_norm(self, chosen: str) -> None:
        """FedBN needs BatchNorm layers; DP-SGD needs per-example normalisation
        (``chosen``: ``finance.norm`` as given)."""
        cfg = self.config
        how = f"'finance.norm' = {chosen!r}" + (
            f" (resolved to {cfg.norm!r})" if chosen == "auto" else ""
        )
        if cfg.bn == "local" and cfg.norm != "batch":
            raise ConfigError(
                f"'finance.bn' = 'local' keeps the BatchNorm layers on each client (FedBN), "
                f"but {how} builds the MLP with LayerNorm, which has none; valid values: "
                "'finance.bn' = 'average', or 'finance.norm' = 'batch' (not with "
                "privacy = 'dp-sgd')"
            )
        if self.under_dp_sgd and cfg.norm == "batch":
            raise ConfigError(
                f"{how} is not available with privacy = 'dp-sgd': BatchNorm mixes the "
                "examples of a batch, so per-example gradients are undefined; valid values "
                "with dp-sgd: 'finance.norm' = 'auto' or 'layer'"
            )

    @property
    def data_source(self) -> str:
        """The file path of the data, or ``"synthetic (seed S, N rows)"``."""
        cfg = self.config
        return describe_source(cfg.data_path, cfg.synthetic_rows, cfg.seed)

    @property
    def device(self) -> torch.device:
        """The device local training and evaluation run on."""
        return torch.device(self.config.device)

    def build_model(self, seed: int) -> nn.Module:
        """A fresh ``FinanceMLP`` with the resolved
        ``finance.norm``, weights drawn from ``seed``."""
        return build_model(seed, self.config.norm)

    def local_state_keys(self) -> tuple[str, ...]:
        """The BatchNorm state keys with ``finance.bn = local`` (FedBN), else ``()``."""
        if self.config.bn != "local":
            return ()
        return batchnorm_state_keys(build_model(0))

    def load_partition(self, partition_id: int, num_partitions: int) -> FinancePartition:
        """Client ``partition_id`` of ``num_partitions``: local train and test splits."""
        if num_partitions < 1 or not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition_id {partition_id} not in [0, {num_partitions})")
        return load_partitions(self.config, num_partitions)[partition_id]

    def check_partitioning(self, num_partitions: int) -> None:
        """ConfigError when ``finance.partitioning`` leaves a client fewer than
        ``MIN_PARTITION_ROWS`` rows: the split every
        client makes, made once by the ServerApp at start-up (the table is the one the
        central test set comes from), so that no client fails a round on it."""
        partition_positions(self.config, num_partitions)

    def load_central_test(self) -> FinanceCentralTest:
        """The server's held-out test rows."""
        cfg = self.config
        data = prepared_data(
            cfg.data_path, cfg.synthetic_rows, cfg.seed, cfg.central_test_fraction
        )
        return FinanceCentralTest(rows_split(data, data.central))

    def train(
        self, model: nn.Module, partition: FinancePartition, local: LocalTraining
    ) -> dict[str, float]:
        """``finance.local-epochs`` epochs of Adam on the MSE, in place.

        The parameters received are the proximal anchor; shuffling (a
        ``torch.Generator``) and dropout draw from ``local.seed`` (the global RNG is
        restored on return). ``train-loss`` is the mean MSE per row of the last
        epoch, without the proximal term. The model is back on the CPU on return.

        With ``local.dp_sgd`` the epochs are DP-SGD's (``privacy.dpsgd.train_private``):
        Poisson-sampled batches (sampling and noise draw from ``local.dp_seed``), the
        proximal gradient added after the noise, the accountant history in
        ``local.state`` extended, and the cumulative ``local-epsilon`` and this round's
        DP-SGD steps reported.

        Raises
        ------
        ConfigError
            If ``local.dp_sgd`` is set but ``finance.norm`` resolves to ``batch``:
            BatchNorm rules out per-example gradients.
        """
        if local.dp_sgd is not None and self.config.norm == "batch":
            raise ConfigError(
                "finance trains with dp-sgd only with 'finance.norm' = 'layer' (what "
                "'auto' resolves to under privacy = 'dp-sgd'): BatchNorm mixes the "
                "examples of a batch, so per-example gradients are undefined; valid "
                "values: 'finance.norm' = 'auto' with privacy = 'dp-sgd', or 'layer'"
            )
        device = self.device
        model.to(device)
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=rng_devices):
                seed_torch(local.seed, device)
                if local.dp_sgd is not None:
                    metrics = self._run_private_epochs(model, partition.train, local)
                else:
                    metrics = {TRAIN_LOSS: self._run_epochs(model, partition.train, local)}
        finally:
            model.to("cpu")
        return {NUM_EXAMPLES: len(partition.train), **metrics}

    def _run_epochs(self, model: nn.Module, split: RegressionSplit, local: LocalTraining) -> float:
        """The local epochs; the last epoch's mean MSE."""
        cfg = self.config
        proximal = (snapshot_parameters(model), local.proximal_mu)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        generator = torch.Generator().manual_seed(local.seed)
        loss = 0.0
        for _ in range(cfg.local_epochs):
            batches = training_batches(len(split), cfg.batch_size, generator)
            loss = train_epoch(
                model, split_batches(split, batches), optimizer, self.device, proximal
            )
        return float(loss)

    def _run_private_epochs(
        self, model: nn.Module, split: RegressionSplit, local: LocalTraining
    ) -> dict[str, float]:
        """The local epochs under DP-SGD; ``train-loss`` (the last epoch's mean MSE),
        ``local-epsilon`` and this round's steps."""
        cfg = self.config
        global_params = snapshot_parameters(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        loader = DataLoader(TensorDataset(split.features, split.target), cfg.batch_size)

        def run_epochs(
            private_loader: DataLoader, private_optimizer: torch.optim.Optimizer
        ) -> dict[str, float]:
            loss = 0.0
            for _ in range(cfg.local_epochs):  # the proximal term is on the public path
                loss = train_epoch(
                    model, private_loader, private_optimizer, self.device, ([], 0.0)
                )
            return {TRAIN_LOSS: float(loss)}

        return train_private(
            model, optimizer, loader, local, epochs=cfg.local_epochs,
            global_params=global_params, run_epochs=run_epochs,
            model_name=f"finance MLP (finance.norm = {cfg.norm!r})",
        )  # fmt: skip

    def evaluate(
        self, model: nn.Module, data: FinancePartition | FinanceCentralTest | RegressionSplit
    ) -> dict[str, float]:
        """MSE (``eval-loss`` and ``eval-mse``) and R² on the standardised target, on a
        partition's local test split, the central test set or a bare split."""
        if isinstance(data, FinancePartition | FinanceCentralTest):
            split = data.test
        elif isinstance(data, RegressionSplit):
            split = data
        else:
            raise TypeError(f"cannot evaluate on {type(data).__name__}")
        model.to(self.device)
        try:
            prediction = predict(model, split.features, self.device)
        finally:
            model.to("cpu")
        mse, r2 = regression_metrics(prediction.numpy(), split.target.numpy())
        return {NUM_EXAMPLES: len(split), EVAL_LOSS: mse, EVAL_MSE: mse, EVAL_R2: r2}
