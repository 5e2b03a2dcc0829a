"""This node's side of every message: its task, partition, model and saved state.

The task, its data partition and the model object are built once per process and
reused across messages (only the weights change per message).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

import tasks
from client_app import canary
from privacy.mechanisms import secret_seed
from privacy.settings import AuditSettings, DPSettings
from protocol import keys
from protocol.records import new_record, to_array, to_state_dict
from tasks.base import SEED, LocalTraining, Task

S = TypeVar("S")
_DP_STREAM = 0xD5  # dp.reproducible-noise: the DP seed's stream beside the local seed


class _Items(tuple):
    """A run-config's sorted items, hashed once: the caches below hash their key on every
    call, and a run-config holds some 180 keys (3.5 µs a hash)."""

    def __hash__(self) -> int:
        if "hash" not in self.__dict__:
            self.__dict__["hash"] = tuple.__hash__(self)
        return self.__dict__["hash"]


_last_frozen: tuple[Mapping[str, Any], dict[str, Any], tuple] | None = None


def frozen(run_config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``run_config``'s sorted items: the key of the per-process caches. The last one
    is remembered (one run-config object serves every message of a run): reused while
    the same object still equals the copy taken with it."""
    global _last_frozen
    last = _last_frozen
    if last is not None and last[0] is run_config and last[1] == run_config:
        return last[2]
    key = _Items(sorted(run_config.items()))
    _last_frozen = (run_config, dict(run_config), key)
    return key


@lru_cache(maxsize=4)
def _task(frozen_run_config: tuple[tuple[str, Any], ...]) -> Task:
    return tasks.build(dict(frozen_run_config))


def task_of(context: Context) -> Task:
    return _task(frozen(context.run_config))


@lru_cache(maxsize=16)
def _settings(part: type, frozen_run_config: tuple[tuple[str, Any], ...]) -> Any:
    return part.from_run_config(dict(frozen_run_config))


def settings(part: type[S], run_config: Mapping[str, Any]) -> S:
    """``part.from_run_config(run_config)``, parsed once per run-config (settings are
    frozen dataclasses; a bad key still raises, on every call)."""
    return _settings(part, frozen(run_config))


@lru_cache(maxsize=4)
def _model(task: Task, seed: int) -> torch.nn.Module:
    return task.build_model(seed)


def run_seed(context: Context) -> int:
    return int(SEED.read(context.run_config))


def node_partition(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """Return (partition-id, num-partitions) from the node config, validated."""
    try:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err}; start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        ) from None
    if not 0 <= pid < num:
        raise ValueError(f"partition-id {pid} is not in [0, num-partitions={num})")
    return pid, num


def setup(context: Context) -> tuple[Task, torch.nn.Module, Any, int]:
    """Return (task, this process's model object, partition, partition id).

    With ``audit.canaries`` = k the real clients split the data N = num-partitions - k
    ways, and a canary gets the partition it shadows (:mod:`client_app.canary`)."""
    run_config = context.run_config
    task = task_of(context)
    pid, num = node_partition(context.node_config)
    partition = task.partition_from_node_config(context.node_config)
    if partition is None and settings(AuditSettings, run_config).canaries:
        partition = canary.partition(task, run_config, pid, num)
    elif partition is None:  # no audit: every node is a real client
        partition = task.load_partition(pid, num)
    return task, _model(task, run_seed(context)), partition, pid


def load_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(tensors, strict=True)``. A model whose modules load as
    ``nn.Module`` does (no module's own loader, no loading hooks) gets each tensor copied
    in place, which is what torch's loader does for it after walking the modules (that
    walk is most of its 37 µs on a small model); any other model goes to torch's loader,
    as does a state dict whose keys or shapes differ (for torch's error)."""
    targets = model.state_dict(keep_vars=True)
    plain = targets.keys() == tensors.keys() and all(
        targets[key].shape == tensor.shape for key, tensor in tensors.items()
    )
    if not (plain and all(_loads_plainly(m) for m in model.modules())):
        model.load_state_dict(tensors, strict=True)
        return
    with torch.no_grad():
        for key, tensor in tensors.items():
            targets[key].copy_(tensor)


def _loads_plainly(module: torch.nn.Module) -> bool:
    return (
        type(module)._load_from_state_dict is torch.nn.Module._load_from_state_dict
        and not module._load_state_dict_pre_hooks
        and not module._load_state_dict_post_hooks
    )


def array_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``ArrayRecord(state_dict)`` of torch tensors, each encoded by :func:`to_array`."""
    arrays = {key: to_array(tensor.detach().cpu().numpy()) for key, tensor in tensors.items()}
    return new_record(ArrayRecord, arrays)


def reply(msg: Message, metrics: dict[str, float], model: torch.nn.Module | None) -> Message:
    content: dict[str, MetricRecord | ArrayRecord] = {
        keys.METRICS: new_record(MetricRecord, metrics)
    }
    if model is not None:
        content[keys.ARRAYS] = array_record(model.state_dict())
    return Message(content=new_record(RecordDict, content), reply_to=msg)


def dp_seed(reproducible_seed: int, run_config) -> int:
    """The seed of this training's DP randomness: OS entropy, never sent anywhere;
    ``reproducible_seed`` (from the run seed) only under ``dp.reproducible-noise``."""
    if settings(DPSettings, run_config).reproducible_noise:
        return int(np.random.SeedSequence([reproducible_seed, _DP_STREAM]).generate_state(1)[0])
    return secret_seed()


def task_state(context: Context) -> dict[str, Any]:
    record = context.state.get(keys.TASK_STATE)
    return json.loads(str(record["json"])) if record is not None else {}


def task_tensors(context: Context) -> dict[str, torch.Tensor]:
    record = context.state.get(keys.TASK_TENSORS)
    return to_state_dict(record) if record is not None else {}


def keep_task_state(context: Context, local: LocalTraining) -> None:
    """The task's state into ``context.state``; none at all when the task keeps none, so
    that a client without state writes no state file (:func:`client_app.state.save`)."""
    if local.state:
        context.state[keys.TASK_STATE] = ConfigRecord({"json": json.dumps(local.state)})
    elif keys.TASK_STATE in context.state:
        del context.state[keys.TASK_STATE]
    if local.state_tensors:
        context.state[keys.TASK_TENSORS] = ArrayRecord(local.state_tensors)
    elif keys.TASK_TENSORS in context.state:
        del context.state[keys.TASK_TENSORS]


def artifacts_dir(config, node_config: Mapping[str, Any]) -> str | None:
    """The SuperNode's own ``artifacts-dir`` if it sets one, else the server's."""
    chosen = node_config.get(keys.ARTIFACTS_DIR, config.get(keys.ARTIFACTS_DIR))
    return str(chosen) if chosen else None
