"""Adding a key is one edit plus regeneration (docs/extending.md, "Add a run-config key").

A strategy's factory, and a privacy wrapper's, builds it from its settings object
(``Settings.kwargs``): every field of the settings dataclass reaches the constructor
argument of the same name, so a new field needs no registry edit; the option list,
the ``pyproject.toml`` defaults and the reference are derived from the declaration.
A key the ClientApp reads is parsed from its flat run-config with
``Settings.from_run_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import pytest
from flwr.serverapp.strategy import FedAvg

from config.app import SEED
from config.options import ConfigError, Option
from config.settings import Settings, setting
from server_app import config
from strategies import registry
from strategies.algorithms.clustered import ClusteredFedAvg, ClusterSettings
from strategies.algorithms.hierarchical_fedavg import HierSettings
from strategies.algorithms.smart_fedprox.strategy import SmartSettings
from strategies.mechanisms.dp_fedavg_adaptive import AdaptiveClipSettings, DPFedAvgAdaptive
from strategies.mechanisms.subspace_dp import SubspaceDP, SubspaceSettings
from tests.inprocess import pyproject_defaults


def _other_value(opt: Option):
    """A valid value of ``opt`` other than its default."""
    if isinstance(opt.default, bool):
        return not opt.default
    if opt.choices:
        return next(c for c in opt.choices if c != opt.default)
    step = 1 if isinstance(opt.default, int) else 0.25
    for value in (opt.default + step, opt.default - step, opt.default / 2):
        try:
            if opt.parse(value) != opt.default:
                return opt.parse(value)
        except ConfigError:
            continue
    raise AssertionError(f"no other value for {opt.key}")


@pytest.mark.parametrize(
    ("strategy", "part", "cls"),
    [
        ("clustered", ClusterSettings, "ClusteredFedAvg"),
        ("smart-fedprox", SmartSettings, "SmartFedProx"),
        ("hierarchical", HierSettings, "HierarchicalFedAvg"),
    ],
)
def test_every_field_of_a_strategys_settings_reaches_its_constructor(
    strategy, part, cls, monkeypatch
):
    changed = {opt.key: _other_value(opt) for opt in part.options()}
    settings = config.load(pyproject_defaults()).strategy_settings()
    settings = replace(settings, strategy=strategy, options={**settings.options, **changed})
    monkeypatch.setattr(registry, cls, lambda **kwargs: kwargs)  # the arguments it gets
    given = registry.STRATEGIES[strategy](settings)
    expected = {f.name: changed[part.field_key(f)] for f in fields(part)}
    assert {name: given[name] for name in expected} == expected
    assert len(expected) == len(part.options()) >= 5


@dataclass(frozen=True)
class _ClusterWithFoo(ClusterSettings):
    """ClusterSettings after the one edit: a new field."""

    foo: int = setting(2, "A new key.", low=0)


class _ClusteredWithFoo(ClusteredFedAvg):
    """The strategy taking the new field by name."""

    def __init__(self, *, foo: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.foo = foo


def test_a_new_field_is_a_key_with_a_default_a_reference_row_and_a_value(monkeypatch):
    # Stand-ins for editing ClusterSettings and ClusteredFedAvg in place; the registry,
    # the run-config layer and the generators are not touched.
    monkeypatch.setattr(registry, "ClusterSettings", _ClusterWithFoo)
    monkeypatch.setattr(registry, "ClusteredFedAvg", _ClusteredWithFoo)
    parts = tuple(_ClusterWithFoo if p is ClusterSettings else p for p in config.PARTS)
    monkeypatch.setattr(config, "PARTS", parts)

    assert '"cluster.foo" = 2' in config.pyproject_defaults().splitlines()
    assert "| `cluster.foo` | `2` | [0, inf) | A new key. |" in config.markdown_table()
    run = {**pyproject_defaults(), "cluster.foo": 2, "strategy": "clustered"}
    run |= {"cluster.k": 2, "min-available-nodes": 2}
    assert registry.build("none", config.load(run).strategy_settings()).foo == 2
    built = registry.build("none", config.load({**run, "cluster.foo": 7}).strategy_settings())
    assert isinstance(built, _ClusteredWithFoo) and built.foo == 7
    with pytest.raises(ConfigError, match=r"'cluster.foo' = -1 is out of range"):
        config.load({**run, "cluster.foo": -1})


# Each wrapper built from its own settings object (clustered: the clustered variant).
WRAPPERS = [
    ("fedavg", "subspace-dp", SubspaceSettings, "SubspaceDP"),
    ("fedavg", "dp-fedavg-adaptive", AdaptiveClipSettings, "DPFedAvgAdaptive"),
    ("clustered", "dp-fedavg-adaptive", AdaptiveClipSettings, "ClusteredDPFedAvgAdaptive"),
]


@pytest.mark.parametrize(("strategy", "privacy", "part", "cls"), WRAPPERS)
def test_every_field_of_a_mechanisms_settings_reaches_its_wrapper(
    strategy, privacy, part, cls, monkeypatch
):
    changed = {opt.key: _other_value(opt) for opt in part.options()}
    settings = config.load(pyproject_defaults()).strategy_settings()
    settings = replace(settings, strategy=strategy, options={**settings.options, **changed})
    monkeypatch.setattr(registry, cls, lambda base, **kwargs: kwargs)  # the arguments it gets
    given = registry.PRIVACY[privacy](FedAvg(), settings)
    expected = {f.name: changed[part.field_key(f)] for f in fields(part)}
    assert {name: given[name] for name in expected} == expected
    assert len(expected) == len(part.options()) >= 3


def _with_foo(part: type[Settings]) -> type[Settings]:
    """``part`` after the one edit: a new field ``foo``."""
    foo = setting(0.5, "A new key.", low=0.0, high=1.0)
    body = {"__annotations__": {"foo": float}, "foo": foo}
    return dataclass(frozen=True)(type(f"{part.__name__}WithFoo", (part,), body))


def _taking_foo(wrapper: type) -> type:
    """``wrapper`` taking the new field by name."""

    class TakingFoo(wrapper):
        def __init__(self, strategy, *, foo: float, **kwargs) -> None:
            super().__init__(strategy, **kwargs)
            self.foo = foo

    return TakingFoo


@pytest.mark.parametrize(
    ("privacy", "part", "wrapper"),
    [
        ("subspace-dp", SubspaceSettings, SubspaceDP),
        ("dp-fedavg-adaptive", AdaptiveClipSettings, DPFedAvgAdaptive),
    ],
)
def test_a_new_mechanism_field_is_a_key_with_a_default_a_reference_row_and_a_value(
    privacy, part, wrapper, monkeypatch
):
    # Stand-ins for editing the settings class and the wrapper in place; the registry,
    # the run-config layer and the generators are not touched.
    new_part, new_wrapper = _with_foo(part), _taking_foo(wrapper)
    monkeypatch.setattr(registry, part.__name__, new_part)
    monkeypatch.setattr(registry, wrapper.__name__, new_wrapper)
    monkeypatch.setattr(config, "PARTS", tuple(new_part if p is part else p for p in config.PARTS))
    key = f"{part.PREFIX}.foo"

    assert f'"{key}" = 0.5' in config.pyproject_defaults().splitlines()
    assert f"| `{key}` | `0.5` | [0, 1] | A new key. |" in config.markdown_table()
    run = {**pyproject_defaults(), "privacy": privacy, "dp.noise-multiplier": 1.0}
    built = registry.build(privacy, config.load(run).strategy_settings())
    assert isinstance(built, new_wrapper) and built.foo == 0.5
    built = registry.build(privacy, config.load({**run, key: 0.25}).strategy_settings())
    assert built.foo == 0.25
    if privacy == "subspace-dp":
        assert (built.rank, built.pmu_budget_reserve, built.init) == (32, 0.15, "isotropic")
    else:  # σ_b = max(m/20, z) for dp.clip-count-stddev = 0
        assert (built.target_quantile, built.clip_lr, built.count_stddev) == (0.5, 0.2, 1.0)
    with pytest.raises(ConfigError, match=rf"'{key}' = 2.0 is out of range"):
        config.load({**run, key: 2})


@dataclass(frozen=True)
class _ToySettings(Settings):
    PREFIX: ClassVar[str] = "toy"
    rate: float = setting(0.5, "A rate.", low=0.0, high=1.0)
    mode: str = setting("a", "A mode.", choices=("a", "b"))
    epochs_given: int = setting(1, "Keyed by its name, like every field.", low=1)
    derived: int = 0  # not a key: neither read from the run-config nor in kwargs


def test_a_client_parses_its_keys_from_the_flat_run_config():
    # Flower's run-config: TOML scalars, an int where a float is declared.
    toy = _ToySettings.from_run_config({"toy.rate": 1, "toy.epochs-given": 3, "other": "x"})
    assert (toy.rate, type(toy.rate), toy.mode, toy.epochs_given) == (1.0, float, "a", 3)
    assert toy.kwargs() == {"rate": 1.0, "mode": "a", "epochs_given": 3}
    with pytest.raises(
        ConfigError, match=r"'toy.mode' = 'c' is not valid; valid values: 'a', 'b'"
    ):
        _ToySettings.from_run_config({"toy.mode": "c"})


def test_a_top_level_key_is_read_through_its_declaration():
    assert SEED.read({"seed": 7.0}) == 7 and SEED.read({}) == 42
    with pytest.raises(ConfigError, match="'seed' must be an integer"):
        SEED.read({"seed": 1.5})
