"""The run-config layer's declaration form: a field's key, its options, its typed read."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from config.options import ConfigError, parse_options
from config.settings import Settings, setting
from tasks.vision import DigitsTask
from tasks.vision.settings import VISION_OPTIONS


@dataclass(frozen=True)
class Toy(Settings):
    PREFIX = "toy"

    rate: float = setting(0.5, "A rate.", low=0.0, high=1.0, low_open=True)
    batch_size: int = setting(8, "A batch size.", low=1)
    derived: str = "not a key"


def test_a_field_is_keyed_by_prefix_and_field_name_and_plain_fields_are_not_keys():
    assert [(o.key, o.default) for o in Toy.options()] == [
        ("toy.rate", 0.5),
        ("toy.batch-size", 8),
    ]
    parsed = parse_options({"toy.batch-size": 3.0}, Toy.options())
    toy = Toy.from_options(parsed)
    assert (toy.rate, toy.batch_size, toy.derived) == (0.5, 3, "not a key")
    assert type(toy.batch_size) is int


def test_a_field_cannot_name_its_own_key():
    with pytest.raises(TypeError, match="key"):
        setting(8, "A batch size.", key="data.batch")  # type: ignore[call-arg]


def _settings_classes(cls: type = Settings) -> set[type[Settings]]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _settings_classes(sub)
    return found


def test_every_declared_key_is_prefix_dot_field_name_of_its_settings_class():
    from server_app import config

    checked = 0
    declared = {}
    for cls in _settings_classes():
        if cls.__module__.startswith("tests."):
            continue
        for f in fields(cls):
            if "option" in f.metadata:
                key = cls.field_key(f)
                assert key == f"{cls.PREFIX}.{f.name.replace('_', '-')}", (cls, f.name)
                declared[key] = cls
                checked += 1
    assert checked >= 150  # every part's and every task's fields
    dotted = [opt.key for opt in config.all_options() if "." in opt.key]
    assert [key for key in dotted if key not in declared] == []
    prefixes = {declared[key].PREFIX for key in dotted}
    assert {"vision", "finance", "movielens", "ppo", "subspace", "dp"} <= prefixes


def test_the_four_tasks_spell_their_shared_keys_alike():
    from server_app import config

    keys = {opt.key for opt in config.all_options()}
    for name in ("lr", "batch-size", "local-epochs", "device"):
        assert {f"{t}.{name}" for t in ("vision", "finance", "movielens", "ppo")} - keys in (
            set(),
            {"ppo.local-epochs"},  # PPO counts env steps (ppo.local-steps), not epochs
        ), name
    for name in ("test-fraction", "central-test-fraction"):
        assert {f"{t}.{name}" for t in ("vision", "finance")} <= keys


def test_an_option_built_from_a_field_keeps_the_one_line_errors():
    with pytest.raises(
        ConfigError, match=r"^'toy.rate' = 0.0 is out of range; valid range: \(0, 1\]$"
    ):
        parse_options({"toy.rate": 0.0}, Toy.options())


def test_the_vision_keys_are_the_fields_of_vision_config_read_typed():
    assert [o.key for o in VISION_OPTIONS][:2] == ["vision.partitioner", "vision.alpha"]
    cfg = DigitsTask(
        {"vision.lr": 0.125, "vision.batch-size": 16.0, "vision.model": "auto"}
    ).config
    assert (cfg.lr, cfg.batch_size, cfg.model, cfg.grouping) == (0.125, 16, "lenet", "auto")
    assert type(cfg.batch_size) is int and dict(cfg.groups) == {}
