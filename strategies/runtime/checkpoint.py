"""The state a strategy carries from round to round, saved and restored for resume.

Each strategy layer owns its state as torch modules and Opacus' accountants do:
``state_dict()`` returns what it carries between rounds and ``load_state_dict(state)``
restores it (generators and ledgers in place: the app and the wrappers share them).
State kept per client is keyed by node id, which Flower draws afresh in every run (and
a SuperNode gets a new one when it reconnects): a layer returns it from
``client_state_dict()`` and the checkpoint stores it by partition id
(:mod:`strategies.runtime.partitions`), mapped back onto whichever node reports that partition
when the run resumes (``load_client_state_dict``). Per-round scratch (what
``configure_train`` hands to ``aggregate_train``) is not state: a checkpoint is taken
between rounds.

Design notes: ``docs/notes.md``, ``strategies.runtime.checkpoint``.
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
from strategies.runtime.capabilities import layers
from strategies.runtime.partitions import PartitionMap, partition_map

_TAG = "__checkpoint__"  # marks an encoded object in the plain-data tree


class CheckpointError(ValueError):
    """A checkpoint that does not fit the strategy being resumed."""


def ledger_state(ledger: Any) -> dict[str, Any] | None:
    """A ledger's (or view's) ``state_dict()``; None for none."""
    return None if ledger is None else ledger.state_dict()


def load_ledger(ledger: Any, state: Mapping[str, Any] | None) -> None:
    """Restore :func:`ledger_state` into ``ledger`` in place."""
    if state is not None:
        ledger.load_state_dict(state)


def _owns(layer: object, method: str) -> bool:
    return callable(getattr(type(layer), method, None))


_PLAIN = frozenset({str, int, float, bool, type(None)})  # values encode returns as they are


def encode(value: Any) -> Any:
    """``value`` as plain data (see the module docstring)."""
    if isinstance(value, ArrayRecord):
        return {
            _TAG: "arrays",
            "keys": list(value.keys()),
            "values": [torch.from_numpy(to_numpy(a)) for a in value.values()],
        }
    if isinstance(value, SubspaceMetric):
        return {_TAG: "subspace-metric", "state": encode(value.state_dict())}
    if isinstance(value, np.ndarray):
        return {_TAG: "ndarray", "value": torch.from_numpy(np.array(value))}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if all(type(v) is dict and _PLAIN.issuperset(map(type, v.values())) for v in value):
            # Flat records (a ledger's releases, one a round): what the recursion returns,
            # without it (10.8 -> 0.8 ms at 1 000 releases, paid every round).
            return [dict(v) for v in value]
        return [encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise CheckpointError(f"cannot checkpoint a {type(value).__name__}")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, dict) and _TAG in value:
        kind = value[_TAG]
        if kind == "arrays":
            pairs = zip(value["keys"], value["values"], strict=True)
            return ArrayRecord({k: Array(v.numpy()) for k, v in pairs})
        if kind == "ndarray":
            return value["value"].numpy()
        if kind == "subspace-metric":
            return SubspaceMetric(**decode(value["state"]))
        raise CheckpointError(f"unknown checkpoint entry {kind!r}")
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


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
    """One entry per layer of the chain: its class, its state and its clients' state
    (by partition id)."""
    partitions = partition_map(strategy)
    state = []
    layer: Any  # its state methods are optional, looked up with _owns
    for layer in layers(strategy):
        name = type(layer).__name__
        clients = layer.client_state_dict() if _owns(layer, "client_state_dict") else {}
        state.append(
            {
                "class": name,
                "state": encode(layer.state_dict()) if _owns(layer, "state_dict") else {},
                "clients": {
                    key: encode(_by_partition(by_node, f"{name}.{key}", partitions))
                    for key, by_node in clients.items()
                },
            }
        )
    return state


def load_strategy_state(
    strategy: Strategy, state: list[dict[str, Any]], node_of: Mapping[int, int]
) -> None:
    """Restore :func:`strategy_state` ``state`` into ``strategy`` (same chain of
    classes); partition-keyed state goes to ``node_of[partition]`` (partitions whose
    node is not connected now are dropped, with a warning)."""
    chain: list[Any] = layers(strategy)  # state methods are optional (_owns)
    saved = [entry["class"] for entry in state]
    built = [type(layer).__name__ for layer in chain]
    if saved != built:
        raise CheckpointError(f"the checkpoint holds strategies {saved}, this run builds {built}")
    for layer, entry in zip(chain, state, strict=True):
        if _owns(layer, "load_state_dict"):
            layer.load_state_dict(decode(entry["state"]))
        clients = {}
        for key, by_partition in entry["clients"].items():
            values = decode(by_partition)
            missing = sorted(p for p in values if p not in node_of)
            if missing:
                log(
                    WARNING,
                    "resume: %s.%s of partition(s) %s dropped: no connected node reports them",
                    type(layer).__name__,
                    key,
                    missing,
                )
            clients[key] = {node_of[p]: v for p, v in values.items() if p in node_of}
        if clients:
            layer.load_client_state_dict(clients)


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
