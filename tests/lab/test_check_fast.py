"""``python -m lab check`` answers a bad value before PyTorch loads: the values are
checked against ``lab/run_config_options.json`` (generated from the declarations;
``tests/test_docs.py`` fails when it is stale) with the ServerApp's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import check

APP_DIR = Path(__file__).resolve().parents[2]

# A fresh interpreter: the error line and whether PyTorch or a task module was imported.
PROBE = """
import json, sys
from lab import check
try:
    check.check(sys.argv[1:])
    line = "OK"
except check.CheckError as err:
    line = str(err)
heavy = sorted(m for m in sys.modules if m in ("torch", "strategies", "server_app.config")
               or m.startswith("tasks.vision"))
print(json.dumps({"line": line, "heavy": heavy}))
"""


def _probe(*run_config: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *run_config],
        cwd=APP_DIR,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_bad_value_is_refused_before_pytorch_loads():
    doc = _probe("dp.noise-multiplier=-1")
    assert doc == {
        "line": "'dp.noise-multiplier' = -1.0 is out of range; valid range: [0, inf)",
        "heavy": [],
    }


def test_a_preset_is_resolved_before_its_values_are_checked():
    # The preset's own values are valid; an override beside it is checked as given.
    with pytest.raises(check.CheckError, match=r"'dp.target-epsilon' = -3.0 is out of range"):
        check._check_values(
            {**check_defaults(), "preset": "digits-dp-eps8", "dp.target-epsilon": -3}
        )
    check._check_values({**check_defaults(), "preset": "digits-dp-eps8"})


def test_the_fast_path_gives_the_serverapps_message():
    from config.options import ConfigError
    from server_app import config

    bad = {"strategy": "fedsgd"}
    with pytest.raises(ConfigError) as served:
        config.load(bad)
    with pytest.raises(check.CheckError) as fast:
        check._check_values({**check_defaults(), **bad})
    assert str(fast.value) == str(served.value)


def test_without_the_file_the_servers_code_still_checks(monkeypatch, tmp_path):
    monkeypatch.setattr(check, "OPTIONS_FILE", tmp_path / "absent.json")
    check._check_values({**check_defaults(), "dp.noise-multiplier": -1})  # no fast answer
    with pytest.raises(check.CheckError, match=r"dp\.noise-multiplier. = -1\.0 is out of range"):
        check.check(["dp.noise-multiplier=-1"])


def check_defaults() -> dict:
    from protocol import presets

    return dict(presets.app_defaults())
