"""SmartFedProx (the SmartFedProx study, sections 1-3): hybrid selection, per-node adaptive-mu
inputs, reply validation and FedAvg aggregation, against hand-computed values."""

import logging
import math
from collections import Counter

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from protocol import keys
from strategies import StopTraining
from strategies.algorithms.smart_fedprox.hybrid_selection import (
    fill_unknown,
    hybrid_counts,
    sample_hybrid,
    sample_hybrid_groups,
    smoothed_divergence,
)
from strategies.algorithms.smart_fedprox.strategy import HISTORY_COLUMNS, SmartFedProx
from tasks.adaptive_mu import ema
from tests.fakes import FakeGrid, error_from, record, reply_from

INITIAL = {"w": [0.0, 0.0]}


def _strategy(selection="random", seed=5, **overrides):
    settings = {
        "fraction_train": 1.0,
        "fraction_evaluate": 1.0,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        "min_available_nodes": 1,
        "proximal_mu": 0.1,
        "adaptive_mu": True,
        "cold_start_rounds": 3,
        "exploration_rate": 0.15,
        "mu_min": 0.01,
        "mu_max": 1.0,
        "local_epochs": 3,
        "connect_timeout": 0.0,
    } | overrides
    return SmartFedProx(selection=selection, seed=seed, **settings)


def _configure(strategy, server_round=1, nodes=range(1, 4), config=None):
    messages = strategy.configure_train(
        server_round, record(INITIAL), ConfigRecord(config or {"lr": 0.01}), FakeGrid(nodes)
    )
    return {m.metadata.dst_node_id: m for m in messages}


def _reply(node, divergence, w=(1.0, 1.0), examples=1, **extra):
    metrics = {"num-examples": examples, "divergence": divergence, "train-loss": 0.5} | extra
    return reply_from(node, {"w": list(w)}, metrics)


def _rows(strategy, server_round):
    return {r["node-id"]: r for r in strategy.history if r["round"] == server_round}


# -- pure selection functions -------------------------------------------------------
def test_smoothed_divergence_by_hand():
    assert smoothed_divergence([2.0]) == 2.0
    assert smoothed_divergence([1.0, 2.0]) == pytest.approx(13 / 8)  # 5/8 * 2 + 3/8 * 1
    # 0.5 * 4 + 0.3 * 3 + 0.2 * mean(1, 2) = 2 + 0.9 + 0.3
    assert smoothed_divergence([1.0, 2.0, 3.0, 4.0]) == pytest.approx(3.2)
    with pytest.raises(ValueError, match="empty"):
        smoothed_divergence([])


@pytest.mark.parametrize(
    ("n", "counts"),
    [(10, (3, 5, 2)), (1, (0, 1, 0)), (4, (1, 2, 1)), (5, (2, 3, 0)), (20, (6, 10, 4))],
)
def test_hybrid_counts_round_halves_up(n, counts):
    assert hybrid_counts(n) == counts


def test_unknown_nodes_get_the_mean_of_the_known():
    assert fill_unknown([4, 1, 2, 3], {1: 1.0, 2: 3.0, 9: 100.0}) == {
        1: 1.0,
        2: 3.0,
        3: 2.0,
        4: 2.0,
    }
    assert fill_unknown([1, 2], {}) == {1: 0.0, 2: 0.0}


def test_hybrid_takes_30_50_20_from_high_middle_low():
    # Prepare: 30 nodes, divergence = node id: high 21..30, middle 11..20, low 1..10
    nodes = list(range(1, 31))
    smoothed = {n: float(n) for n in nodes}

    # Execute
    groups = sample_hybrid_groups(nodes, smoothed, 10, np.random.default_rng(0))

    # Assert
    by_group = {g: sorted(n for n, x in groups.items() if x == g) for g in set(groups.values())}
    assert {g: len(m) for g, m in by_group.items()} == {"high": 3, "middle": 5, "low": 2}
    assert all(21 <= n <= 30 for n in by_group["high"])
    assert all(11 <= n <= 20 for n in by_group["middle"])
    assert all(1 <= n <= 10 for n in by_group["low"])
    assert sample_hybrid(nodes, smoothed, 10, np.random.default_rng(0)) == sorted(groups)


def test_hybrid_is_reproducible_for_a_seed_and_varies_across_seeds():
    nodes = list(range(1, 31))
    smoothed = {n: float(n) for n in nodes}

    def pick(seed):
        return sample_hybrid(nodes, smoothed, 10, np.random.default_rng(seed))

    assert pick(1) == pick(1)
    assert len({tuple(pick(seed)) for seed in range(10)}) > 1


def test_small_groups_are_filled_from_the_unchosen_nodes():
    # 6 nodes in groups of 2: counts (2, 3, 1) -> middle is one short, filled from low
    smoothed = {n: float(n) for n in range(1, 7)}
    groups = sample_hybrid_groups(range(1, 7), smoothed, 6, np.random.default_rng(3))
    assert [groups[n] for n in (6, 5, 4, 3)] == ["high", "high", "middle", "middle"]
    assert {groups[1], groups[2]} == {"low", "fill"}
    # 4 nodes in groups 2/1/1: counts (1, 2, 1) -> middle one short, filled from high
    groups = sample_hybrid_groups(
        range(1, 5), {n: float(n) for n in range(1, 5)}, 4, np.random.default_rng(3)
    )
    assert Counter(groups.values()) == {"high": 1, "middle": 1, "low": 1, "fill": 1}
    assert groups[2] == "middle" and groups[1] == "low"
    assert {groups[3], groups[4]} == {"high", "fill"}
    with pytest.raises(ValueError, match="n = 5"):
        sample_hybrid_groups(range(1, 5), {}, 5, np.random.default_rng(0))


def test_ties_are_broken_at_random():
    # Nothing known: all tie, so every node lands in the high group in some draw
    rng = np.random.default_rng(0)
    high = Counter()
    for _ in range(200):
        groups = sample_hybrid_groups(range(1, 10), {}, 3, rng)
        high.update(n for n, g in groups.items() if g == "high")
    assert set(high) == set(range(1, 10))


# -- the strategy ---------------------------------------------------------------------
def test_every_node_gets_its_own_config_with_the_servers_emas():
    # Prepare: round 1: node 1 reports 1.0, node 2 reports 2.0, node 3 fails
    strategy = _strategy(local_epochs=2, mu_min=0.02, mu_max=0.5, ema_alpha=0.3)
    first = _configure(strategy, 1)
    strategy.aggregate_train(1, [_reply(1, 1.0), _reply(2, 2.0), error_from(3)])

    # Execute
    second = _configure(strategy, 2)

    # Assert: EMAs 0.3 * d from 0.0: node 1 0.3, node 2 0.6, node 3 unknown 0.0
    config = {n: m.content[keys.CONFIG] for n, m in second.items()}
    assert [config[n][keys.SMART_CLIENT_DIVERGENCE] for n in (1, 2, 3)] == pytest.approx(
        [0.3, 0.6, 0.0]
    )
    assert all(c[keys.SMART_GLOBAL_DIVERGENCE] == pytest.approx(0.45) for c in config.values())
    assert len({id(c) for c in config.values()}) == 3  # one record per node
    assert dict(config[1]) == {
        "lr": 0.01,
        keys.SERVER_ROUND: 2,
        keys.PROXIMAL_MU: 0.1,
        keys.SMART_ADAPTIVE_MU: True,
        keys.SMART_CLIENT_DIVERGENCE: pytest.approx(0.3),
        keys.SMART_GLOBAL_DIVERGENCE: pytest.approx(0.45),
        keys.SMART_LOCAL_EPOCHS: 2,
        keys.SMART_MU_MIN: 0.02,
        keys.SMART_MU_MAX: 0.5,
        keys.SMART_EMA_ALPHA: 0.3,
    }
    assert all(m.content[keys.CONFIG][keys.SMART_CLIENT_DIVERGENCE] == 0.0 for m in first.values())
    assert all(m.metadata.message_type == "train" for m in second.values())
    assert all(m.metadata.group_id == "2" for m in second.values())


def test_emas_after_two_rounds_keep_the_history_of_a_failed_node():
    strategy = _strategy()
    _configure(strategy, 1)
    strategy.aggregate_train(1, [_reply(1, 1.0), _reply(2, 2.0), error_from(3)])
    _configure(strategy, 2)
    strategy.aggregate_train(2, [_reply(1, 3.0), _reply(2, float("nan")), _reply(3, 4.0)])

    third = _configure(strategy, 3)

    # node 1: 0.3 * 3 + 0.7 * 0.3 = 1.11; node 2 keeps 0.6; node 3: 0.3 * 4 = 1.2
    sent = [third[n].content[keys.CONFIG][keys.SMART_CLIENT_DIVERGENCE] for n in (1, 2, 3)]
    assert sent == pytest.approx([1.11, 0.6, 1.2])
    assert sent[0] == pytest.approx(ema(ema(0.0, 1.0), 3.0))  # the client's EMA
    assert third[1].content[keys.CONFIG][keys.SMART_GLOBAL_DIVERGENCE] == pytest.approx(2.91 / 3)
    assert strategy.divergences == {1: [1.0, 3.0], 2: [2.0], 3: [4.0]}
    assert strategy.faults == {3: 1, 2: 1}


def test_cold_start_rounds_are_random_then_hybrid_or_exploration():
    strategy = _strategy("hybrid", cold_start_rounds=3, fraction_train=0.5)
    for server_round in range(1, 9):
        sent = _configure(strategy, server_round, nodes=range(1, 11))
        strategy.aggregate_train(server_round, [_reply(n, float(n)) for n in sent])

    modes = {r["round"]: (r["mode"], r["group"]) for r in strategy.history}
    assert [modes[r] for r in (1, 2, 3)] == [("cold-start", "")] * 3
    assert {modes[r][0] for r in range(4, 9)} <= {"hybrid", "exploration"}
    cold = [r for r in strategy.history if r["round"] <= 3]
    assert len(cold) == 15 and all(math.isnan(r["smoothed-divergence"]) for r in cold)


def test_random_selection_never_uses_divergence():
    strategy = _strategy("random", cold_start_rounds=0, fraction_train=0.5)
    for server_round in range(1, 5):
        sent = _configure(strategy, server_round, nodes=range(1, 11))
        assert len(sent) == 5
        strategy.aggregate_train(server_round, [_reply(n, float(n)) for n in sent])
    assert {(r["mode"], r["group"]) for r in strategy.history} == {("random", "")}


def test_hybrid_round_ranks_reported_divergences_and_places_newcomers_in_the_middle():
    # Prepare: nodes 1..30 reported divergence = id, except 11..20 never heard from (mean)
    strategy = _strategy("hybrid", cold_start_rounds=0, exploration_rate=0.0, fraction_train=1 / 3)
    strategy.divergences = {n: [float(n)] for n in range(1, 31) if not 11 <= n <= 20}

    # Execute
    sent = _configure(strategy, 1, nodes=range(1, 31))

    # Assert: mean of 1..10 and 21..30 is 15.5, so 11..20 form the middle group
    rows = _rows(strategy, 1)
    assert len(sent) == 10 and set(rows) == set(sent)
    groups = {
        g: {n for n, r in rows.items() if r["group"] == g} for g in ("high", "middle", "low")
    }
    assert [len(groups[g]) for g in ("high", "middle", "low")] == [3, 5, 2]
    assert all(n >= 21 for n in groups["high"]) and all(n <= 10 for n in groups["low"])
    assert all(11 <= n <= 20 and rows[n]["smoothed-divergence"] == 15.5 for n in groups["middle"])
    assert all(rows[n]["smoothed-divergence"] == n for n in groups["high"] | groups["low"])
    assert {r["mode"] for r in rows.values()} == {"hybrid"}


def test_selection_is_reproducible_for_a_seed():
    def run(seed):
        strategy = _strategy("hybrid", seed=seed, cold_start_rounds=1, fraction_train=0.3)
        strategy.exploration_rate = 0.5
        for server_round in range(1, 7):
            sent = _configure(strategy, server_round, nodes=range(1, 21))
            strategy.aggregate_train(server_round, [_reply(n, n * 0.1) for n in sent])
        return [(r["round"], r["node-id"], r["mode"], r["group"]) for r in strategy.history]

    assert run(11) == run(11)
    assert any(run(seed) != run(11) for seed in (12, 13))


def test_exploration_rounds_happen_at_the_exploration_rate():
    # Prepare: one node per round, 2000 rounds after the cold start
    rate, rounds = 0.15, 2000
    strategy = _strategy("hybrid", cold_start_rounds=0, exploration_rate=rate, fraction_train=0.1)

    # Execute
    for server_round in range(1, rounds + 1):
        _configure(strategy, server_round, nodes=range(1, 11))

    # Assert: within 4 binomial standard deviations (0.008)
    explored = sum(r["mode"] == "exploration" for r in strategy.history) / rounds
    assert abs(explored - rate) < 4 * math.sqrt(rate * (1 - rate) / rounds)


def test_invalid_replies_are_skipped_marked_and_counted(caplog):
    # Prepare
    strategy = _strategy()
    _configure(strategy, 1, nodes=range(1, 10))
    replies = [
        _reply(1, 1.0, w=(1.0, 1.0), examples=1, **{"effective-mu": 0.12}),
        _reply(2, 3.0, w=(3.0, 5.0), examples=3, **{"effective-mu": 0.2}),
        error_from(3, "cuda oom"),
        _reply(4, 1.0, w=(np.nan, 0.0), **{"effective-mu": 0.1}),
        reply_from(
            5, {"w": [1.0, 1.0]}, {"num-examples": 1, "train-loss": 0.5, "effective-mu": 0.1}
        ),
        reply_from(6, {"w": [1.0, 1.0, 1.0]}, {"num-examples": 1, "divergence": 1.0}),
        _reply(7, 1.0, examples=0, **{"effective-mu": 0.1}),
        _reply(8, 1.0),  # no effective-mu: other metric keys than the rest
        # 9 does not reply
        _reply(99, 1.0, **{"effective-mu": 0.1}),  # not selected
    ]

    # Execute
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, replies)

    # Assert: the num-examples-weighted mean of nodes 1 and 2 only
    np.testing.assert_allclose(arrays["w"].numpy(), [2.5, 4.0])
    assert metrics["divergence"] == pytest.approx(0.25 * 1.0 + 0.75 * 3.0)
    assert metrics["effective-mu"] == pytest.approx(0.25 * 0.12 + 0.75 * 0.2)
    assert metrics["divergence-std"] == pytest.approx(1.0)
    assert metrics["failed-replies"] == 7
    rows = _rows(strategy, 1)
    assert [n for n, r in rows.items() if r["replied-ok"]] == [1, 2]
    assert (rows[2]["divergence"], rows[2]["effective-mu"], rows[2]["reason"]) == (3.0, 0.2, "")
    reasons = {n: rows[n]["reason"] for n in range(3, 10)}
    assert "cuda oom" in reasons[3] and "NaN" in reasons[4] and "'divergence'" in reasons[5]
    assert "shape" in reasons[6] and "num-examples" in reasons[7]
    assert "metric keys" in reasons[8] and reasons[9] == "no reply"
    assert strategy.faults == dict.fromkeys([3, 4, 5, 6, 7, 8, 9, 99], 1)
    assert strategy.divergences == {1: [1.0], 2: [3.0]}
    assert sum("faulty" in r.getMessage() for r in caplog.records) == 8


def test_no_valid_reply_returns_none_and_keeps_histories():
    strategy = _strategy()
    _configure(strategy, 1)
    strategy.aggregate_train(1, [_reply(1, 2.0), _reply(2, 2.0), _reply(3, 2.0)])
    _configure(strategy, 2)

    result = strategy.aggregate_train(2, [error_from(1), _reply(2, float("inf"))])

    assert result == (None, None)
    assert strategy.divergences == {1: [2.0], 2: [2.0], 3: [2.0]}
    assert [r["reason"] for r in _rows(strategy, 2).values()][2] == "no reply"
    assert strategy.aggregate_train(3, [_reply(1, 1.0)]) == (None, None)  # nothing configured


def test_integer_arrays_keep_their_dtype():
    # Prepare: a BatchNorm-like counter next to float weights
    strategy = _strategy()
    initial = ArrayRecord(
        {"w": Array(np.zeros(2, dtype=np.float32)), "n": Array(np.array([10], dtype=np.int64))}
    )
    strategy.configure_train(1, initial, ConfigRecord(), FakeGrid([1, 2]))

    def reply(node, w, count, examples):
        arrays = {"w": np.asarray(w, dtype=np.float32), "n": np.array([count], dtype=np.int64)}
        content = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        message = reply_from(node, None, {"num-examples": examples, "divergence": 1.0})
        message.content[keys.ARRAYS] = content
        return message

    # Execute
    arrays, _ = strategy.aggregate_train(1, [reply(1, [1, 2], 10, 1), reply(2, [3, 6], 11, 3)])

    # Assert: 0.25 * 10 + 0.75 * 11 = 10.75 -> 11
    assert arrays["n"].numpy().dtype == np.int64 and arrays["n"].numpy().tolist() == [11]
    assert arrays["w"].numpy().dtype == np.float32
    np.testing.assert_allclose(arrays["w"].numpy(), [2.5, 5.0])


def test_history_tables_and_counts():
    strategy = _strategy(fraction_train=0.5)
    for server_round in (1, 2):
        sent = _configure(strategy, server_round, nodes=range(1, 5))
        strategy.aggregate_train(server_round, [_reply(n, 1.0) for n in sent])

    assert strategy.tables() == {"selection.csv": strategy.history}
    assert all(tuple(row) == HISTORY_COLUMNS for row in strategy.history)
    assert len(strategy.history) == 4 and sum(strategy.selection_counts().values()) == 4
    counts = Counter(r["node-id"] for r in strategy.history)
    assert strategy.selection_counts() == dict(sorted(counts.items()))


def test_evaluation_is_sampled_with_the_runs_generator():
    def evaluate(seed):
        strategy = _strategy(seed=seed, fraction_evaluate=0.5)
        messages = strategy.configure_evaluate(
            2, record(INITIAL), ConfigRecord(), FakeGrid(range(1, 11))
        )
        return messages

    messages = evaluate(4)
    assert len(messages) == 5 and all(m.metadata.message_type == "evaluate" for m in messages)
    assert messages[0].content[keys.CONFIG][keys.SERVER_ROUND] == 2
    nodes = [m.metadata.dst_node_id for m in messages]
    assert nodes == [m.metadata.dst_node_id for m in evaluate(4)]


def test_too_few_nodes_stop_the_run():
    # Fewer than min-available after the timeout: the round goes on with those there;
    # fewer than the sample needs: the run ends.
    assert len(_configure(_strategy(min_available_nodes=5), 1, nodes=range(1, 4))) == 3
    strategy = _strategy(min_train_nodes=5)
    with pytest.raises(StopTraining, match=r"3 node\(s\) connected .* needs at least 5"):
        _configure(strategy, 1, nodes=range(1, 4))


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"selection": "greedy"}, "selection"),
        ({"exploration_rate": 1.5}, "exploration_rate"),
        ({"mu_min": 0.5, "mu_max": 0.1}, "mu_min"),
        ({"local_epochs": 0}, "local_epochs"),
        ({"ema_alpha": 0.0}, "ema_alpha"),
        ({"cold_start_rounds": -1}, "cold_start_rounds"),
    ],
)
def test_bad_settings_name_the_setting(overrides, name):
    with pytest.raises(ValueError, match=name):
        _strategy(**overrides)


def test_hybrid_selection_takes_flower_node_ids_beyond_int64():
    # Flower's node ids are unsigned 64-bit integers.
    nodes = [2**63 + i for i in range(10)]
    smoothed = {node: float(i) for i, node in enumerate(nodes)}

    groups = sample_hybrid_groups(nodes, smoothed, 5, np.random.default_rng(0))

    assert len(groups) == 5 and set(groups) <= set(nodes)
    assert sorted(groups.values()) == sorted(["high", "high", "middle", "middle", "middle"])
