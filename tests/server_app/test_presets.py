"""The ``preset`` run-config key: a preset plus command-line keys runs the preset's
privacy with the keys given, on the ServerApp and in every ClientApp; the run directory
records its federation and versions and a command that makes the same run-config."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
from flwr.common.config import parse_config_args

from config.options import ConfigError
from protocol import presets
from server_app import config, setup
from tests.inprocess import pyproject_defaults, run_like_flwr

# One worker makes the preset run once (a module-scoped fixture per worker otherwise).
pytestmark = [
    pytest.mark.xdist_group("presets"),
    pytest.mark.usefixtures("learning_curve_not_rendered"),
]

PRESET = "digits-dp-eps8"
# A short run of the preset on 4 in-process SuperNodes: 2 rounds, 3 clients expected
# per round (the preset's 10 need 10 nodes).
# RDP calibrates z in a fraction of PLD's time.
OVERRIDES = (
    "num-server-rounds=2 dp.num-sampled-clients=3 vision.local-epochs=1 dp.accountant='rdp'"
)


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("preset-runs")
    result = run_like_flwr(f"preset='{PRESET}' {OVERRIDES} output-dir='{root}'")
    assert result.returncode == 0 and result.run_dir is not None, result.output
    return result


def test_a_preset_with_overrides_runs_the_presets_privacy_with_the_keys_given(preset_run):
    saved = json.loads((preset_run.run_dir / "config.json").read_text())["run-config"]
    preset = presets.load_preset(PRESET)
    assert saved["preset"] == PRESET
    # The preset's privacy and its other keys ...
    assert saved["privacy"] == preset["privacy"] == "dp-fedavg-adaptive"
    assert saved["dp.target-epsilon"] == 8.0
    assert saved["vision.model"] == "mlp" and saved["server.optimizer"] == "momentum"
    # ... with the keys given on the command line in place of the preset's.
    assert preset["num-server-rounds"] == 30 and saved["num-server-rounds"] == 2
    assert preset["dp.num-sampled-clients"] == 10 and saved["dp.num-sampled-clients"] == 3
    # Charged as a private run (two rounds in the ledger), and the ClientApps built the
    # preset's MLP: the LeNet of the defaults would not load the server's weights.
    summary = json.loads((preset_run.run_dir / "ledger.json").read_text())["summary"]
    assert summary["num-releases"] == 2 and 7.0 < summary["epsilon"] <= 8.0
    assert "Rerun: flwr run ." in preset_run.output


def test_the_first_app_line_says_private_mechanism_and_target(preset_run):
    lines = [ln for ln in preset_run.output.splitlines() if ln.startswith("INFO : ")]
    assert lines[0] == (
        "INFO : PRIVATE: dp-fedavg-adaptive, poisson sampling, noise added by the server; "
        "epsilon target 8 at delta 1e-05 (task digits, strategy fedavg, preset "
        f"'{PRESET}')"
    )


def test_a_non_private_run_says_not_private_first_and_last(tmp_path):
    result = run_like_flwr(f"num-server-rounds=1 output-dir='{tmp_path}'")
    assert result.returncode == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("INFO : ")]
    said = (
        "INFO : NOT PRIVATE: privacy='none', no differential privacy "
        "(task digits, strategy fedavg)"
    )
    assert lines[0] == said and lines[-1] == said


def test_the_run_directory_reruns_the_same_resolved_config(preset_run):
    run_dir = preset_run.run_dir
    saved = json.loads((run_dir / "config.json").read_text())["run-config"]
    env = json.loads((run_dir / setup.ENVIRONMENT_FILE).read_text())
    assert env["federation"]["num-nodes"] == 4
    assert set(env["versions"]) >= {"python", "flwr", "torch", "opacus", "dp-accounting"}
    assert env["app"]["dirty"] in (True, False, "unknown")
    command = env["rerun"]
    assert (run_dir / setup.RERUN_FILE).read_text().splitlines()[-1] == command
    # What Flower does with the command: parse --run-config, fuse over the defaults.
    argv = shlex.split(command)
    assert argv[:3] == ["flwr", "run", "."]
    pairs = argv[argv.index("--run-config") + 1]
    rerun = config.load({**pyproject_defaults(), **parse_config_args([pairs])})
    assert rerun.to_dict() == {**saved, "preset": ""}
    assert "preset=" not in pairs and "privacy='dp-fedavg-adaptive'" in pairs


def test_resolution_takes_the_keys_that_differ_from_the_default():
    defaults = {"a": 1, "b": "x", "c": True, "preset": ""}
    fused = {**defaults, "preset": PRESET, "a": 5}
    preset = presets.load_preset(PRESET)
    resolved = presets.resolve(fused, {**defaults, **dict.fromkeys(preset, None)})
    assert resolved["a"] == 5 and resolved["privacy"] == "dp-fedavg-adaptive"
    assert presets.resolve(resolved, {**defaults, **dict.fromkeys(preset, None)}) == resolved
    assert presets.resolve({"a": 1}) == {"a": 1}  # no preset: unchanged


@pytest.mark.parametrize(
    "value", ["digits-dp-eps8", "digits-dp-eps8.toml", "experiments/digits-dp-eps8.toml"]
)
def test_a_preset_is_named_by_its_stem_file_or_path(value):
    cfg = config.load({**pyproject_defaults(), "preset": value})
    assert cfg.preset == PRESET and cfg.privacy == "dp-fedavg-adaptive"


def test_an_unknown_preset_names_the_close_ones():
    with pytest.raises(
        ConfigError, match=r"no preset 'digits-dp-ep8'.*did you mean 'digits-dp-eps8'"
    ):
        config.load({**pyproject_defaults(), "preset": "digits-dp-ep8"})
    with pytest.raises(ConfigError, match="not a preset name"):
        config.load({**pyproject_defaults(), "preset": "../pyproject"})


def test_a_study_preset_named_as_a_preset_points_to_its_study():
    with pytest.raises(presets.PresetError, match=r"studies/lunar-laptop/: run it with"):
        presets.load_preset("lunar-standard-fl")


def test_a_key_given_at_its_default_that_the_preset_sets_is_refused():
    fused = {**pyproject_defaults(), "preset": PRESET, "num-server-rounds": 10}
    with pytest.raises(ConfigError, match=r"num-server-rounds=10 \(the preset has 30\)"):
        config.load(fused, explicit={"preset", "num-server-rounds"})
    # Unknown to the ClientApps too, so without the explicit keys the preset's value runs.
    assert config.load(fused).num_server_rounds == 30
    # A key at its default that the preset does not set is no clash.
    same = {**pyproject_defaults(), "preset": PRESET, "seed": 42}
    assert config.load(same, explicit={"preset", "seed"}).seed == 42


def test_explicit_keys_come_from_the_grids_run():
    grid = SimpleNamespace(run=SimpleNamespace(override_config={"preset": PRESET, "seed": 1}))
    assert setup.explicit_keys(grid) == {"preset", "seed"}
    assert setup.explicit_keys(object()) is None
