"""The same seed twice gives the same metrics.csv through `flwr run` and Ray; another
seed does not.

Every column is compared bit for bit except the wall-clock ones (``TIMING_COLUMNS``).
Flower draws new node ids in every run and replies arrive in any order: sampling over
partition ids and summing in partition order is what makes these runs identical. The
DP, smart-fedprox and secret-noise cases run in process with new node ids and replies
in reverse order (``tests/server_app/test_reproducibility.py``); here FedAvg on digits
and PPO, whose SB3 training runs in Ray's worker processes.
"""

from __future__ import annotations

import pandas as pd
import pytest

from lab.launcher import RunOutcome
from server_app.results import TIMING_COLUMNS

pytestmark = pytest.mark.e2e


# PPO, 2 rounds: SB3 training in Ray's worker processes. The digits runs (FedAvg, 3
# rounds, seeds 7, 7 and 8) are the session's (tests/e2e/conftest.py: digits_runs).
LUNAR = (
    "task='lunar-lander' num-server-rounds=2 fraction-train=0.67 fraction-evaluate=1.0 "
    "ppo.derived-per-base=0 ppo.local-steps=256 ppo.n-steps=64 ppo.n-envs=2 "
    "ppo.batch-size=64 ppo.n-epochs=1 ppo.check-freq=64 ppo.eval-episodes=1"
)
LUNAR_FEDERATION = "num-supernodes=3 client-resources-num-cpus=1"
CONFIGS = ["fedavg-digits", "lunar-lander"]


def _metrics(result: RunOutcome) -> pd.DataFrame:
    assert result.returncode == 0 and result.run_dir is not None, result.output
    metrics = pd.read_csv(result.run_dir / "metrics.csv")
    return metrics.drop(columns=list(TIMING_COLUMNS), errors="ignore")  # DP: timing is curator


@pytest.fixture(scope="module")
def repeated_runs(flower, digits_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("repro-runs")
    lunar = f"{LUNAR} seed=7 output-dir='{root}'"
    return {
        "fedavg-digits": [_metrics(digits_runs.first), _metrics(digits_runs.again)],
        "lunar-lander": [
            _metrics(flower.run(lunar, federation_config=LUNAR_FEDERATION)) for _ in range(2)
        ],
    }


@pytest.mark.parametrize("name", CONFIGS)
def test_same_seed_gives_identical_metrics(repeated_runs, name):
    first, second = repeated_runs[name]
    assert len(first) > 0
    pd.testing.assert_frame_equal(first, second, check_exact=True)


def test_another_seed_gives_other_results(digits_runs, repeated_runs):
    other = _metrics(digits_runs.other)
    first = repeated_runs["fedavg-digits"][0]
    assert list(other.columns) == list(first.columns)
    assert not other.equals(first)
