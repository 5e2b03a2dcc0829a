"""FedAvg / FedProx / local on hand-built replies, against hand-computed results."""

from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

import strategies
from protocol import keys
from protocol.records import to_record
from server_app.config import PARTS, part_options
from strategies.runtime.aggregation import weighted_metrics
from tests.fakes import FakeGrid, reply_from

SETTINGS = strategies.StrategySettings(
    strategy="fedavg",
    fraction_train=1.0,
    fraction_evaluate=1.0,
    min_train_nodes=2,
    min_evaluate_nodes=2,
    min_available_nodes=2,
    seed=0,
    # The server optimizer's defaults (plain FedAvg), as config.load fills them in.
    options={**{o.key: o.default for p in PARTS for o in part_options(p)}, "fedprox.mu": 0.25},
)


def _build(name: str):
    return strategies.build("none", replace(SETTINGS, strategy=name))


def _reply(arrays: dict, metrics: dict, node_id: int = 1):
    return reply_from(node_id, arrays, metrics)


def test_fedavg_is_example_weighted_average():
    replies = [
        _reply({"w": [1.0, 2.0], "b": [0.0]}, {"num-examples": 10, "train-loss": 1.0}),
        _reply({"w": [3.0, 6.0], "b": [4.0]}, {"num-examples": 30, "train-loss": 3.0}),
    ]
    strategy = _build("fedavg")
    arrays, metrics = strategy.aggregate_train(1, replies)
    # Hand-computed: weights 10/40 and 30/40.
    np.testing.assert_allclose(arrays["w"].numpy(), [0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6])
    np.testing.assert_allclose(arrays["b"].numpy(), [3.0])
    assert metrics["train-loss"] == pytest.approx(0.25 * 1.0 + 0.75 * 3.0)


def test_fedprox_sends_mu_and_samples_by_fraction():
    strategy = _build("fedprox")
    messages = list(
        strategy.configure_train(3, ArrayRecord(), ConfigRecord(), FakeGrid(range(1, 5)))
    )
    assert len(messages) == 4
    config = messages[0].content[keys.CONFIG]
    assert config[keys.PROXIMAL_MU] == pytest.approx(0.25)
    assert config[keys.SERVER_ROUND] == 3


def test_local_strategy_flags_clients_and_averages_nothing():
    strategy = _build("local")
    grid = FakeGrid([11, 12])
    train = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    evaluate = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    assert all(m.content[keys.CONFIG][keys.LOCAL_ONLY] for m in train + evaluate)
    replies = [
        _reply({"w": [1.0]}, {"num-examples": 1, "train-loss": 2.0}),
        _reply({"w": [5.0]}, {"num-examples": 3, "train-loss": 4.0}),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None
    assert metrics["train-loss"] == pytest.approx(0.25 * 2.0 + 0.75 * 4.0)


def test_weighted_metrics_divide_each_key_by_the_weight_of_its_reporters():
    records = [
        MetricRecord({"num-examples": 1, "train-loss": 1.0, "divergence": 5.0}),
        MetricRecord({"num-examples": 3, "train-loss": 3.0, "norms": [1.0, 2.0]}),
        MetricRecord({"num-examples": 4, "norms": [3.0, 4.0]}),
    ]
    # train-loss: (1 + 9) / 4; divergence: only the first reports it (5 * 1 / 1);
    # norms: (3 [1, 2] + 4 [3, 4]) / 7. Flower's aggregate_metricrecords divides every
    # key by the weight of all 8 examples (divergence 0.625).
    assert dict(weighted_metrics(records)) == {
        "train-loss": 2.5,
        "divergence": 5.0,
        "norms": [pytest.approx(15 / 7), pytest.approx(22 / 7)],
    }
    zero = [
        MetricRecord({"num-examples": 0, "x": 1.0}),
        MetricRecord({"num-examples": 0, "x": 3.0}),
    ]
    assert dict(weighted_metrics(zero)) == {"x": 2.0}  # no weight: unweighted


def test_fedavg_keeps_the_global_models_dtypes_round_after_round():
    """Flower's FedAvg averages an int64 counter into float64; the seeded wrapper casts
    the aggregate back (rounded), so the next round's int64 replies are still valid."""
    one = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 1}
    strategy = strategies.build("none", replace(SETTINGS, strategy="fedavg", **one))
    current = ArrayRecord({"w": Array(np.zeros(2)), "count": Array(np.array(4, dtype=np.int64))})
    for server_round in (1, 2):
        list(strategy.configure_train(server_round, current, ConfigRecord(), FakeGrid([1, 2])))
        replies = [reply_from(n, None, {"num-examples": 10}) for n in (1, 2)]
        for n, (message, count) in enumerate(zip(replies, (5, 8), strict=True), start=1):
            message.content[keys.ARRAYS] = ArrayRecord(
                {"w": Array(np.full(2, float(n))), "count": Array(np.array(count, dtype=np.int64))}
            )
        current, _ = strategy.aggregate_train(server_round, replies)
        assert current is not None, f"round {server_round}: replies rejected"
        assert current["count"].dtype == "int64"
        assert int(current["count"].numpy()) == round((5 + 8) / 2)  # 6.5 rounds to 6


def test_fedavg_aggregate_is_bit_for_bit_flowers():
    """The seeded FedAvg aggregates from the arrays its screening decoded
    (strategies.runtime.aggregation.fedavg_arrays); the result is exactly Flower's
    aggregate_arrayrecords (then cast to the global model's dtypes)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    rng = np.random.default_rng(7)
    shapes = {"conv.weight": (4, 3, 3), "fc.bias": (10,), "count": ()}
    reference = ArrayRecord(
        {
            k: Array(np.zeros(s, dtype=np.int64 if k == "count" else np.float32))
            for k, s in shapes.items()
        }
    )
    replies = []
    for node in range(1, 8):
        arrays = {
            k: rng.integers(0, 50, s) if k == "count" else rng.normal(size=s).astype(np.float32)
            for k, s in shapes.items()
        }
        message = reply_from(node, None, {"num-examples": int(rng.integers(1, 400))})
        message.content[keys.ARRAYS] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        replies.append(message)
    # Weights and updates unbounded, as Flower's; the bounds are tested in
    # test_bounded_weights and test_robust_aggregation.
    options = {
        **SETTINGS.options,
        "aggregation.max-weight-share": 1.0,
        "aggregation.max-update-norm": 0.0,
    }
    strategy = strategies.build("none", replace(SETTINGS, options=options))
    list(strategy.configure_train(1, reference, ConfigRecord(), FakeGrid(range(1, 8))))

    arrays, _ = strategy.aggregate_train(1, replies)

    ordered = strategy.partitions.sort_replies(replies)
    flower = aggregate_arrayrecords([m.content for m in ordered], "num-examples")
    expected = to_record(reference, [flower[k].numpy() for k in reference])
    for key in reference:
        assert arrays[key].dtype == reference[key].dtype
        np.testing.assert_array_equal(arrays[key].numpy(), expected[key].numpy())
        assert arrays[key].numpy().tobytes() == expected[key].numpy().tobytes()


def test_a_strategy_with_its_own_aggregate_keeps_it():
    """Only Flower's own FedAvg aggregate is replaced by the decode-once one."""
    from flwr.serverapp.strategy import FedAvg

    from strategies.runtime.seeded import SeededSampling, _plain_fedavg

    class Median(FedAvg):
        def aggregate_train(self, server_round, replies):
            return ArrayRecord({"w": Array(np.array([42.0]))}), MetricRecord({})

    assert _plain_fedavg(FedAvg()) and not _plain_fedavg(Median())
    one = {"min_train_nodes": 1, "min_evaluate_nodes": 1, "min_available_nodes": 1}
    strategy = SeededSampling(
        Median(**one), fraction_train=1.0, fraction_evaluate=0.0, seed=0, timeout=5.0, **one
    )
    reference = ArrayRecord({"w": Array(np.zeros(1))})
    list(strategy.configure_train(1, reference, ConfigRecord(), FakeGrid([1])))
    arrays, _ = strategy.aggregate_train(1, [_reply({"w": [1.0]}, {"num-examples": 3})])
    assert arrays["w"].numpy().tolist() == [42.0]
