"""Subspace-DP wrapper: P-norm clipping by hand, PMU adoption, ledger charges, head-only."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from privacy.accounting import PrivacyLedger
from privacy.subspace import combined_noise_multiplier, orthonormalize, principal_angle
from protocol import keys
from strategies import StopTraining
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.subspace_dp import SubspaceDP, pmu_rounds
from tests.fakes import FakeGrid, record, reply_from


def _ledger() -> PrivacyLedger:
    return PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="without-replacement")


def _wrapper(*, m=3, z=1e-9, clip=1.0, tau=4.0, reserve=0.0, rank=2, every=2, rounds=4, **kw):
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    return SubspaceDP(
        base,
        clip_norm=clip,
        noise_multiplier=z,
        num_sampled_clients=m,
        rank=rank,
        tau=tau,
        trace_budget=kw.pop("budget", 8.0),
        sketch_dim=kw.pop("sketch_dim", 8),
        pmu_every=every,
        lambda_ptr=1.0,
        pmu_budget_reserve=reserve,
        planned_rounds=rounds,
        seed=0,
        ledger=kw.pop("ledger", None) or _ledger(),
        rng=np.random.default_rng(0),
        **kw,
    )


def _round(strategy, global_arrays, deltas, server_round=1, nodes=None):
    nodes = nodes or range(1, len(deltas) + 1)
    current = record(global_arrays)
    messages = list(
        strategy.configure_train(server_round, current, ConfigRecord(), FakeGrid(nodes))
    )
    replies = [
        reply_from(
            msg.metadata.dst_node_id,
            {k: np.add(global_arrays[k], d[k]) for k in global_arrays},
            {"num-examples": 10},
        )
        for msg, d in zip(messages, deltas, strict=False)
    ]
    return messages, strategy.aggregate_train(server_round, replies)


def test_isotropic_metric_clips_in_the_scaled_norm_by_hand():
    """Round 1 with no PMU: P = 4 I, C = 1, so updates are clipped to L2 norm 1/2."""
    strategy = _wrapper(tau=4.0, clip=1.0)
    glob = {"w": np.zeros(2), "b": np.zeros(1)}
    deltas = [
        {"w": [3.0, 4.0], "b": [0.0]},  # P-norm 10 -> scaled to L2 0.5: [0.3, 0.4]
        {"w": [0.1, 0.0], "b": [0.0]},  # P-norm 0.2: kept
        {"w": [0.0, 0.2], "b": [0.0]},  # P-norm 0.4: kept
    ]
    messages, (arrays, metrics) = _round(strategy, glob, deltas)
    assert all(keys.DP_CLIP_NORM not in m.content[keys.CONFIG] for m in messages)
    np.testing.assert_allclose(arrays["w"].numpy(), [0.4 / 3, 0.6 / 3], atol=1e-6)
    assert metrics["subspace-clip-fraction"] == pytest.approx(1 / 3)
    assert metrics["subspace-mean-pnorm"] == pytest.approx((10 + 0.2 + 0.4) / 3)
    assert metrics["subspace-rank"] == 0.0
    assert "subspace-pmu-adopted" not in metrics


def test_pmu_adopts_a_planted_subspace_and_clips_in_it_next_round():
    rng = np.random.default_rng(1)
    d, m = 40, 30
    planted = orthonormalize(rng.standard_normal((d, 2)))
    glob = {"w": np.zeros(d)}
    deltas = [{"w": planted @ rng.standard_normal(2)} for _ in range(m)]
    strategy = _wrapper(m=m, reserve=0.5, z=1e-6, rank=2, sketch_dim=8, every=2, rounds=4)
    _, (_, metrics) = _round(strategy, glob, deltas)
    assert metrics["subspace-pmu-adopted"] == 1.0
    assert strategy.metric.rank == 2
    assert principal_angle(planted, strategy.metric.basis) < 1e-3
    np.testing.assert_allclose(strategy.metric.lam, [4.0, 4.0])  # B = 8 split over k = 2
    # Round 2 clips in the new metric: ||g||_P^2 = (tau + B/k) ||g||^2 inside U.
    g = planted @ np.array([1.0, 0.0])
    _, (_, metrics2) = _round(strategy, glob, [{"w": g}] * m, server_round=2)
    assert metrics2["subspace-mean-pnorm"] == pytest.approx(np.sqrt(8.0))
    assert metrics2["subspace-rank"] == 2.0 and "subspace-pmu-adopted" not in metrics2


def test_ptr_gate_keeps_the_metric_when_the_sketch_is_noise():
    rng = np.random.default_rng(2)
    deltas = [{"w": rng.standard_normal(40)} for _ in range(5)]
    strategy = _wrapper(m=5, reserve=0.15, z=1.0, rank=2, sketch_dim=8)
    _, (_, metrics) = _round(strategy, {"w": np.zeros(40)}, deltas)
    assert metrics["subspace-pmu-adopted"] == 0.0
    assert strategy.metric.rank == 0
    assert metrics["subspace-pmu-gap"] < metrics["subspace-pmu-gap-threshold"] or (
        metrics["subspace-pmu-kth-eigenvalue"] < metrics["subspace-pmu-lift-threshold"]
    )


def test_ledger_charges_pmu_rounds_as_one_combined_gaussian():
    """Rounds 1 and 3 run PMU (every 2 of 4): update + sketch on the same sample are one
    Gaussian with (z_train^-2 + z_pmu^-2)^-1/2; replace-one halves each multiplier."""
    z, r, m, population = 2.0, 0.2, 3, 5
    strategy = _wrapper(m=m, z=z, reserve=r, every=2, rounds=4)
    glob = {"w": np.zeros(20)}
    rng = np.random.default_rng(3)
    for t in range(1, 5):
        deltas = [{"w": rng.standard_normal(20)} for _ in range(m)]
        _round(strategy, glob, deltas, server_round=t, nodes=range(1, population + 1))
    z_train = z / np.sqrt(1 - r)
    z_pmu = z * np.sqrt(pmu_rounds(4, 2) / (4 * r))
    assert [rel.kind for rel in strategy.ledger.releases] == [
        "model-update+pmu-sketch",
        "model-update",
        "model-update+pmu-sketch",
        "model-update",
    ]
    both = combined_noise_multiplier(z_train, z_pmu)
    assert strategy.ledger.releases[0].noise_multiplier == pytest.approx(both / 2)
    assert strategy.ledger.releases[1].noise_multiplier == pytest.approx(z_train / 2)
    # Independent recomputation with dp-accounting.
    q = m / population
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    for multiplier in (both / 2, z_train / 2, both / 2, z_train / 2):
        accountant.compose(
            dp_accounting.SampledWithoutReplacementDpEvent(
                population, m, dp_accounting.GaussianDpEvent(multiplier)
            )
        )
    assert strategy.ledger.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert 0 < q < 1
    # Unamplified zCDP rho equals DP-FedAvg's with multiplier z over the 4 rounds.
    rho = 2 / (2 * z_train**2) + 2 / (2 * both**2)
    assert rho == pytest.approx(4 / (2 * z**2))


def test_head_only_releases_only_the_head_arrays():
    glob = {"body": np.ones(3), "head": np.zeros(2)}
    deltas = [{"body": [5.0, 5.0, 5.0], "head": [0.1, 0.0]}] * 3
    strategy = _wrapper(z=1.0, released_keys=("head",))
    _, (arrays, _) = _round(strategy, glob, deltas)
    np.testing.assert_array_equal(arrays["body"].numpy(), np.ones(3))  # frozen, no noise
    assert strategy.metric.dim == 2
    # DP-FedAvg honours the same restriction.
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    dp = DPFedAvgFixed(
        base,
        clip_norm=1.0,
        noise_multiplier=5.0,
        num_sampled_clients=3,
        noise_site="server",
        ledger=_ledger(),
        rng=np.random.default_rng(0),
        released_keys=("head",),
    )
    _, (arrays, _) = _round(dp, glob, deltas)
    np.testing.assert_array_equal(arrays["body"].numpy(), np.ones(3))
    assert not np.allclose(arrays["head"].numpy(), 0.1)  # noised


def test_head_only_keys_must_exist():
    strategy = _wrapper(released_keys=("fc.weight",))
    with pytest.raises(StopTraining, match=r"fc\.weight"):
        _round(strategy, {"w": np.zeros(2)}, [{"w": [0.0, 0.0]}] * 3)


def test_sketch_too_large_stops_before_any_work(monkeypatch):
    monkeypatch.setattr("strategies.mechanisms.subspace_dp.geometry.MAX_SKETCH_BYTES", 100)
    strategy = _wrapper(reserve=0.1)
    with pytest.raises(StopTraining, match=r"subspace\.sketch-dim"):
        _round(strategy, {"w": np.zeros(20)}, [{"w": np.zeros(20)}] * 3)


def test_rank_must_be_below_sketch_dim():
    with pytest.raises(ValueError, match="sketch_dim"):
        _wrapper(rank=8, sketch_dim=8)


def test_public_initial_basis_is_used_from_round_one():
    rng = np.random.default_rng(4)
    basis = orthonormalize(rng.standard_normal((10, 2)))
    strategy = _wrapper(initial_basis=basis, tau=1.0, budget=6.0)
    g = basis @ np.array([0.0, 0.5])
    _, (_, metrics) = _round(strategy, {"w": np.zeros(10)}, [{"w": g}] * 3)
    assert metrics["subspace-rank"] == 2.0
    assert metrics["subspace-mean-pnorm"] == pytest.approx(0.5 * np.sqrt(1.0 + 3.0))
    wrong = _wrapper(initial_basis=basis[:5])
    with pytest.raises(StopTraining, match="initial basis"):
        _round(wrong, {"w": np.zeros(10)}, [{"w": g}] * 3)


def test_unusable_pmu_estimate_keeps_the_metric(monkeypatch):
    def rank_deficient(*_args, **_kwargs):
        raise ValueError("the vectors are linearly dependent: no rank-k basis")

    monkeypatch.setattr(
        "strategies.mechanisms.subspace_dp.geometry.estimate_subspace", rank_deficient
    )
    strategy = _wrapper(reserve=0.2)
    _, (arrays, metrics) = _round(strategy, {"w": np.zeros(20)}, [{"w": np.ones(20)}] * 3)
    assert arrays is not None and metrics["subspace-pmu-adopted"] == 0.0
    assert strategy.metric.rank == 0 and len(strategy.ledger.releases) == 1  # still charged
