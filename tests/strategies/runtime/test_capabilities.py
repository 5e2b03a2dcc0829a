"""Capabilities are found through the wrappers on every Python: Python 3.12's
``isinstance`` against a runtime-checkable Protocol skips a wrapper's ``__getattr__``,
and the app then lost its ledger behind a server optimizer or secure aggregation."""

from __future__ import annotations

import inspect

import pytest

import strategies
from server_app import config
from strategies.runtime.capabilities import (
    Accounted,
    MultiModel,
    Resumable,
    WritesTables,
    layers,
    ledger_of,
    protocol_members,
    provides,
)
from strategies.secure.secure_aggregation import SecureExchange
from tests.inprocess import run_config

DP = {"dp.num-sampled-clients": 2, "dp.sampling": "fixed"}


def _build(**overrides):
    cfg = config.load(run_config(**overrides))
    return strategies.build(cfg.privacy, cfg.strategy_settings())


def test_protocol_members_are_what_each_protocol_declares():
    assert protocol_members(Accounted) == ("ledger", "releases_metric")
    assert protocol_members(MultiModel) == ("MODEL_LABEL", "models")
    assert protocol_members(WritesTables) == ("tables",)
    assert protocol_members(Resumable) == ("on_resume",)
    assert protocol_members(SecureExchange) == ("exchange_train",)


@pytest.mark.parametrize(
    "protocol", [Accounted, MultiModel, WritesTables, Resumable, SecureExchange]
)
def test_isinstance_against_a_capability_fails_loudly_on_every_python(protocol):
    # Not runtime_checkable: an isinstance check (which misses forwarded attributes
    # on Python >= 3.12) raises instead of quietly answering False.
    with pytest.raises(TypeError):
        isinstance(object(), protocol)


@pytest.mark.parametrize(
    "overrides",
    [
        {"privacy": "dp-fedavg-fixed", "server.optimizer": "adam", "server.lr": 0.05, **DP},
        {"privacy": "dp-fedavg-fixed", "secagg.enabled": True, **DP},
        {"privacy": "dp-fedavg-fixed", "dp.noise-site": "client", "secagg.enabled": True, **DP},
    ],
    ids=["server-optimizer", "secagg", "secagg-distributed"],
)
def test_a_wrapped_privacy_mechanism_keeps_its_ledger(overrides):
    # Prepare
    strategy = _build(**overrides)
    outer, *inner = layers(strategy)
    mechanism = next(s for s in inner if "ledger" in vars(s))

    # Execute / Assert: the outer wrapper forwards `ledger`, which a static lookup (what
    # Python 3.12's Protocol isinstance uses) does not see; provides() does.
    with pytest.raises(AttributeError):
        inspect.getattr_static(outer, "ledger")
    assert provides(outer, Accounted) and provides(outer, Resumable)
    assert ledger_of(strategy) is mechanism.ledger is not None


def test_plain_strategies_provide_no_privacy_and_clustered_its_models():
    assert ledger_of(_build(strategy="fedavg")) is None
    assert not provides(_build(strategy="fedavg"), Accounted)
    clustered = _build(strategy="clustered", **{"cluster.k": 2})
    assert provides(clustered, MultiModel) and provides(clustered, WritesTables)
    assert provides(_build(**{"secagg.enabled": True}), SecureExchange)
    behind_optimizer = _build(**{"secagg.enabled": True, "server.optimizer": "momentum"})
    with pytest.raises(AttributeError):  # forwarded: what 3.12's isinstance missed
        inspect.getattr_static(behind_optimizer, "exchange_train")
    assert provides(behind_optimizer, SecureExchange)
