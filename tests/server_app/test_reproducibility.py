"""The same seed twice gives the same metrics.csv, whatever the node ids and the order
in which replies arrive; DP noise is secret unless ``dp.reproducible-noise`` is set.

The ServerApp runs against the real ClientApp in this process (:mod:`tests.inprocess`).
The second run gets new node ids and its replies come back in reverse order, as a new
Flower run may deliver them. ``tests/e2e/test_reproducibility.py`` checks the same for
plain FedAvg and for PPO through `flwr run` and Ray.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from server_app.results import TIMING_COLUMNS
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
NEW_NODES = [808, 707, 606, 505]

DP_ADAPTIVE = {
    "privacy": "dp-fedavg-adaptive", "fraction-train": 0.5, "dp.num-sampled-clients": 2,
    "dp.noise-multiplier": 1.0, "dp.clip-count-stddev": 1.0,
}  # fmt: skip
CONFIGS = {
    "dp-fedavg-adaptive-digits": {**DP_ADAPTIVE, "dp.reproducible-noise": True},
    "smart-fedprox-finance": {
        "task": "finance", "strategy": "smart-fedprox", "fraction-train": 0.5,
        "finance.synthetic-rows": 2000, "finance.device": "cpu", "fedprox.mu": 0.1,
        "smart.cold-start-rounds": 1,
    },
}  # fmt: skip


class ReversedGrid(InProcessGrid):
    """Replies in the reverse of the order the messages were sent."""

    def send_and_receive(self, messages, *, timeout=None):
        return list(reversed(super().send_and_receive(messages, timeout=timeout)))


def _metrics(root: Path, options: dict, nodes: list[int], grid=InProcessGrid) -> pd.DataFrame:
    # Two rounds: the second starts from what the first left (the adaptive clip norm,
    # smart-fedprox past its cold start).
    config = run_config(**options, **{"seed": 7, "output-dir": str(root), "num-server-rounds": 2})
    run_server(config, grid(config, nodes))
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics.drop(columns=[c for c in metrics if c in TIMING_COLUMNS or "node" in c])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_seed_gives_identical_metrics(name, tmp_path):
    first = _metrics(tmp_path / "a", CONFIGS[name], NODES)
    second = _metrics(tmp_path / "b", CONFIGS[name], NEW_NODES, ReversedGrid)
    assert len(first) > 0
    pd.testing.assert_frame_equal(first, second, check_exact=True)


def test_dp_noise_is_secret_by_default(tmp_path):
    first = _metrics(tmp_path / "a", DP_ADAPTIVE, NODES)
    second = _metrics(tmp_path / "b", DP_ADAPTIVE, NODES)
    central = [m[m["scope"] == "central-eval"]["eval-loss"].to_numpy() for m in (first, second)]
    assert central[0][0] == central[1][0]  # round 0: the same seeded initial model
    assert not (central[0][1:] == central[1][1:]).any()  # then different noise
    assert (first["dp-noise-from-seed"].dropna() == 0).all()
