"""Banded-MF and DP-FTRL noise at the server: the noise added is the stream's, the
schemas pick (and refuse) cohorts, resume continues the stream, the ledger's ε is
dp-accounting's."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from config.settings import Choice, SettingsError
from privacy import correlated as cr
from privacy.accounting import PrivacyLedger
from strategies import StopTraining
from strategies.mechanisms.correlated_noise import CorrelatedNoiseDP, CorrelatedSettings
from strategies.mechanisms.correlated_schema import make_plan
from strategies.runtime.checkpoint import decode, encode
from strategies.runtime.partitions import PartitionMap
from tests.fakes import FakeGrid, record, reply_from

GLOBAL = {"w": [0.0, 0.0], "b": [1.0]}
NODES = list(range(1, 13))  # N = 12, partition id = node - 1
UPDATE = (0.3, -0.2, 0.1)  # norm < C = 1: never clipped


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.CACHE_ENV, str(tmp_path))


def _ledger(schema: str) -> PrivacyLedger:
    if schema == "amplified":
        return PrivacyLedger(accountant="pld", target_delta=1e-5, sampling="poisson")
    return PrivacyLedger(
        accountant="pld", target_delta=1e-5, sampling="none", neighboring="zero-out"
    )


def _strategy(
    mechanism="banded-mf", schema="cyclic", *, m=3, z=2.0, target=None, rounds=6, seed=0, **kw
):
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    strategy = CorrelatedNoiseDP(
        base,
        mechanism=mechanism,
        schema=schema,
        clip_norm=1.0,
        noise_multiplier=None if target else z,
        target_epsilon=target,
        planned_rounds=rounds,
        num_sampled_clients=m,
        ledger=_ledger(schema),
        # The test-only seam: a seeded generator in place of the secret one, so the
        # stream can be replayed beside the strategy.
        rng=np.random.default_rng(seed),
        **kw,
    )
    for node in NODES:
        strategy.partitions.record(node, node - 1)
    return strategy


def _round(strategy, server_round, nodes=NODES, update=UPDATE):
    messages = list(
        strategy.configure_train(server_round, record(GLOBAL), ConfigRecord(), FakeGrid(nodes))
    )
    replies = [
        reply_from(
            msg.metadata.dst_node_id,
            {"w": np.add(GLOBAL["w"], update[:2]), "b": np.add(GLOBAL["b"], update[2:])},
            {"num-examples": 1},
        )
        for msg in messages
    ]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    released = np.concatenate([arrays["w"].numpy(), arrays["b"].numpy() - GLOBAL["b"]])
    return sorted(msg.metadata.dst_node_id for msg in messages), released


@pytest.mark.parametrize("mechanism", ["banded-mf", "dp-ftrl"])
def test_noise_added_is_the_streams_and_cohorts_are_cyclic(mechanism):
    m, z, rounds = 3, 2.0, 6
    strategy = _strategy(mechanism, m=m, z=z, rounds=rounds, seed=7)
    replay = np.random.default_rng(7)
    seen: dict[int, list[int]] = {}
    for t in range(1, rounds + 1):
        cohort, released = _round(strategy, t)
        if t == 1:  # b = N // m = 4 groups (partition id mod 4), 4 bands
            assert strategy.plan.separation == 4 and strategy.plan.participations == 2
            stream = (
                cr.TreeNoise(dim=3, std=z, generator=replay)
                if mechanism == "dp-ftrl"
                else cr.BandedNoise(strategy.plan.coefs, dim=3, std=z, generator=replay)
            )
        # Round t trains the first m clients of group (t - 1) mod 4.
        group = (t - 1) % 4
        assert cohort == [p + 1 for p in range(12) if p % 4 == group][:m]
        for node in cohort:
            seen.setdefault(node, []).append(t)
        expected = np.array(UPDATE) + stream.next() / m  # mean of m updates + noise/m
        np.testing.assert_allclose(released, expected, rtol=0, atol=1e-12)
    assert all(b - a >= 4 for rounds_ in seen.values() for a, b in itertools.pairwise(rounds_))
    assert max(len(r) for r in seen.values()) == 2


def test_banded_stream_uses_the_optimised_band_coefficients():
    strategy = _strategy(rounds=6)
    _round(strategy, 1)
    expected = cr.optimize_banded(6, 4)
    assert strategy.plan.bands == 4 and strategy.plan.coefs == expected.coefs


def test_cyclic_ledger_charges_the_whole_run_once_as_dp_accounting_computes_it():
    z = 2.0
    strategy = _strategy(z=z, rounds=6)
    for t in range(1, 7):
        _round(strategy, t)
    plan = strategy.plan
    # k = 2 participations 4 rounds apart in a 4-banded C of 6 rounds: columns 0 and 4
    # (the only pair with two full... column 4 is cut to 2 rows): sum of the two best.
    weights = np.sum(cr.optimize_banded(6, 4).strategy() ** 2, axis=0)
    best = max(weights[i] + weights[j] for i in range(6) for j in range(i + 4, 6))
    assert plan.sensitivity == pytest.approx(math.sqrt(best), rel=1e-12)
    assert plan.method == "disjoint-columns"
    releases = strategy.ledger.state_dict()["releases"]
    assert len(releases) == 1 and releases[0]["server_round"] == 1
    assert releases[0]["noise_multiplier"] == pytest.approx(z / plan.sensitivity)
    assert "schema cyclic" in releases[0]["note"] and "k = 2" in releases[0]["note"]
    direct = (
        pld_privacy_accountant.PLDAccountant(
            dp_accounting.NeighboringRelation.REPLACE_SPECIAL, 1e-4
        )
        .compose(dp_accounting.GaussianDpEvent(z / plan.sensitivity))
        .get_epsilon(1e-5)
    )
    assert strategy.ledger.epsilon() == pytest.approx(direct, rel=1e-9)


def test_amplified_ledger_is_k_poisson_sampled_gaussians():
    z, m = 3.0, 2
    strategy = _strategy(schema="amplified", m=m, z=z, rounds=8, min_separation=4)
    for t in range(1, 9):
        _round(strategy, t)
    plan = strategy.plan
    assert (plan.separation, plan.participations, plan.group_size) == (4, 2, 3)
    assert plan.sensitivity == pytest.approx(1.0)  # max column norm
    charged = [r["server_round"] for r in strategy.ledger.state_dict()["releases"]]
    assert charged == [1, 5]  # one per block of b = 4 rounds
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(m / 3, dp_accounting.GaussianDpEvent(z)), 2
    )
    direct = (
        pld_privacy_accountant.PLDAccountant(
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4
        )
        .compose(event)
        .get_epsilon(1e-5)
    )
    assert strategy.ledger.epsilon() == pytest.approx(direct, rel=1e-6)


def test_amplified_cohorts_come_from_the_rounds_group_only():
    strategy = _strategy(schema="amplified", m=2, z=3.0, rounds=12, min_separation=4, seed=3)
    for t in range(1, 13):
        cohort, _ = _round(strategy, t)
        assert all((node - 1) % 4 == (t - 1) % 4 for node in cohort)


def test_least_error_b_is_chosen_from_the_connected_groups_and_recorded():
    # N = 12, m = 4: b in 1..3 (groups of 12, 6, 4 by partition id mod b), n = 6
    strategy = _strategy(
        schema="amplified", m=4, target=3.0, rounds=6, choose_separation="least-error"
    )
    _round(strategy, 1)
    expected = cr.least_error_separation(
        rounds=6, cohort=4, group_sizes={1: 12, 2: 6, 3: 4}, target_epsilon=3.0, delta=1e-5
    )
    plan = strategy.plan
    assert (plan.choice, plan.separation, plan.sweep) == (
        "least-error",
        expected.separation,
        expected.sweep,
    )
    assert plan.group_size == 12 // plan.separation and plan.bands == plan.separation
    record_ = strategy.calibration
    assert record_["separation-choice"] == "least-error"
    assert record_["min-separation"] == plan.separation
    assert record_["separation-sweep"] == [list(row) for row in expected.sweep]
    chosen = next(row for row in plan.sweep if row[0] == plan.separation)
    # the run's own calibration (the ledger's PLD) gives the z the sweep weighed
    assert strategy.noise_multiplier == pytest.approx(chosen[2], rel=1e-6)
    assert "the least-error b" in strategy.ledger.state_dict()["releases"][0]["note"]
    resumed = _strategy(
        schema="amplified", m=4, target=3.0, rounds=6, choose_separation="least-error"
    )
    resumed.load_state_dict(decode(encode(strategy.state_dict())))
    assert resumed.plan == plan  # the choice survives a resume, not made again


def test_least_error_with_no_valid_b_is_refused_in_one_line():
    partitions = PartitionMap()
    for node in NODES:
        partitions.record(node, node - 1)
    with pytest.raises(
        StopTraining,
        match=r"^'correlated.choose-separation' = 'least-error': no valid b for 12 connected "
        r"clients, 'dp.num-sampled-clients' = 13, 6 rounds: no b has groups",
    ):
        make_plan(
            "banded-mf", "amplified", NODES, partitions, rounds=6, m=13,
            choose="least-error", target_epsilon=3.0,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("mechanism", "schema", "target"), [("banded-mf", "cyclic", 4.0), ("dp-ftrl", "cyclic", 4.0)]
)
def test_calibration_meets_the_target_and_records_the_schema(mechanism, schema, target):
    strategy = _strategy(mechanism, schema, target=target, rounds=6)
    for t in range(1, 7):
        _round(strategy, t)
    assert strategy.ledger.epsilon() <= target
    assert strategy.ledger.epsilon() == pytest.approx(target, rel=1e-3)
    record_ = strategy.calibration
    assert record_["schema"] == schema and record_["participations"] == 2
    assert record_["sensitivity"] == pytest.approx(strategy.plan.sensitivity)
    if mechanism == "dp-ftrl":  # honest tree over 6 rounds, k = 2 at separation 4
        assert record_["sensitivity"] == pytest.approx(
            cr.tree_sensitivity(6, participations=2, min_separation=4)
        )
    z = strategy.noise_multiplier
    assert cr.epsilon(
        noise_multiplier=z, sensitivity=strategy.plan.sensitivity, delta=1e-5
    ) == pytest.approx(target, rel=1e-3)


@pytest.mark.parametrize("mechanism", ["banded-mf", "dp-ftrl"])
def test_resume_continues_the_stream_and_charges_nothing_twice(mechanism):
    whole = _strategy(mechanism, seed=11)
    expected = [_round(whole, t)[1] for t in range(1, 7)]
    first = _strategy(mechanism, seed=11)
    got = [_round(first, t)[1] for t in range(1, 4)]
    saved = decode(encode(first.state_dict()))  # as the checkpoint writes it
    resumed = _strategy(mechanism, seed=999)  # its own generator is replaced by the saved one
    resumed.load_state_dict(saved)
    resumed.on_resume()
    got += [_round(resumed, t)[1] for t in range(4, 7)]
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=0, atol=1e-12)
    assert resumed.ledger.state_dict()["releases"] == whole.ledger.state_dict()["releases"]
    assert resumed.ledger.epsilon() == whole.ledger.epsilon()


@pytest.mark.parametrize("mechanism", ["banded-mf", "dp-ftrl"])
def test_a_round_whose_row_of_the_factorization_is_not_next_is_refused(mechanism):
    # The sensitivity is computed for the schema's rounds as C's columns: round t must
    # add the stream's row t. A checkpoint after round 2 resumed at round 4 (round 3
    # skipped) would put a client's rounds 19 rows apart under separation 20.
    first = _strategy(mechanism, seed=3)
    for t in (1, 2):
        _round(first, t)
    resumed = _strategy(mechanism, seed=3)
    resumed.load_state_dict(decode(encode(first.state_dict())))
    charged = resumed.ledger.state_dict()["releases"]
    with pytest.raises(StopTraining, match=r"^round 4: the .* noise stream is at round 3"):
        _round(resumed, 4)
    assert resumed.ledger.state_dict()["releases"] == charged  # nothing charged
    _round(resumed, 3)  # the next row: accepted


def test_too_few_nodes_for_the_schema_is_refused_in_one_line():
    strategy = _strategy(m=3, min_separation=5)  # needs 15 nodes, 12 connected
    with pytest.raises(
        StopTraining,
        match=r"^'correlated.schema' = 'cyclic' needs 3 clients "
        r"in each of b = 5 groups .* = 15 nodes\), only 12 connected$",
    ):
        _round(strategy, 1)
    assert not strategy.ledger.state_dict()["releases"]


def test_a_group_too_small_is_refused():
    strategy = _strategy(m=3, min_separation=4)
    for node in NODES:  # partitions 0..11 but 9 of them in group 0
        strategy.partitions.record(node, 4 * (node - 1) if node < 10 else node)
    with pytest.raises(StopTraining, match=r"smallest of the b = 4 groups .* fewer than"):
        _round(strategy, 1)


def test_rounds_beyond_the_factorization_are_refused():
    strategy = _strategy(rounds=2)
    _round(strategy, 1)
    _round(strategy, 2)
    with pytest.raises(StopTraining, match="built for 'num-server-rounds' = 2"):
        _round(strategy, 3)


def _choice(privacy="banded-mf", strategy="fedavg", **options):
    base = {
        "dp.noise-site": "server",
        "dp.noise-multiplier": 1.0,
        "dp.target-epsilon": 0.0,
        "correlated.schema": "cyclic",
        "correlated.bands": 0,
        "correlated.min-separation": 0,
        "correlated.choose-separation": "given",
        "secagg.enabled": False,
    }
    return Choice(strategy, privacy, "digits", 10, {**base, **options})


_AMP = {
    "correlated.schema": "amplified",
    "correlated.choose-separation": "least-error",
    "dp.noise-multiplier": 0.0,
    "dp.target-epsilon": 2.0,
}


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (_choice("dp-ftrl", **{"correlated.schema": "amplified"}), "banded MF's"),
        (_choice(**{"dp.noise-site": "client"}), "'dp.noise-site' = 'server'"),
        (_choice(strategy="smart-fedprox"), "selects clients by their data"),
        (_choice(**{"dp.noise-multiplier": 0.0}), "exactly one of"),
        (_choice(**{"correlated.bands": 5, "correlated.min-separation": 4}), "valid values 1..4"),
        (
            _choice(**{"correlated.choose-separation": "least-error"}),
            r"^'correlated.choose-separation' = 'least-error' chooses the amplified schema's b",
        ),
        (
            _choice(**{**_AMP, "dp.noise-multiplier": 1.0, "dp.target-epsilon": 0.0}),
            r"weighs the error at 'dp.target-epsilon': set it",
        ),
        (
            _choice(**{**_AMP, "correlated.min-separation": 4}),
            r"'correlated.min-separation' must be 0, got 4$",
        ),
    ],
)
def test_settings_refuse_what_cannot_be_run(choice, message):
    with pytest.raises(SettingsError, match=message):
        CorrelatedSettings.check(choice)
    CorrelatedSettings.check(_choice())  # the default is accepted
    CorrelatedSettings.check(_choice(**_AMP))  # least-error with a target: accepted


def test_registry_builds_it_with_the_momentum_workload():
    from server_app.config import defaults
    from strategies import StrategySettings, build
    from strategies.algorithms.server_optimizer import ServerOptimizer

    options = {
        **defaults(),
        "dp.clip-norm": 1.0,
        "dp.noise-multiplier": 1.0,
        "server.optimizer": "momentum",
        "server.momentum": 0.9,
    }
    settings = StrategySettings(
        strategy="fedavg",
        fraction_train=0.5,
        fraction_evaluate=0.0,
        min_train_nodes=2,
        min_evaluate_nodes=0,
        min_available_nodes=2,
        seed=0,
        options=options,
        num_rounds=6,
    )
    built = build("banded-mf", settings)
    assert isinstance(built, ServerOptimizer)
    inner = built.strategy
    assert isinstance(inner, CorrelatedNoiseDP) and inner.momentum == 0.9
    assert inner.ledger.accountant == "pld" and inner.ledger.neighboring == "zero-out"
    assert inner.strategy.strategy.fraction_train == 1.0  # the schema picks the cohort


def test_a_ledger_that_does_not_match_the_schema_is_refused():
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    with pytest.raises(ValueError, match="needs a ledger with sampling 'poisson'"):
        CorrelatedNoiseDP(
            base,
            mechanism="banded-mf",
            schema="amplified",
            clip_norm=1.0,
            noise_multiplier=1.0,
            num_sampled_clients=2,
            ledger=_ledger("cyclic"),
            rng=np.random.default_rng(0),
        )
