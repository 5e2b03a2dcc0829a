"""Parts read their typed settings: built once per run, shared, from the parsed options."""

from dataclasses import replace

import pytest

from server_app import config
from strategies import registry
from strategies.algorithms.smart_fedprox.strategy import SmartSettings
from strategies.mechanisms.base import DPSettings
from strategies.secure.secagg_plus import SecAggSettings
from tests.inprocess import pyproject_defaults


def test_a_part_is_built_once_and_shared_with_the_strategy_settings_and_checks():
    cfg = config.load({**pyproject_defaults(), "dp.num-sampled-clients": 7, "smart.mu-max": 0.5})
    dp = cfg.part(DPSettings)
    assert (dp.num_sampled_clients, dp.clip_norm) == (7, 1.0)  # clip 0 resolved at load
    assert cfg.part(SmartSettings).mu_max == 0.5
    assert cfg.part(DPSettings) is dp
    assert cfg.strategy_settings().part(DPSettings) is dp


def test_a_copy_with_other_options_builds_its_own():
    settings = config.load(pyproject_defaults()).strategy_settings()
    first = settings.part(DPSettings)
    other = replace(settings, options={**settings.options, "dp.num-sampled-clients": 3})
    assert other.part(DPSettings).num_sampled_clients == 3
    assert settings.part(DPSettings) is first and first.num_sampled_clients == 5


def test_missing_keys_take_the_declared_defaults():
    settings = replace(config.load(pyproject_defaults()).strategy_settings(), options={})
    assert settings.part(SmartSettings).selection == "hybrid"
    assert settings.part(DPSettings).target_delta == 1e-05


def test_secagg_keys_are_checked_only_when_secure_aggregation_is_on():
    bad = {**pyproject_defaults(), "secagg.num-shares": 1.5}
    settings = config.load(bad).strategy_settings()  # secagg.enabled = false: not built
    assert registry.secagg_settings(settings) is None
    with pytest.raises(ValueError, match=r"'secagg.num-shares' must be in \(0, 1\]"):
        settings.part(SecAggSettings)
