"""The in-process engine against the real Flower simulation (`flwr run`, Ray): the same
metrics.csv (outside timing columns) and the same model bit for bit without DP.

Under DP with secret noise the engine gives the `flwr run`'s ledger (events, calibrated
noise, epsilon): compared on the audited DP-FedAvg run of
``tests/e2e/test_privacy_runs.py``, the suite's one DP `flwr run` of central DP. Each
`flwr run` costs Flower's and Ray's start-up; the wider strategy x mechanism matrix
(adaptive clipping among it) compares the engine with the in-process harness
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

pytestmark = pytest.mark.e2e


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
