"""Byzantine-robust aggregation (``aggregation.rule``): hand-computed aggregates of small
rounds, each equal to Flower's own strategy (FedMedian, FedTrimmedAvg, Krum, MultiKrum,
Bulyan) on the same replies, and the combinations refused at load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum

import strategies
from config.options import ConfigError
from server_app import config
from strategies.algorithms.server_optimizer import ServerOptimizer
from tests.fakes import FakeGrid, record, reply_from
from tests.inprocess import pyproject_defaults
from tests.strategies.runtime.test_aggregation import SETTINGS

ONE = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 1}
GLOBAL = {"w": [0.0, 0.0], "b": [0.0]}
# Five replies (node, w, b, num-examples, train-loss); node 5 is far from the others.
FIVE = [
    (1, [1.0, 10.0], [0.0], 10, 1.0),
    (2, [2.0, 20.0], [1.0], 10, 2.0),
    (3, [3.0, 31.0], [2.0], 20, 3.0),
    (4, [4.0, 40.0], [3.0], 20, 4.0),
    (5, [100.0, -100.0], [50.0], 40, 9.0),
]


def _replies(rows):
    return [
        reply_from(node, {"w": w, "b": b}, {"num-examples": n, "train-loss": loss})
        for node, w, b, n, loss in rows
    ]


def _round(rule, rows, **options):
    settings = {**SETTINGS.options, "aggregation.rule": rule}
    settings |= {f"aggregation.{k.replace('_', '-')}": v for k, v in options.items()}
    strategy = strategies.build("none", replace(SETTINGS, options=settings, **ONE))
    nodes = [row[0] for row in rows]
    list(strategy.configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid(nodes)))
    arrays, metrics = strategy.aggregate_train(1, _replies(rows))
    return strategy, arrays, metrics


def _flower(strategy, rows):
    arrays, metrics = strategy.aggregate_train(1, _replies(rows))
    return arrays, metrics


def _assert_same(ours, flowers):
    for key in GLOBAL:
        np.testing.assert_allclose(ours[key].numpy(), flowers[key].numpy(), rtol=1e-15)


def test_median_is_coordinate_wise_and_equals_fedmedian():
    _, arrays, metrics = _round("median", FIVE)
    # w0: median(1, 2, 3, 4, 100) = 3; w1: median(10, 20, 31, 40, -100) = 20;
    # b: median(0, 1, 2, 3, 50) = 2.
    assert arrays["w"].numpy().tolist() == [3.0, 20.0]
    assert arrays["b"].numpy().tolist() == [2.0]
    # Every reply entered the median: the metrics of all five, example-weighted.
    assert metrics["train-loss"] == pytest.approx((10 + 20 + 60 + 80 + 360) / 100)
    _assert_same(arrays, _flower(FedMedian(**ONE), FIVE)[0])


def test_trimmed_mean_cuts_each_end_and_equals_fedtrimmedavg():
    _, arrays, _ = _round("trimmed-mean", FIVE, trim_fraction=0.2)
    # int(0.2 * 5) = 1 cut at each end: w0 (2 + 3 + 4) / 3, w1 (10 + 20 + 31) / 3,
    # b (1 + 2 + 3) / 3.
    np.testing.assert_allclose(arrays["w"].numpy(), [3.0, 61 / 3])
    np.testing.assert_allclose(arrays["b"].numpy(), [2.0])
    _assert_same(arrays, _flower(FedTrimmedAvg(beta=0.2, **ONE), FIVE)[0])


# Squared distances (w0, w1, b): d12 = 102, d13 = 449, d14 = 918, d23 = 123, d24 = 408,
# d34 = 83, node 5 >= 15 000 from all. Krum with f = 1 scores each reply by its n - f - 2
# = 2 nearest: s1 = 102 + 449 = 551, s2 = 102 + 123 = 225, s3 = 83 + 123 = 206,
# s4 = 83 + 408 = 491, s5 > 30 000.


def test_krum_takes_the_best_scored_reply_and_equals_flowers_krum():
    strategy, arrays, metrics = _round("krum", FIVE, num_byzantine=1)
    assert arrays["w"].numpy().tolist() == [3.0, 31.0]  # node 3, s3 = 206
    assert arrays["b"].numpy().tolist() == [2.0]
    assert metrics["train-loss"] == 3.0  # the selected reply's metrics only
    notes = strategy.partitions.take_notes()
    assert notes[3] == ""
    assert all(notes[n].startswith("not aggregated: not selected by krum") for n in (1, 2, 4, 5))
    _assert_same(arrays, _flower(Krum(num_malicious_nodes=1, **ONE), FIVE)[0])


def test_multi_krum_averages_the_selected_by_their_weights_and_equals_multikrum():
    strategy, arrays, metrics = _round("multi-krum", FIVE, num_byzantine=1)
    # num-selected 0: n - f = 4 replies (nodes 3, 2, 4, 1), weighted 10, 10, 20, 20.
    np.testing.assert_allclose(
        arrays["w"].numpy(), [(10 + 20 + 60 + 80) / 60, (100 + 200 + 620 + 800) / 60]
    )
    np.testing.assert_allclose(arrays["b"].numpy(), [(0 + 10 + 40 + 60) / 60])
    assert metrics["train-loss"] == pytest.approx((10 + 20 + 60 + 80) / 60)
    notes = strategy.partitions.take_notes()
    assert notes[5].startswith("not aggregated: not selected by multi-krum")
    assert [notes[n] for n in (1, 2, 3, 4)] == [""] * 4
    flower = MultiKrum(num_malicious_nodes=1, num_nodes_to_select=4, **ONE)
    _assert_same(arrays, _flower(flower, FIVE)[0])
    _, two, _ = _round("multi-krum", FIVE, num_byzantine=1, num_selected=2)
    np.testing.assert_allclose(two["w"].numpy(), [(20 + 60) / 30, (200 + 620) / 30])  # 2, 3


# Seven one-coordinate replies: 1, 2, 3, 4, 5, 6.5 and an outlier 100, equal weights.
SEVEN = [(n, [v, 0.0], [0.0], 10, 1.0) for n, v in enumerate([1, 2, 3, 4, 5, 6.5, 100], 1)]


def test_bulyan_and_equals_flowers_bulyan():
    strategy, arrays, _ = _round("bulyan", SEVEN, num_byzantine=1)
    # f = 1: Krum scores by the 4 nearest (squared): 1: 30, 2: 15, 3: 10, 4: 12.25,
    # 5: 16.25, 6.5: 41, 100: huge; theta = n - 2f = 5 selected: 3, 4, 2, 5, 1. Their
    # median is 3; the beta = n - 4f = 3 values nearest it (3, 2, 4) average to 3.
    assert arrays["w"].numpy().tolist() == [3.0, 0.0]
    notes = strategy.partitions.take_notes()
    assert sorted(n for n, why in notes.items() if why) == [6, 7]
    _assert_same(arrays, _flower(Bulyan(num_malicious_nodes=1, **ONE), SEVEN)[0])


def test_bulyan_with_too_few_replies_keeps_the_model_and_says_why():
    strategy, arrays, metrics = _round("bulyan", FIVE, num_byzantine=1)
    assert arrays is None and metrics is None
    notes = strategy.partitions.take_notes()
    assert all("4f + 3 = 7" in notes[n] for n in range(1, 6))


def test_mean_is_the_weighted_mean():
    # The update-norm bound off: Flower's FedAvg exactly (the bound: the next test).
    _, arrays, _ = _round("mean", FIVE, max_update_norm=0.0)
    w = np.array([10, 10, 20, 20, 40]) / 100
    np.testing.assert_allclose(
        arrays["w"].numpy(), w @ [[1, 10], [2, 20], [3, 31], [4, 40], [100, -100]]
    )


def test_the_mean_bounds_an_outlying_update_to_twice_the_median_norm():
    # Update norms (global 0): sqrt(101), sqrt(405), sqrt(974), sqrt(1625), 150; the
    # bound is 2 sqrt(974). Node 5's update is scaled by f = 2 sqrt(974) / 150 and its
    # weight 40 lowered to the median 20: w = ([170, 1720] + 20 f [100, -100]) / 80.
    strategy, arrays, _ = _round("mean", FIVE)
    third = np.sqrt(974) / 3  # 25 f
    np.testing.assert_allclose(arrays["w"].numpy(), [2.125 + third, 21.5 - third], rtol=1e-6)
    np.testing.assert_allclose(arrays["b"].numpy(), [1.375 + np.sqrt(974) / 6], rtol=1e-6)
    notes = strategy.partitions.take_notes()
    assert notes[5] == (
        "update clipped: norm 150 above 62.42 ('aggregation.max-update-norm' = 2 times "
        "the round's median), weight 40 to the median 20"
    )
    assert all(notes[n] == "" for n in range(1, 5))


def test_a_robust_rule_composes_with_fedprox_and_the_server_optimizer():
    options = {
        **SETTINGS.options,
        "aggregation.rule": "median",
        "server.optimizer": "momentum",
        "server.lr": 1.0,
        "server.momentum": 0.0,
    }
    strategy = strategies.build(
        "none", replace(SETTINGS, strategy="fedprox", options=options, **ONE)
    )
    assert isinstance(strategy, ServerOptimizer)
    list(strategy.configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid(range(1, 6))))
    arrays, _ = strategy.aggregate_train(1, _replies(FIVE))
    # lr 1 without momentum: the global model moves to the median itself.
    np.testing.assert_allclose(arrays["w"].numpy(), [3.0, 20.0])


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"privacy": "dp-fedavg-fixed", "dp.noise-multiplier": 1.0}, "sensitivity"),
        ({"secagg.enabled": True}, "only the sum"),
        ({"strategy": "clustered"}, "its own structure"),
        ({"strategy": "hierarchical"}, "its own structure"),
    ],
)
def test_a_robust_rule_is_refused_where_it_has_no_meaning(overrides, reason):
    run_config = {**pyproject_defaults(), "aggregation.rule": "median", **overrides}
    with pytest.raises(ConfigError, match=r"aggregation\.rule") as err:
        config.load(run_config)
    assert reason in str(err.value)
    config.load({**run_config, "aggregation.rule": "mean"})  # the mean runs with all of them


def test_an_unknown_rule_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"aggregation\.rule.*'median'"):
        config.load({**pyproject_defaults(), "aggregation.rule": "geomedian"})
