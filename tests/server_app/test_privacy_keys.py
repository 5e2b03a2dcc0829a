"""Contradictory or out-of-range privacy keys are refused at load, naming the keys."""

from __future__ import annotations

import pytest

from config.options import ConfigError
from server_app import config
from strategies.secure.secagg_plus import MAX_MODULUS, SecAggSettings
from tests.inprocess import run_config


@pytest.mark.parametrize("privacy", ["dp-fedavg-fixed", "laplace", "dp-sgd", "subspace-dp"])
def test_a_budget_below_the_target_is_refused_naming_both(privacy):
    base = {"privacy": privacy, "dp.target-epsilon": 8.0}
    if privacy == "laplace":
        base["dp.epsilon"] = 0.0
    if privacy != "laplace":
        base["dp.noise-multiplier"] = 0.0
    with pytest.raises(ConfigError) as err:
        config.load(run_config(**base, **{"dp.max-epsilon": 4.0}))
    text = str(err.value)
    assert "'dp.max-epsilon' = 4" in text and "'dp.target-epsilon' = 8" in text
    for budget in (8.0, 10.0, 0.0):  # at or above the target, or none: accepted
        config.load(run_config(**base, **{"dp.max-epsilon": budget}))


def test_the_modulus_range_and_its_help_agree():
    (option,) = [o for o in config.all_options() if o.key == "secagg.modulus-range"]
    assert "[4, 2^62]" in option.help and MAX_MODULUS == 2**62
    assert SecAggSettings(modulus_range=2**62).modulus_range == 2**62
    for bad in (2**63, 2**64, 2):
        with pytest.raises(ValueError, match=r"'secagg.modulus-range' must be .*\[4, 2\^62\]"):
            SecAggSettings(modulus_range=bad)
    with pytest.raises(ConfigError, match=r"secagg\.modulus-range"):
        config.load(run_config(**{"secagg.enabled": True, "secagg.modulus-range": 2**63}))


def test_a_count_noise_that_leaves_the_updates_no_share_is_refused_at_load():
    # z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2 needs sigma_b > z/2 (adaptive clipping).
    base = {"privacy": "dp-fedavg-adaptive", "dp.noise-multiplier": 1.0}
    with pytest.raises(
        ConfigError,
        match=r"'dp.clip-count-stddev' = 0.5 must exceed 'dp.noise-multiplier'/2 = 0.5",
    ):
        config.load(run_config(**base, **{"dp.clip-count-stddev": 0.5}))
    config.load(run_config(**base, **{"dp.clip-count-stddev": 0.51}))
    config.load(run_config(**base, **{"dp.clip-count-stddev": 0.0}))  # max(m/20, z) = 1 > 0.5
