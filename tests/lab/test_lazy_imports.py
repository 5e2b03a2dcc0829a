"""Every ``lab`` and ``deploy`` command's ``--help`` imports nothing heavy: PyTorch, Ray,
matplotlib and Flower's simulation load in the functions that use them, so help answers
at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import checks, figures

APP_DIR = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "matplotlib", "flwr.simulation", "sklearn", "tasks")
COMMANDS = sorted(
    f"{package}.{path.stem}" if path.stem != "__main__" else package
    for package in ("lab", "deploy")
    for path in (APP_DIR / package).glob("*.py")
    if "def main(" in path.read_text()
)

# A fresh interpreter runs the command as ``python -m <module> ARGS`` does (importing
# the module, building its parser, running main), then reports what it imported.
PROBE = """
import json, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = None
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def heavy_among(modules: set[str]) -> list[str]:
    """The top-level heavy packages among ``modules``."""
    return sorted(h for h in HEAVY if any(m == h or m.startswith(f"{h}.") for m in modules))


def help_imports(module: str, *args: str) -> tuple[object, set[str], str]:
    """(exit code, imported module names, output) of ``python -m module ARGS``
    (default ``--help``)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, module, *(args or ["--help"])],
        cwd=APP_DIR,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc["code"], set(doc["modules"]), proc.stdout + proc.stderr


def test_the_commands_are_found():
    assert {"lab.study", "lab.comparison", "lab.figures", "lab.connections"} <= set(COMMANDS)
    assert {"deploy.superexec", "deploy.supernode"} <= set(COMMANDS)


@pytest.mark.parametrize("module", COMMANDS)
def test_help_imports_nothing_heavy(module):
    code, modules, output = help_imports(module)
    assert code == 0
    assert "usage:" in output
    assert heavy_among(modules) == [], f"{module} --help imported heavy modules"


def test_an_undeclared_key_is_refused_before_the_app_is_imported():
    """``lab.run`` refuses a key the app does not declare before it imports the ServerApp
    (PyTorch, Flower's runtime: seconds), with the key named."""
    code, modules, output = help_imports("lab.run", "--run-config", "no-such-key=1")
    assert code == 2
    assert "'no-such-key' are not declared by the app" in output
    assert heavy_among(modules) == [] and "server_app.app" not in modules


def test_the_probe_sees_a_heavy_import():
    """The check can fail: a module that imports matplotlib at the top is caught."""
    code, modules, _ = help_imports("lab.figures_plots")  # no main: runs its body only
    assert code is None
    assert heavy_among(modules) == ["matplotlib"]


def test_the_lightweight_copies_match_their_sources():
    """The names the CLI modules keep instead of importing their heavy sources."""
    from lab import figures_plots
    from server_app import audit, failures, plots, results

    assert checks.AUDIT_FILE == audit.AUDIT_FILE
    assert checks.OUTCOME_FILE == failures.OUTCOME_FILE
    assert figures.SCOPE == figures_plots.SCOPE
    assert figures.GROUP_PREFIX == figures_plots.GROUP_PREFIX
    assert figures.GAP == figures_plots.GAP
    assert figures.FORMATS == plots.FORMATS
    assert figures.TIMING_COLUMNS == results.TIMING_COLUMNS
