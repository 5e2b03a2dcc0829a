"""Server optimizers: one hand-computed round each, and the same arrays as Flower's own
FedAvgM / FedAdam / FedYogi / FedAdagrad given the same replies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi

from privacy.accounting import PrivacyLedger
from strategies.algorithms.server_optimizer import ServerOptimizer, ServerOptimizerSettings
from tests.fakes import FakeGrid, record, reply_from

GLOBAL = {"w": [1.0, -1.0], "b": [0.5]}
# Two clients, weighted 1 and 3: the FedAvg aggregate is GLOBAL + (0.25, -0.5 | 1.0).
REPLIES = [
    ({"w": [2.0, -1.0], "b": [0.5]}, 1),
    ({"w": [1.0, -1 - 2 / 3], "b": [0.5 + 4 / 3]}, 3),
]
DELTA = np.array([0.25, -0.5, 1.0])


def _settings(name, lr=0.1, momentum=0.9, beta1=0.9, beta2=0.99, tau=1e-3):
    return ServerOptimizerSettings(name, lr, momentum, beta1, beta2, tau)


def _round(strategy, server_round, current):
    messages = list(
        strategy.configure_train(server_round, record(current), ConfigRecord(), FakeGrid([1, 2]))
    )
    replies = [
        reply_from(m.metadata.dst_node_id, arrays, {"num-examples": weight})
        for m, (arrays, weight) in zip(messages, REPLIES, strict=True)
    ]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return {k: arrays[k].numpy() for k in arrays}


def _flat(arrays):
    return np.concatenate([np.asarray(arrays["w"]).ravel(), np.asarray(arrays["b"]).ravel()])


def _ours(name, **kw):
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    return ServerOptimizer(base, _settings(name, **kw))


def test_sgd_and_momentum_by_hand():
    x = _flat(GLOBAL)
    got = _flat(_round(_ours("sgd", lr=0.5), 1, GLOBAL))
    np.testing.assert_allclose(got, x + 0.5 * DELTA, rtol=1e-6)
    # FedAvgM: momentum buffer v = Δ then 0.9 v + Δ (no dampening); x -= lr * (-v).
    strategy = _ours("momentum", lr=0.5, momentum=0.9)
    first = _round(strategy, 1, GLOBAL)
    np.testing.assert_allclose(_flat(first), x + 0.5 * DELTA, rtol=1e-6)
    second = _round(strategy, 2, GLOBAL)  # the same replies, from the same point
    np.testing.assert_allclose(_flat(second), x + 0.5 * (0.9 * DELTA + DELTA), rtol=1e-6)


def test_adam_by_hand():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    got = _flat(_round(_ours("adam", lr=lr, beta1=b1, beta2=b2, tau=tau), 1, GLOBAL))
    m = (1 - b1) * DELTA
    v = (1 - b2) * DELTA**2
    eta = lr * math.sqrt(1 - b2**2) / (1 - b1**2)  # Flower's bias correction at round 1
    np.testing.assert_allclose(got, _flat(GLOBAL) + eta * m / (np.sqrt(v) + tau), rtol=1e-5)


def test_yogi_and_adagrad_by_hand():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    m = (1 - b1) * DELTA
    got = _flat(_round(_ours("yogi", lr=lr, beta1=b1, beta2=b2, tau=tau), 1, GLOBAL))
    v = -(1 - b2) * DELTA**2 * np.sign(0 - DELTA**2)  # v_0 = 0
    np.testing.assert_allclose(got, _flat(GLOBAL) + lr * m / (np.sqrt(v) + tau), rtol=1e-5)
    got = _flat(_round(_ours("adagrad", lr=lr, tau=tau), 1, GLOBAL))
    v = DELTA**2  # FedAdagrad keeps no first moment: m = Δ
    np.testing.assert_allclose(got, _flat(GLOBAL) + lr * DELTA / (np.sqrt(v) + tau), rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "flower"),
    [
        ("sgd", lambda s: FedAvgM(server_learning_rate=s.lr)),
        ("momentum", lambda s: FedAvgM(server_learning_rate=s.lr, server_momentum=s.momentum)),
        ("adam", lambda s: FedAdam(eta=s.lr, beta_1=s.beta1, beta_2=s.beta2, tau=s.tau)),
        ("yogi", lambda s: FedYogi(eta=s.lr, beta_1=s.beta1, beta_2=s.beta2, tau=s.tau)),
        ("adagrad", lambda s: FedAdagrad(eta=s.lr, tau=s.tau)),
    ],
)
def test_equal_to_flowers_strategy_over_three_rounds(name, flower):
    settings = _settings(name, lr=0.3)
    ours, theirs = _ours(name, lr=0.3), flower(settings)
    theirs.min_available_nodes = theirs.min_train_nodes = 1
    current_ours = current_theirs = GLOBAL
    for rnd in range(1, 4):
        current_ours = _round(ours, rnd, current_ours)
        current_theirs = _round(theirs, rnd, current_theirs)
        for key in GLOBAL:
            np.testing.assert_allclose(current_ours[key], current_theirs[key], rtol=1e-6)


def _flowers_fedavgm_step(rule, current, aggregate):
    """FedAvgM's own aggregate_train given ``aggregate`` as one reply of weight 1 (what
    the optimizer called before it wrote the update out)."""
    rule.current_arrays = current
    sent = Message(RecordDict(), dst_node_id=0, message_type="train")
    content = RecordDict({"arrays": aggregate, "metrics": MetricRecord({"num-examples": 1})})
    moved, _ = rule.aggregate_train(1, [Message(content, reply_to=sent)])
    return [moved[k].numpy() for k in moved]


@pytest.mark.parametrize(
    ("name", "lr", "momentum", "cooldown"),
    [("sgd", 1.0, 0.9, 0.0), ("sgd", 0.7, 0.9, 0.0), ("momentum", 0.3, 0.9, 0.0),
     ("momentum", 1.0, 0.5, 0.5)],
)  # fmt: skip
def test_fedavgm_update_is_bit_identical_to_flowers_over_rounds(name, lr, momentum, cooldown):
    settings = ServerOptimizerSettings(name, lr, momentum, 0.9, 0.99, 1e-3, cooldown)
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    ours, theirs = ServerOptimizer(base, settings, 6), settings.rule()
    rng = np.random.default_rng(3)
    shapes = {"w": (5, 4), "b": (4,), "steps": ()}
    current = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    current["steps"] = np.array(7, dtype=np.int64)  # a counter: keeps the aggregate's
    for server_round in range(1, 7):
        averaged = {k: (v + rng.normal(size=v.shape)).astype(v.dtype) for k, v in current.items()}
        current_record = ArrayRecord({k: Array(np.asarray(v)) for k, v in current.items()})
        aggregate = ArrayRecord({k: Array(np.asarray(v)) for k, v in averaged.items()})
        got = ours.step(server_round, current_record, aggregate)
        theirs.server_learning_rate = settings.lr_at(server_round, 6)
        theirs.server_opt = theirs.server_opt or bool(cooldown)
        want = _flowers_fedavgm_step(theirs, current_record, aggregate)
        for key, flower_value in zip(shapes, want, strict=True):
            value = got[key].numpy()
            if key == "steps":
                assert value.dtype == np.int64 and value == averaged[key]
            else:
                assert (
                    value.dtype == flower_value.dtype and value.tobytes() == flower_value.tobytes()
                )
        state, flowers_state = ours.rule.momentum_vector, theirs.momentum_vector
        assert (state is None) == (flowers_state is None)
        for mine, flowers in zip(state or [], flowers_state or [], strict=True):
            assert mine.dtype == flowers.dtype and mine.tobytes() == flowers.tobytes()
        current = {k: got[k].numpy() for k in got}


def test_state_survives_a_checkpoint():
    strategy = _ours("adam")
    _round(strategy, 1, GLOBAL)
    state = strategy.rule_state
    restored = _ours("adam")
    restored.rule_state = state
    np.testing.assert_array_equal(
        _flat(_round(restored, 2, GLOBAL)), _flat(_round(strategy, 2, GLOBAL))
    )
    with pytest.raises(ValueError, match="unexpected server optimizer state"):
        restored.rule_state = {"momentum_vector": None}


def test_the_wrapped_strategys_attributes_are_read_through_and_the_ledger_says_so():
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    base.ledger = PrivacyLedger(accountant="pld", target_delta=1e-5, sampling="poisson")
    strategy = ServerOptimizer(base, _settings("adam"))
    assert strategy.ledger is base.ledger and strategy.strategy is base
    assert not hasattr(strategy, "on_resume")
    statements = base.ledger.summary()["statements"]
    assert any("Post-processing, no privacy cost: server optimizer adam" in s for s in statements)


def test_cooldown_decays_the_learning_rate_linearly_over_the_last_rounds():
    settings = ServerOptimizerSettings("sgd", 1.0, 0.9, 0.9, 0.99, 1e-3, 0.5)
    # 4 rounds, the last half cooled: (4 - t + 1) / 2 capped at 1.
    assert [settings.lr_at(t, 4) for t in (1, 2, 3, 4)] == [1.0, 1.0, 1.0, 0.5]
    x = _flat(GLOBAL)
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    sgd = ServerOptimizer(base, settings, 4)
    got = [_flat(_round(sgd, t, GLOBAL)) for t in (1, 2, 3, 4)]
    np.testing.assert_allclose(got[2], x + DELTA, rtol=1e-6)  # lr 1: the aggregate
    np.testing.assert_allclose(got[3], x + 0.5 * DELTA, rtol=1e-6)  # FedAvgM applies 0.5
    momentum = ServerOptimizerSettings("momentum", 0.5, 0.9, 0.9, 0.99, 1e-3, 0.5)
    strategy = ServerOptimizer(
        FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1), momentum, 4
    )
    got = [_flat(_round(strategy, t, GLOBAL)) for t in (1, 2, 3, 4)]
    # v = Δ, 1.9Δ, 2.71Δ, 3.439Δ; round 4's lr is 0.5 * 0.5.
    np.testing.assert_allclose(got[2], x + 0.5 * 2.71 * DELTA, rtol=1e-6)
    np.testing.assert_allclose(got[3], x + 0.25 * 3.439 * DELTA, rtol=1e-6)
    with pytest.raises(ValueError, match=r"'server\.cooldown' needs the run's number of rounds"):
        ServerOptimizer(base, settings)
