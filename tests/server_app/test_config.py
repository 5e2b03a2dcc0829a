"""Run-config validation: defaults agree with pyproject, bad input is named."""

import pytest

from config.options import ConfigError
from server_app import config
from tests.inprocess import pyproject_defaults


def test_pyproject_defaults_equal_declared_defaults():
    declared = {opt.key: opt.default for opt in config.all_options()}
    assert pyproject_defaults() == declared


def test_defaults_load_into_typed_config():
    cfg = config.load(pyproject_defaults())
    assert (cfg.task, cfg.strategy, cfg.privacy) == ("digits", "fedavg", "none")
    assert cfg.num_server_rounds == 10 and isinstance(cfg.num_server_rounds, int)
    assert cfg.options["fedprox.mu"] == pytest.approx(0.1)
    with pytest.raises(TypeError):
        cfg.options["fedprox.mu"] = 1.0  # read-only
    assert cfg.to_dict() == {**pyproject_defaults(), "dp.clip-norm": 1.0}  # resolved


@pytest.mark.parametrize(
    ("privacy", "clip"),
    [("none", 1.0), ("dp-fedavg-fixed", 1.0), ("dp-sgd", 1.0), ("dp-fedavg-adaptive", 0.1)],
)
def test_clip_norm_zero_resolves_to_the_mechanism_default(privacy, clip):
    run_config = {**pyproject_defaults(), "privacy": privacy, "dp.target-epsilon": 8.0}
    assert config.load(run_config).options["dp.clip-norm"] == clip
    given = config.load({**run_config, "dp.clip-norm": 0.5})
    assert given.options["dp.clip-norm"] == 0.5


def test_int_given_for_float_is_converted():
    cfg = config.load({**pyproject_defaults(), "fedprox.mu": 1})
    assert cfg.options["fedprox.mu"] == 1.0 and isinstance(cfg.options["fedprox.mu"], float)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("strategy", "fedsgd", "'strategy' = 'fedsgd' is not valid; valid values: 'fedavg'"),
        ("task", "imagenet", "valid values: 'digits', 'mnist'"),
        ("privacy", "dp", "'privacy' = 'dp' is not valid"),
        ("num-server-rounds", 0, "'num-server-rounds' = 0 is out of range; valid range: [1, inf)"),
        ("num-server-rounds", 2.5, "'num-server-rounds' must be an integer"),
        ("fraction-train", 0.0, "'fraction-train' = 0.0 is out of range; valid range: (0, 1]"),
        ("fedprox.mu", -0.1, "'fedprox.mu' = -0.1 is out of range"),
        ("central-eval", "yes", "'central-eval' must be true or false"),
        ("seed", True, "'seed' must be a number"),
        ("vision.partitioner", "nope", "'vision.partitioner' = 'nope' is not valid"),
        ("vision.lr", -1.0, "'vision.lr' = -1.0 is out of range"),
    ],
)
def test_invalid_values_name_key_and_valid_values(key, value, expected):
    with pytest.raises(ConfigError) as err:
        config.load({**pyproject_defaults(), key: value})
    assert expected in str(err.value)


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(ConfigError) as err:
        config.load({**pyproject_defaults(), "fedprox.muu": 0.3})
    assert "unknown run-config key(s): 'fedprox.muu' (did you mean fedprox.mu?)" in str(err.value)


def test_conflicting_declarations_are_rejected(monkeypatch):
    clash = (*config.TOP_LEVEL, config.Option("seed", 7, "clash"))
    monkeypatch.setattr(config, "TOP_LEVEL", clash)
    with pytest.raises(ConfigError, match="'seed' is declared twice"):
        config.all_options()


def test_quantization_without_room_for_the_gaussian_top_up_is_refused_at_load():
    cfg = {**pyproject_defaults(), "privacy": "subspace-dp", "dp.noise-multiplier": 0.3,
           "dp.num-sampled-clients": 50, "subspace.quantize-bits": 2}  # fmt: skip
    with pytest.raises(ConfigError, match=r"'subspace\.quantize-bits' = 2: no valid Gaussian"):
        config.load(cfg)
    config.load({**cfg, "subspace.quantize-bits": 8})  # 8 bits leave room for it
