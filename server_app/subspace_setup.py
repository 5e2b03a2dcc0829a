"""What subspace-dp takes from public data before round 1 (Subspace-DP-FL), at no privacy cost.

The server's public split (the vision tasks' warm-start data) gives per-example
gradients of the released arrays; from them the app sets the strategy's initial U
(``subspace.init = "public"``) and the samples its trace allocation reads
(``subspace.allocation``: pooled, and per group for the fairness program).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from logging import INFO
from typing import Protocol, cast

import numpy as np
import torch
from flwr.common.logger import log

from config.options import ConfigError
from privacy.subspace import top_subspace
from server_app.config import RunConfig
from strategies.mechanisms.subspace_dp import POOLED, SubspaceDP, SubspaceSettings
from strategies.runtime.capabilities import layers
from tasks.base import Task


class PublicData(Protocol):
    """What the app reads of a task with a public split (the vision tasks)."""

    def groups(self) -> dict[str, tuple[int, ...]]: ...
    def public_gradients(
        self, model: torch.nn.Module, keys: Sequence[str], labels: Collection[int] | None = None
    ) -> np.ndarray: ...
    def warm_start(self, model: torch.nn.Module) -> dict[str, float]: ...


def check(cfg: RunConfig, task: Task) -> None:
    """Refuse, before any work, what the task cannot provide."""
    if cfg.privacy != "subspace-dp" or cfg.part(SubspaceSettings).allocation != "fairness":
        return
    groups = task.groups() if hasattr(task, "groups") else {}
    if len(groups) < 2:
        raise ConfigError(
            "'subspace.allocation' = 'fairness' balances groups of the data: task "
            f"{cfg.task!r} has {len(groups)} group(s) here; set 'vision.grouping' (e.g. "
            "'low-high', or 'digits-letters' on emnist) or another 'subspace.allocation'"
        )


def prepare(cfg: RunConfig, task: Task, model: torch.nn.Module, strategy, released) -> None:
    """Give ``strategy``'s subspace-dp layer (when it has one: it may sit inside a server
    optimizer) its public basis and samples."""
    strategy = next((layer for layer in layers(strategy) if isinstance(layer, SubspaceDP)), None)
    if strategy is None:
        return
    wants_basis = strategy.init == "public"
    if not wants_basis and strategy.allocation == "uniform":
        return
    public = cast(PublicData, task)
    gradients = public.public_gradients(model, released)
    if wants_basis:
        strategy.initial_basis = top_subspace(gradients, strategy.rank)
        log(
            INFO,
            "Subspace-DP: initial metric from %d public per-example gradients (no privacy cost)",
            len(gradients),
        )
    if strategy.allocation == "uniform":
        return
    samples = {POOLED: gradients}
    if strategy.allocation == "fairness":
        for name, labels in public.groups().items():
            samples[name] = public.public_gradients(model, released, labels=labels)
    strategy.public_samples = samples
    log(
        INFO,
        "Subspace-DP: %s allocation from public gradients (%s)",
        strategy.allocation,
        ", ".join(f"{name} {len(x)}" for name, x in samples.items()),
    )
