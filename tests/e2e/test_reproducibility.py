"""The same seed twice gives the same metrics.csv; another seed does not (issue 11).

Every column is compared bit for bit except the wall-clock ones (``TIMING_COLUMNS``).
Flower draws new node ids in every run and replies arrive in any order: sampling over
partition ids and summing in partition order is what makes these runs identical. DP
runs repeat only under ``dp.reproducible-noise``: by default their noise and sample are
secret (OS entropy), and two runs with one seed differ.
"""

from __future__ import annotations

import pandas as pd
import pytest

from server_app.results import TIMING_COLUMNS

pytestmark = pytest.mark.e2e


DIGITS = "num-server-rounds=3 fraction-train=0.5 fraction-evaluate=0.5 train.momentum=0.0"
DP_ADAPTIVE = (
    f"{DIGITS} privacy='dp-fedavg-adaptive' dp.num-sampled-clients=2 "
    "dp.noise-multiplier=0.5 dp.clip-count-stddev=1.0"
)
CONFIGS = {
    "fedavg-digits": (DIGITS, ""),
    "dp-fedavg-adaptive-digits": (f"{DP_ADAPTIVE} dp.reproducible-noise=true", ""),
    "smart-fedprox-finance": (
        "task='finance' strategy='smart-fedprox' num-server-rounds=3 fraction-train=0.5 "
        "fraction-evaluate=1.0 finance.synthetic-rows=2000 finance.device='cpu' "
        "fedprox.mu=0.1 smart.cold-start-rounds=1",
        "",
    ),
    "lunar-lander": (
        "task='lunar-lander' num-server-rounds=2 fraction-train=0.67 fraction-evaluate=1.0 "
        "ppo.derived-per-base=0 ppo.local-steps=256 ppo.n-steps=64 ppo.n-envs=2 "
        "ppo.batch-size=64 ppo.n-epochs=1 ppo.check-freq=64 ppo.eval-episodes=1",
        "num-supernodes=3",
    ),
}


def _metrics(flower, root, options: str, federation: str, seed: int) -> pd.DataFrame:
    result = flower.run(f"{options} seed={seed} output-dir='{root}'", federation_config=federation)
    assert result.returncode == 0 and result.run_dir is not None, result.output
    metrics = pd.read_csv(result.run_dir / "metrics.csv")
    return metrics.drop(columns=list(TIMING_COLUMNS), errors="ignore")  # DP: timing is curator


@pytest.fixture(scope="module")
def repeated_runs(flower, tmp_path_factory):
    root = tmp_path_factory.mktemp("repro-runs")
    return {
        name: [_metrics(flower, root, options, federation, seed=7) for _ in range(2)]
        for name, (options, federation) in CONFIGS.items()
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_seed_gives_identical_metrics(repeated_runs, name):
    first, second = repeated_runs[name]
    assert len(first) > 0
    pd.testing.assert_frame_equal(first, second, check_exact=True)


def test_another_seed_gives_other_results(flower, tmp_path_factory, repeated_runs):
    options, federation = CONFIGS["fedavg-digits"]
    other = _metrics(flower, tmp_path_factory.mktemp("repro-other"), options, federation, 8)
    first = repeated_runs["fedavg-digits"][0]
    assert list(other.columns) == list(first.columns)
    assert not other.equals(first)


def test_dp_noise_is_secret_by_default(flower, tmp_path_factory):
    root = tmp_path_factory.mktemp("repro-secret")
    first, second = (_metrics(flower, root, DP_ADAPTIVE, "", seed=7) for _ in range(2))
    assert list(first.columns) == list(second.columns)
    central = [m[m["scope"] == "central-eval"]["eval-loss"].to_numpy() for m in (first, second)]
    assert central[0][0] == central[1][0]  # round 0: the same seeded initial model
    assert not (central[0][1:] == central[1][1:]).any()  # then different noise
    assert (first["dp-noise-from-seed"].dropna() == 0).all()
