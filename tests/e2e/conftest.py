"""End-to-end harness: `flwr run . local-simulation` exactly as the README says.

The session shares one private Flower home (4 virtual SuperNodes); its local
SuperLink is stopped by PID at the end, whatever happened. The plain digits runs are
made once per session and read by several modules (:func:`digits_runs`): each
`flwr run` costs Flower's and Ray's start-up, so one run serves every check that
needs a plain FedAvg run through the runtime. The modules that read them are in one
xdist group (``tests/conftest.py``), so they share one session.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from lab.launcher import APP_DIR, LocalSimulation, RunOutcome

# FedAvg on digits, 3 rounds, half the clients trained and evaluated each round, no
# client momentum; the same seed twice and another seed (test_reproducibility), the
# first run against the in-process engine (test_engine_parity) and read as the
# FedAvg run by test_flwr_run (output, learning, plots, checkpoint), the other seed's
# run with the default output-dir (the app directory's runs/). Deterministic torch:
# the runs are compared bit for bit, on CUDA too (docs/testing.md).
DIGITS = (
    "num-server-rounds=3 fraction-train=0.5 fraction-evaluate=0.5 train.momentum=0.0 "
    "train.deterministic=true round-timeout=120.0"
)


@pytest.fixture(scope="session")
def flower():
    with LocalSimulation(num_supernodes=4) as sim:
        yield sim


def git_status() -> str:
    """Tracked files' changes (`flwr run` must not rewrite any, e.g. pyproject.toml)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=APP_DIR,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def run_once(flower, run_config: str, attempts: int = 3) -> RunOutcome:
    """``flower.run(run_config)``, again (up to ``attempts`` in all) while `flwr run`
    gives up on starting its local SuperLink (it waits 15 s; on a loaded machine that
    start-up can take longer, and a later one is faster): the run itself, once."""
    for _ in range(attempts):
        result = flower.run(run_config)
        if not (result.returncode and "Failed to start local SuperLink" in result.output):
            break
    return result


@dataclass
class DigitsRuns:
    first: RunOutcome  # seed 7
    again: RunOutcome  # seed 7 again
    other: RunOutcome  # seed 8, default output-dir; its run directory moved out after
    created_in_app_dir: list[str]  # what the seed-8 run created under <app>/runs
    git: tuple[str, str]  # git status before and after the three runs
    config: str  # the run-config of each (without seed and output-dir)


@pytest.fixture(scope="session")
def digits_runs(flower, tmp_path_factory) -> DigitsRuns:
    """Three plain digits runs through `flwr run` (:data:`DIGITS`)."""
    root = tmp_path_factory.mktemp("digits-runs")
    before = git_status()
    first = run_once(flower, f"{DIGITS} seed=7 output-dir='{root / 'first'}'")
    again = run_once(flower, f"{DIGITS} seed=7 output-dir='{root / 'again'}'")
    runs_root = APP_DIR / "runs"
    existing = set(runs_root.iterdir()) if runs_root.exists() else set()
    other = run_once(flower, f"{DIGITS} seed=8")  # no output-dir: the app directory's
    if other.run_dir is not None and other.run_dir.parent != runs_root:
        # The app pip-installed from another checkout (a shared environment): a relative
        # output-dir resolves against that one; its runs/ is where the run must be.
        runs_root = other.run_dir.parent
        existing = set(runs_root.iterdir()) - {other.run_dir}
        assert runs_root.name == "runs" and (runs_root.parent / "pyproject.toml").is_file()
    created = sorted(set(runs_root.iterdir()) - existing) if runs_root.exists() else []
    moved = root / "other"
    moved.mkdir()
    for path in created:  # out of the repository, whatever the tests find
        shutil.move(path, moved / path.name)
    if other.run_dir is not None and other.run_dir.parent == runs_root:
        other = dataclasses.replace(other, run_dir=moved / other.run_dir.name)
    return DigitsRuns(
        first=first,
        again=again,
        other=other,
        created_in_app_dir=[p.name for p in created],
        git=(before, git_status()),
        config=DIGITS,
    )
