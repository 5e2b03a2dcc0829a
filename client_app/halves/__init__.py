"""Each algorithm's client half, one module per algorithm, and how the ClientApp runs them.

A half (:class:`ClientHalf`) overrides only the hooks its algorithm changes; :data:`HALVES`
says when each half runs and in which order; :class:`Halves` calls the hooks of those a
message activates, around the task's own train and evaluate (:mod:`client_app.app`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType

# Not ``from client_app import canary``: this package's own ``canary`` half would shadow it.
from client_app import node, state
from client_app.canary import canary_index
from client_app.mods import mechanism
from privacy.mechanisms import FRONT_LOADED_MODES
from privacy.settings import AuditSettings
from protocol import keys
from protocol.records import to_state_dict
from tasks.base import LocalTraining, Task, local_seed


@dataclass
class Round:
    """One message on this node: the task, its model (weights loaded), the partition."""

    msg: Message
    context: Context
    task: Task
    model: torch.nn.Module
    partition: Any
    pid: int
    kept: dict[str, Any] = field(default_factory=dict)  # a half's values between hooks

    @property
    def config(self) -> ConfigRecord:
        return self.msg.content[keys.CONFIG]


class ClientHalf:
    """One algorithm's client half: hooks around the task's train and evaluate."""

    def without_training(self, msg: Message, context: Context) -> Message | None:
        """A train reply that needs no training (None: train)."""
        return None

    def weights(self, arrays: ArrayRecord, config: ConfigRecord, context: Context):
        """The weights to load instead of the received ``arrays``."""
        return arrays

    def loaded(self, r: Round) -> None:
        """After the weights are loaded into ``r.model``."""

    def seed_entropy(self, config: ConfigRecord) -> tuple[int, ...]:
        """More entropy for this training's local seed (independent streams)."""
        return ()

    def training(self, r: Round) -> dict[str, Any]:
        """Fields of :class:`tasks.base.LocalTraining` this algorithm sets."""
        return {}

    def trained(self, r: Round, metrics: dict[str, float]) -> dict[str, float]:
        """After training (before the state is saved): metrics to add to the reply."""
        return {}

    def reply(self, r: Round, metrics: dict[str, float], local: LocalTraining):
        """The train reply this algorithm sends instead of the trained model (or None)."""
        return None

    def evaluated(self, r: Round, metrics: dict[str, float]) -> None:
        """After evaluation: change the reply's metrics in place."""


Runs = Callable[[ConfigRecord, Context], bool]


def _fedprox(config: ConfigRecord, context: Context) -> bool:
    # FedProx's mu or SmartFedProx's state, or a reply that may carry the divergence
    # (every reply does unless a privacy mechanism restricts it to other keys).
    allowed = config.get(keys.REPORT_METRICS)
    return (
        keys.PROXIMAL_MU in config
        or keys.SMART_EMA_ALPHA in config
        or allowed is None
        or keys.DIVERGENCE in allowed
    )


def _dpsgd(config: ConfigRecord, context: Context) -> bool:
    # This client's own run-config decides too: a server that leaves the settings out
    # cannot make a DP-SGD client train without it (the half then refuses to train).
    return keys.DPSGD_NOISE_MULTIPLIER in config or mechanism(context) == "dp-sgd"


def _front_loaded(config: ConfigRecord, context: Context) -> bool:
    return keys.FRONT_LOADED_MODE in config or mechanism(context) in FRONT_LOADED_MODES


def _fedbn(config: ConfigRecord, context: Context) -> bool:
    # Only a task that keeps layers on the client (e.g. finance.bn = 'local').
    return bool(node.task_of(context).local_state_keys())


def _canary(config: ConfigRecord, context: Context) -> bool:
    if not node.settings(AuditSettings, context.run_config).canaries:
        return False  # no audit: no node is a canary
    pid, num = node.node_partition(context.node_config)
    return canary_index(context.run_config, pid, num) is not None


# Every client half, in the order its hooks run (the first reply it gives is sent):
# name -> (whether this message and node run it, "module:Class").
HALVES: dict[str, tuple[Runs, str]] = {
    "local": (lambda c, _: bool(c.get(keys.LOCAL_ONLY)), "client_app.halves.local:LocalHalf"),
    "fedbn": (_fedbn, "client_app.halves.fedbn:FedBNHalf"),
    "fedprox": (_fedprox, "client_app.halves.fedprox:FedProxHalf"),
    "dpsgd": (_dpsgd, "client_app.halves.dpsgd:DPSGDHalf"),
    "hierarchical": (
        lambda c, _: keys.EDGE_ROUND in c or keys.LOCAL_UPDATES in c,
        "client_app.halves.hierarchical:HierarchicalHalf",
    ),
    "frontloaded": (_front_loaded, "client_app.halves.frontloaded:FrontLoadedHalf"),
    "canary": (_canary, "client_app.halves.canary:CanaryHalf"),
}


@cache
def half(path: str) -> ClientHalf:
    """The client half ``"module:Class"``, its module imported on first use."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)()


def active_halves(config: ConfigRecord, context: Context) -> list[ClientHalf]:
    """The halves this message runs on this node, in table order."""
    return [half(path) for runs, path in HALVES.values() if runs(config, context)]


@dataclass(frozen=True)
class Halves:
    """The halves one message runs on this node; each method calls one hook of every
    half in table order."""

    halves: tuple[ClientHalf, ...]

    @classmethod
    def of(cls, msg: Message, context: Context) -> Halves:
        return cls(tuple(active_halves(msg.content[keys.CONFIG], context)))

    def __iter__(self) -> Iterator[ClientHalf]:
        return iter(self.halves)

    def without_training(self, msg: Message, context: Context) -> Message | None:
        """The first reply a half sends without training (None: train)."""
        return next((m for h in self if (m := h.without_training(msg, context)) is not None), None)

    def prepare(self, msg: Message, context: Context) -> Round:
        """This node's task and partition, the model loaded with the weights to use (a
        fresh context first gets the state this client saved: :mod:`client_app.state`)."""
        task, model, partition, pid = node.setup(context)
        config, arrays = msg.content[keys.CONFIG], msg.content[keys.ARRAYS]
        if keys.SERVER_ROUND in config:
            artifacts = node.artifacts_dir(config, context.node_config)
            evaluate = msg.metadata.message_type == MessageType.EVALUATE
            round_ = int(config[keys.SERVER_ROUND])
            state.restore(context, artifacts, pid, round_, evaluate=evaluate)
        for h in self:
            arrays = h.weights(arrays, config, context)
        node.load_weights(model, to_state_dict(arrays))
        r = Round(msg, context, task, model, partition, pid)
        for h in self:
            h.loaded(r)
        return r

    def local_training(self, r: Round) -> LocalTraining:
        """What the task trains with: the local seed (with the halves' entropy), the
        task's kept state and the fields the halves set."""
        context, server_round = r.context, int(r.config[keys.SERVER_ROUND])
        more = [e for h in self for e in h.seed_entropy(r.config)]
        seed = local_seed(node.run_seed(context), server_round, r.pid, *more)
        fields = {k: v for h in self for k, v in h.training(r).items()}
        return LocalTraining(
            server_round=server_round, seed=seed, dp_seed=node.dp_seed(seed, context.run_config),
            state=node.task_state(context), state_tensors=node.task_tensors(context),
            partition_id=r.pid, artifacts_dir=node.artifacts_dir(r.config, context.node_config),
            **fields,
        )  # fmt: skip

    def trained(self, r: Round, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` with each half's added (a later half sees the earlier ones')."""
        for h in self:
            metrics |= h.trained(r, metrics)
        return metrics

    def reply(self, r: Round, metrics: dict[str, float], local: LocalTraining):
        """The first reply a half sends instead of the trained model (or None)."""
        return next((m for h in self if (m := h.reply(r, metrics, local)) is not None), None)

    def evaluated(self, r: Round, metrics: dict[str, float]) -> None:
        for h in self:
            h.evaluated(r, metrics)
