"""The run-config layer's declaration form: a field's key, its options, its typed read."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from config.options import ConfigError, parse_options
from config.settings import Settings, setting
from tasks.vision import DigitsTask
from tasks.vision.settings import VISION_OPTIONS


@dataclass(frozen=True)
class Toy(Settings):
    PREFIX = "toy"

    rate: float = setting(0.5, "A rate.", low=0.0, high=1.0, low_open=True)
    batch: int = setting(8, "A batch size.", low=1, key="data.batch")
    derived: str = "not a key"


def test_a_field_is_keyed_by_prefix_or_by_its_own_key_and_plain_fields_are_not_keys():
    assert [(o.key, o.default) for o in Toy.options()] == [("toy.rate", 0.5), ("data.batch", 8)]
    parsed = parse_options({"data.batch": 3.0}, Toy.options())
    toy = Toy.from_options(parsed)
    assert (toy.rate, toy.batch, toy.derived) == (0.5, 3, "not a key")
    assert type(toy.batch) is int


def test_an_option_built_from_a_field_keeps_the_one_line_errors():
    with pytest.raises(
        ConfigError, match=r"^'toy.rate' = 0.0 is out of range; valid range: \(0, 1\]$"
    ):
        parse_options({"toy.rate": 0.0}, Toy.options())


def test_the_vision_keys_are_the_fields_of_vision_config_read_typed():
    assert [o.key for o in VISION_OPTIONS][:2] == ["data.partitioner", "data.alpha"]
    cfg = DigitsTask({"train.lr": 0.125, "data.batch-size": 16.0, "model.name": "auto"}).config
    assert (cfg.lr, cfg.batch_size, cfg.model_name, cfg.grouping) == (0.125, 16, "lenet", "auto")
    assert type(cfg.batch_size) is int and dict(cfg.groups) == {}
