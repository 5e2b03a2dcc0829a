"""Poisson client sampling (DP-FedAvg, subspace-dp, Laplace) and the calibration of
their noise to a target ε, checked against dp-accounting called directly."""

from __future__ import annotations

import math
import re

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg
from scipy import stats

from privacy.accounting import PrivacyLedger
from protocol import keys
from strategies import StopTraining
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive
from strategies.mechanisms.laplace import LaplaceDP
from tests.fakes import FakeGrid, record, reply_from
from tests.strategies.mechanisms import test_subspace_dp

GLOBAL = {"w": [0.0, 0.0], "b": [1.0]}
NODES = list(range(1, 21))  # N = 20


def _poisson_ledger(accountant="pld", **kw) -> PrivacyLedger:
    return PrivacyLedger(accountant=accountant, target_delta=1e-5, sampling="poisson", **kw)


def _wrapper(cls=DPFedAvgFixed, *, m=5, z=1.0, target=None, rounds=10, seed=0, **kw):
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    return cls(
        base,
        clip_norm=1.0,
        noise_multiplier=None if target else z,
        target_epsilon=target,
        planned_rounds=rounds,
        num_sampled_clients=m,
        noise_site="server",
        ledger=kw.pop("ledger", None) or _poisson_ledger(),
        rng=np.random.default_rng(seed),
        **kw,
    )


def _configure(strategy, server_round=1, nodes=NODES):
    return list(
        strategy.configure_train(server_round, record(GLOBAL), ConfigRecord(), FakeGrid(nodes))
    )


def _replies(messages, delta=(0.0, 0.0, 0.0), extra=None):
    out = []
    for message in messages:
        arrays = {"w": np.add(GLOBAL["w"], delta[:2]), "b": np.add(GLOBAL["b"], delta[2:])}
        metrics = {"num-examples": 1, **(extra or {})}
        out.append(reply_from(message.metadata.dst_node_id, arrays, metrics))
    return out


def test_poisson_inclusion_frequency_is_binomial_and_cohorts_vary():
    # Each client independently with q = m / N = 0.25: over R rounds its count is
    # Binomial(R, q); cohort sizes are Binomial(N, q) and vary.
    rounds, m = 400, 5
    strategy = _wrapper(m=m, z=1.0, seed=1, ledger=_poisson_ledger("rdp"))
    counts = dict.fromkeys(NODES, 0)
    sizes = []
    for rnd in range(1, rounds + 1):
        messages = _configure(strategy, rnd)
        sizes.append(len(messages))
        for message in messages:
            counts[message.metadata.dst_node_id] += 1
        strategy.aggregate_train(rnd, _replies(messages))
    q = m / len(NODES)
    # Two-sided 1e-4 bounds per client (20 clients: a false alarm below 0.2 %).
    low, high = stats.binom.ppf([5e-5, 1 - 5e-5], rounds, q)
    assert all(low <= c <= high for c in counts.values()), counts
    assert len(set(sizes)) > 3 and min(sizes) < m < max(sizes)
    assert np.mean(sizes) == pytest.approx(m, rel=0.1)
    (release,) = strategy.ledger.releases[:1]
    assert (release.sampling, release.sample_size, release.population) == ("poisson", m, 20)


def test_poisson_mean_divides_by_the_expected_cohort_and_a_dropout_is_zero():
    strategy = _wrapper(m=5, z=1e-12, seed=3, ledger=_poisson_ledger("rdp"))
    messages = _configure(strategy)
    k = len(messages)
    assert k > 1
    replies = _replies(messages, delta=(0.5, 0.0, 0.0))[1:]  # the first sampled dropped out
    arrays, metrics = strategy.aggregate_train(1, replies)
    # (k - 1) updates of 0.5 (norm 0.5 < C), divided by m = 5 whatever k was.
    np.testing.assert_allclose(arrays["w"].numpy(), [0.5 * (k - 1) / 5, 0.0], atol=1e-9)
    assert metrics[keys.DP_FAILED_CLIENTS] == 1.0


def test_an_empty_cohort_releases_the_noise_alone_and_is_charged():
    strategy = _wrapper(m=1, z=1.0, seed=0)
    for rnd in range(1, 200):
        messages = _configure(strategy, rnd)
        arrays, _ = strategy.aggregate_train(rnd, _replies(messages))
        if not messages:
            break
    assert not messages, "no empty cohort in 200 rounds at q = 1/20"
    assert not np.allclose(arrays["w"].numpy(), GLOBAL["w"])  # N(0, (zC)^2) / m
    assert len(strategy.ledger.releases) == rnd


def test_poisson_round_is_accounted_as_dp_accountings_poisson_subsampled_gaussian():
    strategy = _wrapper(m=5, z=0.9)
    strategy.aggregate_train(1, _replies(_configure(strategy)))
    reference = pld_privacy_accountant.PLDAccountant()
    reference.compose(
        dp_accounting.PoissonSampledDpEvent(5 / 20, dp_accounting.GaussianDpEvent(0.9))
    )
    assert strategy.ledger.epsilon() == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize(("m", "target"), [(5, 8.0), (5, 2.0)])
def test_calibrated_z_meets_the_target_within_two_percent(m, target):
    rounds = 30
    strategy = _wrapper(m=m, target=target, rounds=rounds)
    _configure(strategy)
    z = strategy.noise_multiplier
    assert strategy.calibration["value"] == z and strategy.calibration["population"] == 20
    reference = pld_privacy_accountant.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(m / 20, dp_accounting.GaussianDpEvent(z))
    reference.compose(event, rounds)
    epsilon = reference.get_epsilon(1e-5)
    assert 0.98 * target <= epsilon <= target


def test_adaptive_calibration_sets_the_count_noise_and_budget_stops_the_run():
    ledger = _poisson_ledger(max_epsilon=4.0)
    strategy = _wrapper(
        DPFedAvgAdaptive,
        m=5,
        target=4.0,
        rounds=5,
        ledger=ledger,
        target_quantile=0.5,
        clip_lr=0.2,
        clip_count_stddev=None,
    )
    rounds = 0
    with pytest.raises(StopTraining, match=re.escape("would exceed 'dp.max-epsilon'")):
        for rnd in range(1, 20):
            messages = _configure(strategy, rnd)
            strategy.aggregate_train(rnd, _replies(messages, extra={keys.DP_NORM_BIT: 1.0}))
            rounds += 1
    z = strategy.noise_multiplier
    assert strategy.count_stddev == max(5 / 20, z)
    assert rounds == 5 and ledger.epsilon() <= 4.0  # exactly the planned rounds


def test_adaptive_count_is_centred_under_poisson():
    # All sampled clients unclipped (bit 1): the noised centred count over m estimates
    # k/(2m) + 1/2, unbiased for the fraction when k = m on average.
    strategy = _wrapper(
        DPFedAvgAdaptive,
        m=5,
        z=1e-6,
        seed=4,
        ledger=_poisson_ledger("rdp"),
        target_quantile=0.5,
        clip_lr=1e-9,
        clip_count_stddev=1e-6,
    )
    messages = _configure(strategy)
    _, metrics = strategy.aggregate_train(1, _replies(messages, extra={keys.DP_NORM_BIT: 1.0}))
    k = len(messages)
    assert metrics["dp-noisy-unclipped-fraction"] == pytest.approx(0.5 * k / 5 + 0.5, abs=1e-6)


def test_subspace_calibration_plans_its_pmu_rounds():
    # z is the budget; the run's releases are 3 plain rounds and 2 PMU rounds whose
    # update and sketch compose into one Gaussian: dp-accounting over those must meet it.
    strategy = test_subspace_dp._wrapper(
        m=5,
        z=None,
        target_epsilon=6.0,
        rounds=5,
        reserve=0.3,
        every=3,
        ledger=_poisson_ledger(),
    )
    strategy.calibrate(20)
    z_train, z_pmu, z_noise = strategy.noise_split(strategy.noise_multiplier)
    assert z_noise == z_train and strategy.z_pmu == z_pmu
    combined = (z_noise**-2 + z_pmu**-2) ** -0.5
    reference = pld_privacy_accountant.PLDAccountant()
    poisson = dp_accounting.PoissonSampledDpEvent
    reference.compose(poisson(0.25, dp_accounting.GaussianDpEvent(z_noise)), 3)
    reference.compose(poisson(0.25, dp_accounting.GaussianDpEvent(combined)), 2)
    assert 0.98 * 6.0 <= reference.get_epsilon(1e-5) <= 6.0


def _laplace(target=None, epsilon=None, m=5, rounds=10):
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    return LaplaceDP(
        base,
        sensitivity=1.0,
        epsilon=epsilon,
        target_epsilon=target,
        planned_rounds=rounds,
        expected_clients=m,
        ledger=PrivacyLedger(
            accountant="pld",
            target_delta=1e-5,
            sampling="none",
            neighboring="zero-out",
            mechanisms=("laplace",),
        ),
        rng=np.random.default_rng(0),
    )


def test_laplace_samples_poisson_and_charges_every_round_unamplified():
    strategy = _laplace(target=10.0)
    messages = _configure(strategy)
    per_round = strategy.epsilon
    assert 0 < len(messages) < 20
    assert all(m.content[keys.CONFIG][keys.LAPLACE_SCALE] == 1.0 / per_round for m in messages)
    # No amplification: 10 rounds of Laplace(1/ε) composed as they are, and the per-round
    # ε is the larger of what PLD and basic composition (10 · ε <= 10) allow.
    reference = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    reference.compose(dp_accounting.LaplaceDpEvent(1.0 / per_round), 10)
    pld_epsilon = reference.get_epsilon(1e-5)
    assert min(pld_epsilon, 10 * per_round) <= 10.0
    assert per_round >= 1.0 and (per_round == 1.0 or pld_epsilon >= 0.98 * 10.0)
    amplified = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    amplified.compose(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.LaplaceDpEvent(1.0 / per_round)),
        10,
    )
    assert amplified.get_epsilon(1e-5) < 0.8 * 10.0  # what amplification would have claimed
    strategy.aggregate_train(1, _replies(messages))
    (release,) = strategy.ledger.releases
    assert (release.sampling, release.sample_size, release.population) == ("none", 5, 20)
    assert strategy.ledger.epsilon() <= per_round  # one round: at most its own ε


def test_laplace_poisson_mean_divides_by_m():
    strategy = _laplace(epsilon=2.0)  # the fake replies carry no noise: the mean is exact
    messages = _configure(strategy)
    arrays, _ = strategy.aggregate_train(1, _replies(messages, delta=(0.3, 0.0, 0.0)))
    expected = 0.3 * len(messages) / 5
    np.testing.assert_allclose(arrays["w"].numpy(), [expected, 0.0], atol=1e-6)


def test_giving_both_or_neither_noise_parameter_is_refused():
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    common = {"clip_norm": 1.0, "num_sampled_clients": 5, "noise_site": "server"}
    common |= {"ledger": _poisson_ledger(), "rng": np.random.default_rng(0)}
    for noise, target in ((1.0, 8.0), (None, None)):
        with pytest.raises(ValueError, match="exactly one"):
            DPFedAvgFixed(base, noise_multiplier=noise, target_epsilon=target, **common)
    with pytest.raises(ValueError, match="exactly one"):
        _laplace()
    assert math.isfinite(_wrapper(z=1.0).noise_multiplier)


@pytest.mark.parametrize(("d", "m", "warns"), [(21386, 5, True), (4810, 50, False)])
def test_the_noise_to_signal_ratio_is_logged_and_warned_when_it_drowns_the_signal(
    d, m, warns, caplog
):
    strategy = _wrapper(m=m, z=1.2)
    big = {"w": np.zeros(d - 1), "b": [0.0]}
    with caplog.at_level("INFO", logger="flwr"):
        strategy._fix_released(record(big))
    (line,) = [r for r in caplog.records if "noise on the mean update" in r.getMessage()]
    ratio = 1.2 * math.sqrt(d) / m  # 35.1 for LeNet at m = 5, 1.7 for the MLP at m = 50
    assert f"about {ratio:.1f} x C" in line.getMessage()
    assert (line.levelname == "WARNING") is warns
    assert ("expect the model to learn little" in line.getMessage()) is warns


@pytest.mark.parametrize(
    "make", [lambda: _wrapper(target=8.0, rounds=200), lambda: _laplace(target=10.0)]
)
def test_a_resumed_calibrated_run_declares_its_plan_again(make):
    # The run ledger reports a checkpoint count's ε past 128 rounds but never past the
    # planned run (privacy.accounting): a resume must restore that cap with the rest.
    first = make()
    _configure(first)
    assert first.ledger._planned  # declared at calibration
    resumed = make()
    assert not resumed.ledger._planned
    resumed.load_state_dict(first.state_dict())
    assert resumed.ledger._planned == first.ledger._planned
