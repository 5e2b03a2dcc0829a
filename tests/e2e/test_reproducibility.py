"""The same seed gives the same metrics.csv through `flwr run` and Ray as in process;
another seed does not.

Every column is compared bit for bit except the wall-clock ones (``TIMING_COLUMNS``).
Flower draws new node ids in every run and replies arrive in any order: sampling over
partition ids and summing in partition order is what makes these runs identical. Here
FedAvg on digits: the session's `flwr run` (seed 7, tests/e2e/conftest.py) against the
in-process engine's run of the same config and seed, and of seed 8. PPO, whose SB3
training runs in Ray's worker processes, through `flwr run` against the engine with
one-thread BLAS and OpenMP pools as Ray gives its workers
(``tests/e2e/test_lunar_lander.py``); the
DP, smart-fedprox and secret-noise cases run in process with new node ids and replies
in reverse order (``tests/server_app/test_reproducibility.py``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from lab import engine
from server_app.results import TIMING_COLUMNS

pytestmark = pytest.mark.e2e


def _metrics(run_dir: Path) -> pd.DataFrame:
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics.drop(columns=list(TIMING_COLUMNS), errors="ignore")  # DP: timing is curator


def _flwr_metrics(digits_run) -> pd.DataFrame:
    result = digits_run.run
    assert result.returncode == 0 and result.run_dir is not None, result.output
    return _metrics(result.run_dir)


def test_same_seed_gives_identical_metrics(digits_run, digits_engine_run):
    first, second = _flwr_metrics(digits_run), _metrics(digits_engine_run)
    assert len(first) > 0
    pd.testing.assert_frame_equal(first, second, check_exact=True)


def test_another_seed_gives_other_results(digits_run, tmp_path):
    assert digits_run.seed != 8
    other = engine.run(
        f"{digits_run.config} seed=8 output-dir='{tmp_path}'", engine.Federation(num_supernodes=4)
    )
    assert other.returncode == 0 and other.run_dir is not None, other.error
    other_metrics, first = _metrics(other.run_dir), _flwr_metrics(digits_run)
    assert list(other_metrics.columns) == list(first.columns)
    assert not other_metrics.equals(first)
