"""The state a strategy carries from round to round, saved and restored for resume.

Each strategy class names what it carries between rounds in ``CHECKPOINT``
(attribute names); attributes keyed by node id are listed in ``CHECKPOINT_BY_NODE``
instead, because Flower draws fresh node ids in every run (and a SuperNode gets a new
one when it reconnects): they are saved by partition id (the strategy's
:class:`~strategies.partitions.PartitionMap`) and mapped back onto whichever node
reports that partition when the run resumes.
Per-round scratch (what ``configure_train`` hands to ``aggregate_train``) is not
state: a checkpoint is taken between rounds.

:func:`strategy_state` walks the chain of wrappers (``.strategy``) and returns one
entry per layer; :func:`load_strategy_state` checks that the chain has the same
classes and restores every attribute. Generators and ledgers are restored *in place*
(the app and the wrappers share them); everything else is replaced.

The state is plain data (dicts, lists, numbers, strings, torch tensors, generator
state dicts), so ``torch.load(..., weights_only=True)`` reads it without unpickling
arbitrary objects.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.logger import log
from flwr.serverapp.strategy import Strategy

from privacy.subspace import SubspaceMetric
from protocol.records import to_numpy
from strategies.partitions import PartitionMap, partition_map

_TAG = "__checkpoint__"  # marks an encoded object in the plain-data tree
# Classes renamed since checkpoints were first written: old name -> current name.
_RENAMED = {"LocalTraining": "LocalOnly", "FrontLoadedDP": "FrontLoadedDPClients"}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the strategy being resumed."""


def _names(obj: object, attribute: str) -> tuple[str, ...]:
    skipped = set(getattr(obj, "checkpoint_exclude", ()))
    return tuple(n for n in getattr(type(obj), attribute, ()) if n not in skipped)


def chain(strategy: Strategy) -> list[Strategy]:
    """``strategy`` and the strategies it wraps (``.strategy``), outermost first."""
    layers = [strategy]
    while isinstance(getattr(layers[-1], "strategy", None), Strategy):
        layers.append(layers[-1].strategy)
    return layers


def encode(value: Any) -> Any:
    """``value`` as plain data (see the module docstring)."""
    if isinstance(value, np.random.Generator):
        return {_TAG: "generator", "state": value.bit_generator.state}
    if isinstance(value, ArrayRecord):
        return {
            _TAG: "arrays",
            "keys": list(value.keys()),
            "values": [torch.from_numpy(to_numpy(a)) for a in value.values()],
        }
    if isinstance(value, SubspaceMetric):
        return {_TAG: "subspace-metric", "state": encode(value.state_dict())}
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):  # ledgers
        return {_TAG: "state-dict", "state": value.state_dict()}
    if isinstance(value, np.ndarray):
        return {_TAG: "ndarray", "value": torch.from_numpy(np.array(value))}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise CheckpointError(f"cannot checkpoint a {type(value).__name__}")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode` (generators and ledgers: see :func:`_restore`)."""
    if isinstance(value, dict) and _TAG in value:
        kind = value[_TAG]
        if kind == "arrays":
            pairs = zip(value["keys"], value["values"], strict=True)
            return ArrayRecord({k: Array(v.numpy()) for k, v in pairs})
        if kind == "ndarray":
            return value["value"].numpy()
        if kind == "subspace-metric":
            return SubspaceMetric(**decode(value["state"]))
        if kind == "generator":
            generator = np.random.default_rng()
            generator.bit_generator.state = value["state"]
            return generator
        raise CheckpointError(f"a {kind!r} is restored in place, not decoded")
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _restore(obj: object, name: str, saved: Any) -> None:
    """Set ``obj.name`` from ``saved``: in place for generators and ledgers."""
    current = getattr(obj, name)
    kind = saved.get(_TAG) if isinstance(saved, dict) else None
    if kind == "generator" and isinstance(current, np.random.Generator):
        current.bit_generator.state = saved["state"]
    elif kind == "state-dict":
        current.load_state_dict(saved["state"])
    else:
        setattr(obj, name, decode(saved))


def _by_partition(
    by_node: Mapping[int, Any], where: str, partitions: PartitionMap
) -> dict[int, Any]:
    kept, lost = {}, 0
    for node, value in by_node.items():
        partition = partitions.partition_of(node)
        if partition is None:
            lost += 1
        else:
            kept[partition] = value
    if lost:
        log(WARNING, "checkpoint: %s of %d node(s) without a partition id not saved", where, lost)
    return kept


def strategy_state(strategy: Strategy) -> list[dict[str, Any]]:
    """One entry per layer of the chain: its class and its carried attributes."""
    partitions = partition_map(strategy)
    state = []
    for layer in chain(strategy):
        entry: dict[str, Any] = {
            "class": type(layer).__name__,
            "attributes": {n: encode(getattr(layer, n)) for n in _names(layer, "CHECKPOINT")},
            "by-partition": {
                n: encode(
                    _by_partition(getattr(layer, n), f"{type(layer).__name__}.{n}", partitions)
                )
                for n in _names(layer, "CHECKPOINT_BY_NODE")
            },
        }
        state.append(entry)
    return state


def load_strategy_state(
    strategy: Strategy, state: list[dict[str, Any]], node_of: Mapping[int, int]
) -> None:
    """Restore :func:`strategy_state` ``state`` into ``strategy`` (same chain of
    classes); partition-keyed state goes to ``node_of[partition]`` (partitions whose
    node is not connected now are dropped, with a warning)."""
    layers = chain(strategy)
    saved = [_RENAMED.get(entry["class"], entry["class"]) for entry in state]
    built = [type(layer).__name__ for layer in layers]
    if saved != built:
        raise CheckpointError(f"the checkpoint holds strategies {saved}, this run builds {built}")
    for layer, entry in zip(layers, state, strict=True):
        for name, value in entry["attributes"].items():
            _restore(layer, name, value)
        for name, by_partition in entry["by-partition"].items():
            values = decode(by_partition)
            missing = sorted(p for p in values if p not in node_of)
            if missing:
                log(
                    WARNING,
                    "resume: %s.%s of partition(s) %s dropped: no connected node reports them",
                    type(layer).__name__,
                    name,
                    missing,
                )
            setattr(layer, name, {node_of[p]: v for p, v in values.items() if p in node_of})


def global_rng_state() -> dict[str, Any]:
    """The process-wide generators: Python's ``random`` (Flower's FedAvg samples with it),
    numpy's legacy global and torch's CPU generator."""
    legacy = np.random.get_state(legacy=False)
    legacy["state"] = {"key": legacy["state"]["key"].tolist(), "pos": legacy["state"]["pos"]}
    return {"python": random.getstate(), "numpy": legacy, "torch": torch.get_rng_state()}


def set_global_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`global_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    legacy = dict(state["numpy"])
    key = np.asarray(legacy["state"]["key"], dtype=np.uint32)
    legacy["state"] = {"key": key, "pos": legacy["state"]["pos"]}
    np.random.set_state(legacy)
    torch.set_rng_state(state["torch"])
