"""privacy_mod: the client half of DP-FedAvg and Laplace."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict

from client_app.mods import privacy_mod
from strategies import keys
from tests.fakes import instruction, record

RECEIVED = {"w": [1.0, 1.0, 1.0], "b": [0.0]}


def _context(**run_config) -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 2, "num-partitions": 4},
        state=RecordDict(),
        run_config={"seed": 7, **run_config},
    )


def _trainer(trained: dict, metrics=None):
    """A call_next that 'trains' to ``trained`` and replies with it."""
    calls = []

    def call_next(msg: Message, ctxt: Context) -> Message:
        calls.append(msg)
        content = RecordDict(
            {
                keys.ARRAYS: record(trained),
                keys.METRICS: MetricRecord(metrics or {"num-examples": 10}),
            }
        )
        return Message(content, reply_to=msg)

    return call_next, calls


def _delta(reply: Message) -> np.ndarray:
    got = np.concatenate([reply.content[keys.ARRAYS][k].numpy() for k in ("w", "b")])
    return got - np.concatenate([RECEIVED["w"], RECEIVED["b"]])


def test_clips_delta_to_l2_bound_and_reports_bit():
    msg = instruction(
        RECEIVED, {keys.SERVER_ROUND: 1, keys.DP_CLIP_NORM: 1.0, keys.DP_ADAPTIVE: True}
    )
    call_next, _ = _trainer({"w": [4.0, 5.0, 1.0], "b": [0.0]})  # delta (3, 4, 0 | 0)
    reply = privacy_mod(msg, _context(), call_next)
    np.testing.assert_allclose(_delta(reply), [0.6, 0.8, 0.0, 0.0], atol=1e-12)
    assert reply.content[keys.METRICS][keys.DP_NORM_BIT] == 0.0
    small = privacy_mod(msg, _context(), _trainer({"w": [1.1, 1.0, 1.0], "b": [0.0]})[0])
    np.testing.assert_allclose(_delta(small), [0.1, 0.0, 0.0, 0.0], atol=1e-12)
    assert small.content[keys.METRICS][keys.DP_NORM_BIT] == 1.0


def test_client_noise_has_the_requested_std():
    std, samples = 0.3, []
    for rnd in range(1, 401):
        msg = instruction(
            RECEIVED, {keys.SERVER_ROUND: rnd, keys.DP_CLIP_NORM: 1.0, keys.DP_NOISE_STDDEV: std}
        )
        reply = privacy_mod(msg, _context(), _trainer(RECEIVED)[0])
        samples.extend(_delta(reply))
    assert np.std(samples) == pytest.approx(std, rel=0.03)
    assert abs(np.mean(samples)) < 4 * std / np.sqrt(len(samples))


def test_noise_is_reproducible_from_seed_round_and_partition():
    msg = instruction(
        RECEIVED, {keys.SERVER_ROUND: 3, keys.DP_CLIP_NORM: 1.0, keys.DP_NOISE_STDDEV: 1.0}
    )
    first = _delta(privacy_mod(msg, _context(), _trainer(RECEIVED)[0]))
    again = _delta(privacy_mod(msg, _context(), _trainer(RECEIVED)[0]))
    other = _delta(privacy_mod(msg, _context(seed=8), _trainer(RECEIVED)[0]))
    secure = _delta(privacy_mod(msg, _context(**{"dp.secure-rng": True}), _trainer(RECEIVED)[0]))
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other) and not np.allclose(first, secure)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_update_becomes_error_reply(bad):
    msg = instruction(RECEIVED, {keys.SERVER_ROUND: 1, keys.DP_CLIP_NORM: 1.0})
    reply = privacy_mod(msg, _context(), _trainer({"w": [bad, 1.0, 1.0], "b": [0.0]})[0])
    assert reply.has_error() and "rejected" in reply.error.reason


def test_laplace_clips_l1_and_adds_noise_of_scale():
    sensitivity, scale, samples = 2.0, 0.5, []
    for rnd in range(1, 301):
        msg = instruction(
            RECEIVED,
            {
                keys.SERVER_ROUND: rnd,
                keys.LAPLACE_SENSITIVITY: sensitivity,
                keys.LAPLACE_SCALE: scale,
            },
        )
        reply = privacy_mod(msg, _context(), _trainer(RECEIVED)[0])
        samples.extend(_delta(reply))
    assert np.mean(np.abs(samples)) == pytest.approx(scale, rel=0.05)  # E|Laplace(b)| = b
    # Clipping, with noise that is negligible: L1 of (30, 40, 0 | 0) is 70 -> 2.
    msg = instruction(
        RECEIVED, {keys.SERVER_ROUND: 1, keys.LAPLACE_SENSITIVITY: 2.0, keys.LAPLACE_SCALE: 1e-12}
    )
    reply = privacy_mod(msg, _context(), _trainer({"w": [31.0, 41.0, 1.0], "b": [0.0]})[0])
    np.testing.assert_allclose(_delta(reply), [2 * 30 / 70, 2 * 40 / 70, 0, 0], atol=1e-9)


def test_messages_without_privacy_keys_pass_through():
    msg = instruction(RECEIVED, {keys.SERVER_ROUND: 1})
    call_next, calls = _trainer({"w": [9.0, 9.0, 9.0], "b": [9.0]})
    reply = privacy_mod(msg, _context(), call_next)
    assert len(calls) == 1
    np.testing.assert_allclose(_delta(reply), [8.0, 8.0, 8.0, 9.0])
    evaluate = instruction(RECEIVED, {keys.DP_CLIP_NORM: 1.0}, kind="evaluate")
    assert not privacy_mod(evaluate, _context(), call_next).has_error()
