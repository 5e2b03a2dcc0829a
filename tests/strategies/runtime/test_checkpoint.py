"""Each strategy layer owns its state (``state_dict`` / ``load_state_dict``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import strategies
from server_app import config
from strategies.runtime.capabilities import layers
from strategies.runtime.checkpoint import CheckpointError, load_strategy_state, strategy_state
from tests.inprocess import run_config

DP = {"dp.num-sampled-clients": 2, "dp.sampling": "fixed"}
CASES = {
    "fedavg": {"strategy": "fedavg"},
    "clustered": {"strategy": "clustered", "cluster.k": 2},
    "smart-fedprox": {"strategy": "smart-fedprox"},
    "hierarchical-cp-np": {"strategy": "hierarchical", "privacy": "cp-np"},
    "dp-fedavg-adaptive": {"privacy": "dp-fedavg-adaptive", **DP},
    "subspace-dp": {"privacy": "subspace-dp", **DP, "subspace.rank": 2, "subspace.sketch-dim": 8},
    "laplace": {"privacy": "laplace", **DP},
    "dp-sgd": {"privacy": "dp-sgd"},
    "momentum": {"server.optimizer": "momentum", "server.lr": 0.5},
    "secagg-distributed": {
        "privacy": "dp-fedavg-fixed",
        "dp.noise-site": "client",
        "secagg.enabled": True,
        **DP,
    },
}


def _build(**overrides):
    cfg = config.load(run_config(**overrides))
    return strategies.build(cfg.privacy, cfg.strategy_settings())


def _generators(strategy) -> list[np.random.Generator]:
    return [
        value
        for layer in layers(strategy)
        for value in vars(layer).values()
        if isinstance(value, np.random.Generator)
    ]


def _plain(value):
    """``value`` with tensors as lists, for an equality check."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("case", CASES)
def test_a_fresh_strategy_loaded_from_a_checkpoint_carries_the_same_state(case):
    first = _build(**CASES[case])
    partitions = first.partitions
    for node, partition in ((11, 0), (22, 1)):
        partitions.record(node, partition)
    for rng in _generators(first):
        rng.random(7)  # the state moved away from the seeded one
    saved = strategy_state(first)
    assert any(entry["state"] for entry in saved), "no layer carries state"

    second = _build(**CASES[case])
    assert _plain(strategy_state(second)) != _plain(saved) or not _generators(first)
    load_strategy_state(second, saved, {0: 11, 1: 22})
    assert _plain(strategy_state(second)) == _plain(saved)
    for a, b in zip(_generators(first), _generators(second), strict=True):
        assert a.random() == b.random()  # restored in place, the same stream


def test_client_state_is_saved_by_partition_and_handed_to_the_node_that_reports_it():
    first = _build(strategy="smart-fedprox", **{"server.optimizer": "momentum"})
    first.partitions.record(11, 0)
    first.partitions.record(22, 1)
    base = layers(first)[-1]
    base.divergences = {11: 0.5, 22: 2.0}
    saved = strategy_state(first)
    # The server optimizer forwards attributes to SmartFedProx but owns no client state.
    assert [bool(entry["clients"]) for entry in saved] == [False, True]
    assert saved[1]["clients"]["divergences"] == {0: 0.5, 1: 2.0}

    second = _build(strategy="smart-fedprox", **{"server.optimizer": "momentum"})
    load_strategy_state(second, saved, {0: 33, 1: 44})  # new node ids in the new run
    assert layers(second)[-1].divergences == {33: 0.5, 44: 2.0}


def test_a_checkpoint_of_another_chain_of_strategies_is_refused():
    saved = strategy_state(_build(privacy="dp-fedavg-fixed", **DP))
    with pytest.raises(CheckpointError, match="this run builds"):
        load_strategy_state(_build(privacy="laplace", **DP), saved, {})


def _encoded_by_recursion(value):
    """What encode returns for plain data, the long way (the reference)."""
    if isinstance(value, dict):
        return {k: _encoded_by_recursion(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encoded_by_recursion(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


@pytest.mark.parametrize(
    "value",
    [
        [{"round": 1, "z": 0.5, "note": None, "ok": True}, {"round": 2, "z": 1.5}],
        ({"a": 1},),  # a tuple: a list either way
        [],
        [{"z": np.float64(0.5)}, {"z": 1.0}],  # a numpy scalar: the recursion's item()
        [{"nested": {"k": [1, 2]}}],
        [1, "a", None],
    ],
)
def test_encoding_flat_records_is_the_recursions(value):
    from strategies.runtime.checkpoint import encode

    got = encode(value)
    assert got == _encoded_by_recursion(value)
    assert [type(x) for x in got] == [type(x) for x in _encoded_by_recursion(value)]
    if value and isinstance(value[0], dict):  # copies: the caller's records stay its own
        assert got[0] is not value[0]
    assert all(type(v) is not np.float64 for r in got if isinstance(r, dict) for v in r.values())
