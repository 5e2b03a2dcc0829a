"""Keys of earlier versions (the image tasks' ``data.*``, ``model.name``, ``train.*``,
the lunar lander's ``ppo.learning-rate*``) are refused by name, early, everywhere a
run-config enters: the ServerApp's load, a preset, ``python -m lab check``."""

from __future__ import annotations

import json

import pytest

from config.options import ConfigError, check_unknown_keys
from config.renamed import RENAMED_KEYS, current_keys, renamed_message
from lab import check
from protocol import presets
from server_app import config


def test_every_old_key_names_a_declared_key_and_none_is_declared_itself():
    declared = {opt.key for opt in config.all_options()}
    assert len(RENAMED_KEYS) == 23
    assert sorted(set(RENAMED_KEYS.values()) - declared) == []
    assert sorted(set(RENAMED_KEYS) & declared) == []


def test_the_message_names_each_new_key_on_one_line():
    assert renamed_message(["seed", "vision.lr"]) is None
    assert renamed_message(["train.lr", "seed"]) == "'train.lr' is now 'vision.lr'"
    assert renamed_message(["ppo.learning-rate-moon", "data.groups"]) == (
        "'data.groups' is now 'vision.grouping'; 'ppo.learning-rate-moon' is now 'ppo.lr-moon'"
    )


def test_the_serverapp_refuses_an_old_key_before_anything_runs():
    with pytest.raises(ConfigError, match=r"^'train\.lr' is now 'vision\.lr'$"):
        config.load({**config.defaults(), "train.lr": 0.1})
    # the generic unknown-key error stays for a key that never existed
    with pytest.raises(ConfigError, match=r"^unknown run-config key\(s\): 'train\.lrr'"):
        check_unknown_keys({"train.lrr": 0.1}, config.all_options())


def test_a_preset_naming_an_old_key_is_refused_where_it_is_read(tmp_path, monkeypatch):
    (tmp_path / "old-keys.toml").write_text('task = "digits"\nmodel.name = "lenet"\n')
    monkeypatch.setattr(presets, "EXPERIMENTS_DIR", tmp_path)
    presets.load_preset.cache_clear()
    try:
        with pytest.raises(
            presets.PresetError,
            match=r"^'preset' = 'old-keys': 'model\.name' is now 'vision\.model'$",
        ):
            presets.load_preset("old-keys")
        with pytest.raises(ConfigError, match=r"'model\.name' is now 'vision\.model'$"):
            config.load({**config.defaults(), "preset": "old-keys"})
    finally:
        presets.load_preset.cache_clear()


def test_lab_check_names_the_new_key_of_an_override():
    with pytest.raises(check.CheckError, match=r"^'data\.alpha' is now 'vision\.alpha'$"):
        check.check(["data.alpha=0.1 num-server-rounds=2"])


def test_a_run_recorded_under_the_old_names_is_read_under_the_new_ones(tmp_path):
    from server_app.results import _load_checkpoint

    assert current_keys({"train.lr": 0.1, "seed": 1, "dp.clip-norm": 1.0}) == {
        "vision.lr": 0.1,
        "seed": 1,
        "dp.clip-norm": 1.0,
    }
    old = {"task": "digits", "train.lr": 0.1, "data.groups": "none", "output-dir": "a"}
    (tmp_path / "config.json").write_text(json.dumps({"run-config": old}))
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "server.pt").write_bytes(b"not a checkpoint")
    now = {"task": "digits", "vision.lr": 0.1, "vision.grouping": "none", "output-dir": "b"}
    # the run-configs agree under today's names: resuming gets as far as the checkpoint
    with pytest.raises(ConfigError, match=r"the checkpoint .* cannot be read"):
        _load_checkpoint(tmp_path, now)
    with pytest.raises(ConfigError, match=r"'vision\.lr': 0\.1 then, 0\.2 now"):
        _load_checkpoint(tmp_path, {**now, "vision.lr": 0.2})
