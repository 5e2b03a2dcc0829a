"""The in-process engine against the real Flower simulation (`flwr run`, Ray): the same
metrics.csv (outside timing columns) and the same model bit for bit without DP; the same
ledger (events, calibrated noise, epsilon) under DP with secret noise.

Two combinations only: each `flwr run` costs Flower's and Ray's start-up. The wider
strategy x mechanism matrix compares the engine with the in-process harness
(``tests/lab/test_engine.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab import engine
from server_app.results import TIMING_COLUMNS
from tests.e2e.conftest import run_once

pytestmark = pytest.mark.e2e

COMMON = "num-server-rounds=3 seed=7 train.deterministic=true round-timeout=120.0"
PRIVATE = (
    f"{COMMON} privacy='dp-fedavg-adaptive' dp.target-epsilon=8.0 dp.accountant='pld' "
    "dp.num-sampled-clients=2"
)


def _engine(root: Path, options: str) -> Path:
    """The run through the engine (4 nodes), in ``root / 'engine'``."""
    ours = engine.run(
        f"{options} output-dir='{root / 'engine'}'", engine.Federation(num_supernodes=4)
    )
    assert ours.returncode == 0 and ours.run_dir is not None, ours.error
    assert engine.engine_of(ours.run_dir) == "inprocess"
    return ours.run_dir


def _both(flower, root: Path, options: str) -> tuple[Path, Path]:
    """The run through `flwr run` (4 SuperNodes) and through the engine (4 nodes)."""
    flwr = run_once(flower, f"{options} output-dir='{root / 'flwr'}'")
    assert flwr.returncode == 0 and flwr.run_dir is not None, flwr.output
    assert engine.engine_of(flwr.run_dir) == "flwr"
    return flwr.run_dir, _engine(root, options)


def _metrics(run_dir: Path) -> pd.DataFrame:
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics.drop(columns=[c for c in metrics if c in TIMING_COLUMNS])


def test_plain_run_gives_flwr_runs_metrics_and_model(digits_run, digits_engine_run):
    # The session's plain FedAvg run (tests/e2e/conftest.py), seed 7, and the engine's.
    result = digits_run.run
    assert result.returncode == 0 and result.run_dir is not None, result.output
    flwr, ours = result.run_dir, digits_engine_run
    assert engine.engine_of(flwr) == "flwr"
    pd.testing.assert_frame_equal(_metrics(ours), _metrics(flwr), check_exact=True)
    expected = torch.load(flwr / "model.pt", weights_only=True)
    got = torch.load(ours / "model.pt", weights_only=True)
    assert list(got) == list(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert json.loads((ours / "outcome.json").read_text())["status"] == "completed"


def test_private_run_gives_flwr_runs_ledger(flower, tmp_path):
    flwr, ours = _both(flower, tmp_path, PRIVATE)
    expected = json.loads((flwr / "ledger.json").read_text())
    got = json.loads((ours / "ledger.json").read_text())
    # The releases (each an event: mechanism, noise, sampling, round), in charge order.
    assert got["state"] == expected["state"]
    assert got["summary"]["epsilon"] == expected["summary"]["epsilon"] <= 8.0
    assert got["calibration"] == expected["calibration"]
    assert got["calibration"]["accountant"] == "pld"
    assert got["summary"]["num-releases"] == expected["summary"]["num-releases"] > 0
