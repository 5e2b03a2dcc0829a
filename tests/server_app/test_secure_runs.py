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

from config.options import ConfigError
from privacy.events import RDP_ORDERS
from privacy.skellam import l1_bound, rounded_l2_bound, skellam_rdp
from server_app import config
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

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


# A run with a DroppingGrid: the round after the death waits 'round-timeout' for the
# fifth node (min-available-nodes = 5) before going on with the four survivors; the
# wait is not what these tests check, so it is 1 s rather than the tests' 5 s.
DROPPED = {"round-timeout": 1.0}


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


def test_distributed_dp_charges_the_busiest_client_at_the_least_noise_of_a_sum(tmp_path):
    run_dir, grid = _run(
        tmp_path, DroppingGrid, **DISTRIBUTED, **DROPPED, **{"secagg.min-survivors": 3}
    )

    assert grid.victim is not None
    releases = _ledger(run_dir)["state"]["releases"]
    # 4 of 5 sampled per round (round 2: 3 survivors): some client reached all 3 sums.
    participation = pd.read_csv(run_dir / "curator" / "participation.csv")
    reached = participation[participation["replied"]].groupby("node-id").size()
    assert reached.max() == 3 and sum(r["count"] for r in releases) == 3
    dim = sum(t.numel() for t in _model(run_dir).values())
    scale = 2**22 / 16
    l2 = rounded_l2_bound(0.5 * scale, dim)
    share = (1.0 * 0.5 * scale) ** 2 / 3  # (zCs)^2 / n_min
    assert {r["mechanism"] for r in releases} == {"skellam"}
    assert {r["sampling"] for r in releases} == {"none"}
    for release in releases:  # n_min = 3 shares: the least noise a released sum carries
        assert release["variance"] == pytest.approx(3 * share, rel=1e-12)
        assert release["l2_sensitivity"] == pytest.approx(l2, rel=1e-12)
    # The ledger's epsilon, recomputed here (zero-out: one client's bounds as they are).
    rdp = 3 * skellam_rdp(RDP_ORDERS, l2, l1_bound(l2, dim), 3 * share)
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(np.array(RDP_ORDERS), rdp, 1e-5)
    report = _ledger(run_dir)
    assert report["summary"]["epsilon"] == pytest.approx(epsilon, rel=1e-9)
    models = {m["threat-model"]: m for m in report["threat-models"]}
    assert models["honest-but-curious-server"]["holds"]
    assert models["honest-but-curious-server"]["epsilon"] == pytest.approx(epsilon, rel=1e-9)
    assert "SecAgg+" in models["local"]["basis"] and "epsilon" not in models["local"]


def test_distributed_dp_charges_a_sum_only_when_the_busiest_client_gains_one(tmp_path):
    # 2 of 5 clients a round: after 5 rounds the busiest client reached at most 5 sums,
    # typically 2 or 3; the ledger charges exactly that many, not one per round.
    run_dir, _ = _run(
        tmp_path,
        **{**DISTRIBUTED, "dp.num-sampled-clients": 2, "num-server-rounds": 5},
    )

    releases = _ledger(run_dir)["state"]["releases"]
    participation = pd.read_csv(run_dir / "curator" / "participation.csv")
    reached = participation[participation["replied"]].groupby("node-id").size()
    assert sum(r["count"] for r in releases) == reached.max() <= 5
    assert len(participation) == 10


def test_distributed_dp_samples_only_clients_the_budget_still_covers(tmp_path):
    # A budget of two sums a client: once the busiest client has two, only clients below
    # two are sampled, and the run stops when fewer than m = 2 remain.
    from privacy.skellam import skellam_epsilon

    dim = 21386  # digits' LeNet
    scale = 2**22 / 16
    l2 = rounded_l2_bound(0.5 * scale, dim)
    variance = (1.0 * 0.5 * scale) ** 2  # n_min = m = 2 shares of (zCs)^2 / 2
    budget = skellam_epsilon(2, l2, l1_bound(l2, dim), variance, 1e-5) * 1.0001

    run_dir, _ = _run(
        tmp_path,
        **{
            **DISTRIBUTED,
            "dp.num-sampled-clients": 2,
            "num-server-rounds": 8,
            "dp.max-epsilon": budget,
        },
    )

    participation = pd.read_csv(run_dir / "curator" / "participation.csv")
    reached = participation[participation["replied"]].groupby("node-id").size()
    assert reached.max() == 2  # nobody past the budget's two sums
    assert _ledger(run_dir)["summary"]["epsilon"] <= budget
    outcome = json.loads((run_dir / "outcome.json").read_text())
    # 5 clients x 2 sums = 10 participations = 5 rounds of 2, then nobody is left.
    assert outcome["status"] == "stopped" and "exceeding the budget" in outcome["reason"]
    assert participation["round"].max() <= 5


def test_a_round_below_the_minimum_survivors_releases_and_charges_nothing(tmp_path):
    run_dir, grid = _run(
        tmp_path, DroppingGrid, **DISTRIBUTED, **DROPPED, **{"secagg.min-survivors": 4}
    )

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
            {"privacy": "dp-fedavg-fixed", "dp.noise-multiplier": 1.0, "dp.sampling": "poisson"},
            ["'dp.sampling' = 'fixed'", "abandoned"],
        ),
        (
            {
                "privacy": "dp-fedavg-fixed",
                "dp.noise-multiplier": 1.0,
                "dp.sampling": "fixed",
                "secagg.min-survivors": 9,
            },
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
