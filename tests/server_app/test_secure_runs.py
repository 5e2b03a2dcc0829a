"""Whole runs under ``secagg.enabled``: the app's round loop, the real ClientApp in
process, the ledger and the threat-model report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from privacy.events import RDP_ORDERS
from privacy.skellam import l1_bound, rounded_l2_bound, skellam_rdp
from server_app import config
from tasks.options import ConfigError
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33, 44, 55]
DISTRIBUTED = {
    "secagg.enabled": True,
    "privacy": "dp-fedavg-fixed",
    "dp.noise-site": "client",
    "dp.sampling": "fixed",
    "dp.num-sampled-clients": 4,
    "dp.noise-multiplier": 1.0,
    "dp.clip-norm": 0.5,
    "min-available-nodes": 5,
}


class DroppingGrid(InProcessGrid):
    """The first node sent a collect-stage message in round ``round_`` dies there: after
    it has shared its keys, before its masked vector is sent."""

    def __init__(self, cfg: dict, nodes: list[int], round_: int) -> None:
        super().__init__(cfg, nodes)
        self.round_, self.victim = round_, None

    def send_and_receive(self, messages, *, timeout=None):
        for message in messages:
            stage = message.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
            config = message.content.get("config", {})
            if (
                self.victim is None
                and stage == Stage.COLLECT_MASKED_VECTORS
                and int(config.get("server-round", 0)) == self.round_
            ):
                self.victim = message.metadata.dst_node_id
                self.kill(self.victim)
        return super().send_and_receive(messages, timeout=timeout)


def _run(tmp_path: Path, grid_cls=InProcessGrid, **overrides) -> tuple[Path, InProcessGrid]:
    cfg = run_config(**{"output-dir": str(tmp_path), **overrides})
    args = (cfg, NODES[: int(cfg["min-available-nodes"])])
    grid = grid_cls(*args, 2) if grid_cls is DroppingGrid else grid_cls(*args)
    run_server(cfg, grid)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run_dir, grid


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint" / "global.pt", weights_only=True)


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox"])
def test_secure_aggregation_moves_the_model_as_the_plain_strategy(strategy, tmp_path):
    common = {
        "strategy": strategy,
        "num-server-rounds": 1,
        "fraction-train": 1.0,
        "min-available-nodes": 4,
    }

    secure, _ = _run(tmp_path / "secure", **common, **{"secagg.enabled": True})
    plain, _ = _run(tmp_path / "plain", **common)

    a, b = _model(secure), _model(plain)
    # Σ w·Δ and Σ w each within 4 clients' rounding (4/s, s = 2^18) of the exact sums.
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 0  # it did go through SecAgg
    outcome = json.loads((secure / "outcome.json").read_text())
    assert outcome["status"] == "completed"


def _ledger(run_dir: Path) -> dict:
    return json.loads((run_dir / "ledger.json").read_text())


def test_distributed_dp_charges_the_noise_of_the_clients_that_reached_the_sum(tmp_path):
    run_dir, grid = _run(tmp_path, DroppingGrid, **DISTRIBUTED, **{"secagg.min-survivors": 3})

    assert grid.victim is not None
    releases = _ledger(run_dir)["state"]["releases"]
    assert [r["server_round"] for r in releases] == [1, 2, 3]
    dim = sum(t.numel() for t in _model(run_dir).values())
    scale = 2**22 / 16
    l2 = rounded_l2_bound(0.5 * scale, dim)
    share = (1.0 * 0.5 * scale) ** 2 / 3  # (zCs)^2 / n_min
    assert [r["mechanism"] for r in releases] == ["skellam"] * 3
    assert [r["sampling"] for r in releases] == ["none"] * 3
    for release, survivors in zip(releases, [4, 3, 4], strict=True):
        assert release["variance"] == pytest.approx(survivors * share, rel=1e-12)
        assert release["l2_sensitivity"] == pytest.approx(l2, rel=1e-12)
    # The ledger's epsilon, recomputed here from the three releases (zero-out: Δ as is).
    rdp = sum(skellam_rdp(RDP_ORDERS, l2, l1_bound(l2, dim), n * share) for n in (4, 3, 4))
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(np.array(RDP_ORDERS), rdp, 1e-5)
    report = _ledger(run_dir)
    assert report["summary"]["epsilon"] == pytest.approx(epsilon, rel=1e-9)
    models = {m["threat-model"]: m for m in report["threat-models"]}
    assert models["honest-but-curious-server"]["holds"]
    assert models["honest-but-curious-server"]["epsilon"] == pytest.approx(epsilon, rel=1e-9)
    assert "SecAgg+" in models["local"]["basis"] and "epsilon" not in models["local"]


def test_a_round_below_the_minimum_survivors_releases_and_charges_nothing(tmp_path):
    run_dir, grid = _run(tmp_path, DroppingGrid, **DISTRIBUTED, **{"secagg.min-survivors": 4})

    releases = _ledger(run_dir)["state"]["releases"]
    assert [r["server_round"] for r in releases] == [1, 3]
    # How many vectors arrived is the server's knowledge, not a release: curator/.
    curator = pd.read_csv(run_dir / "curator" / "metrics.csv")
    train = curator[curator["scope"] == "train"].set_index("round")
    assert train.loc[2, "secagg-survivors"] == 3 and train.loc[2, "secagg-dropped"] == 1
    released = pd.read_csv(run_dir / "metrics.csv")
    epsilon = released[released["scope"] == "train"].set_index("round")["dp-epsilon"]
    assert math.isclose(epsilon.loc[2], epsilon.loc[1]) and epsilon.loc[3] > epsilon.loc[2]
    # The abandoned round left the model as round 1 made it: round 2's central evaluation
    # equals round 1's.
    central = released[released["scope"] == "central-eval"].set_index("round")
    assert central.loc[2, "eval-loss"] == central.loc[1, "eval-loss"]
    assert grid.victim is not None


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"strategy": "clustered"}, ["'secagg.enabled'", "'strategy' = 'clustered'"]),
        ({"strategy": "smart-fedprox"}, ["'secagg.enabled'", "'fedavg', 'fedprox'"]),
        (
            {"strategy": "hierarchical", "task": "digits"},
            ["'secagg.enabled'", "'strategy' = 'hierarchical'"],
        ),
        ({"privacy": "laplace", "dp.epsilon": 5.0}, ["'privacy' = 'laplace'", "valid values"]),
        (
            {
                "privacy": "dp-fedavg-adaptive",
                "dp.noise-site": "client",
                "dp.sampling": "fixed",
                "dp.noise-multiplier": 1.0,
            },
            ["'dp.noise-site' = 'client'", "dp-fedavg-fixed"],
        ),
        ({"secagg.modulus-range": 3 * 2**30}, ["'secagg.modulus-range'", "power of two"]),
        (
            {"privacy": "dp-fedavg-fixed", "dp.noise-multiplier": 1.0, "secagg.min-survivors": 9},
            ["'secagg.min-survivors' = 9", "'dp.num-sampled-clients'"],
        ),
    ],
)
def test_secagg_refuses_what_needs_single_updates(overrides, words):
    with pytest.raises(ConfigError) as err:
        config.load(run_config(**{"secagg.enabled": True, **overrides}))
    for word in words:
        assert word in str(err.value)


def test_distributed_dp_calibrates_the_client_shares_to_the_target(tmp_path):
    # Every sampled client must survive (min-survivors = m): the run spends its target.
    run_dir, _ = _run(
        tmp_path,
        **{
            **DISTRIBUTED,
            "dp.noise-multiplier": 0.0,
            "dp.target-epsilon": 6.0,
            "secagg.min-survivors": 4,
            "num-server-rounds": 2,
        },
    )

    report = _ledger(run_dir)
    assert report["calibration"]["parameter"] == "dp.noise-multiplier"
    assert 6.0 * 0.99 < report["summary"]["epsilon"] <= 6.0


def test_adaptive_clipping_reads_the_securely_summed_norm_bits(tmp_path):
    # Every update of a first round is far above C = 1e-4: all bits 0, so the noised
    # unclipped fraction is N(0, (0.26/4)^2), not the 1 that a lost bit (counted as
    # unclipped) or a missing sum would give.
    run_dir, _ = _run(
        tmp_path,
        **{
            "secagg.enabled": True,
            "privacy": "dp-fedavg-adaptive",
            "dp.num-sampled-clients": 4,
            "dp.sampling": "fixed",
            "dp.noise-multiplier": 0.5,
            "dp.clip-count-stddev": 0.26,
            "dp.clip-norm": 1e-4,
            "dp.clip-lr": 0.2,
            "dp.target-quantile": 0.5,
            "min-available-nodes": 4,
            "num-server-rounds": 1,
        },
    )

    released = pd.read_csv(run_dir / "metrics.csv")
    train = released[released["scope"] == "train"].iloc[0]
    assert abs(train["dp-noisy-unclipped-fraction"]) < 5 * 0.26 / 4
    assert train["dp-clip-norm"] == pytest.approx(1e-4)
    ledger = _ledger(run_dir)
    (release,) = ledger["state"]["releases"]
    assert release["mechanism"] == "gaussian" and release["kind"] == "model-update+clip-count"
