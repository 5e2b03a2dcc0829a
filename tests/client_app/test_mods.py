"""The client halves of DP-FedAvg and Laplace (their mods), and the ClientApp's
privacy_mod, which runs the mods the registry names for the run's mechanism."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict

from client_app.mods import privacy_mod
from protocol import keys
from strategies.mechanisms.base import report_metrics_mod
from strategies.mechanisms.dp_fedavg import dp_fedavg_mod
from strategies.mechanisms.laplace import laplace_mod
from tests.fakes import instruction, record

RECEIVED = {"w": [1.0, 1.0, 1.0], "b": [0.0]}


def _context(**run_config) -> Context:
    """A client's context; its noise derives from the seed (statistical tests must not
    be flaky) unless the test asks for the default, secret noise."""
    return Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 2, "num-partitions": 4},
        state=RecordDict(),
        run_config={"seed": 7, "dp.reproducible-noise": True, **run_config},
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
    reply = dp_fedavg_mod(msg, _context(), call_next)
    np.testing.assert_allclose(_delta(reply), [0.6, 0.8, 0.0, 0.0], atol=1e-12)
    assert reply.content[keys.METRICS][keys.DP_NORM_BIT] == 0.0
    small = dp_fedavg_mod(msg, _context(), _trainer({"w": [1.1, 1.0, 1.0], "b": [0.0]})[0])
    np.testing.assert_allclose(_delta(small), [0.1, 0.0, 0.0, 0.0], atol=1e-12)
    assert small.content[keys.METRICS][keys.DP_NORM_BIT] == 1.0


def test_client_noise_has_the_requested_std():
    std, samples = 0.3, []
    for rnd in range(1, 401):
        msg = instruction(
            RECEIVED, {keys.SERVER_ROUND: rnd, keys.DP_CLIP_NORM: 1.0, keys.DP_NOISE_STDDEV: std}
        )
        reply = dp_fedavg_mod(msg, _context(), _trainer(RECEIVED)[0])
        samples.extend(_delta(reply))
    assert np.std(samples) == pytest.approx(std, rel=0.03)
    assert abs(np.mean(samples)) < 4 * std / np.sqrt(len(samples))


def test_noise_is_secret_by_default_and_reproducible_only_on_request():
    msg = instruction(
        RECEIVED, {keys.SERVER_ROUND: 3, keys.DP_CLIP_NORM: 1.0, keys.DP_NOISE_STDDEV: 1.0}
    )

    def noise(**run_config):
        return _delta(dp_fedavg_mod(msg, _context(**run_config), _trainer(RECEIVED)[0]))

    # Default: the same client, seed, round and partition draw other noise every time.
    secret = {"dp.reproducible-noise": False}
    assert not np.allclose(noise(**secret), noise(**secret))
    # dp.reproducible-noise: a function of seed, round and partition.
    np.testing.assert_array_equal(noise(), noise())
    assert not np.allclose(noise(), noise(seed=8))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_update_becomes_error_reply_with_server_noise(bad):
    msg = instruction(RECEIVED, {keys.SERVER_ROUND: 1, keys.DP_CLIP_NORM: 1.0})
    reply = dp_fedavg_mod(msg, _context(), _trainer({"w": [bad, 1.0, 1.0], "b": [0.0]})[0])
    assert reply.has_error() and "rejected" in reply.error.reason


def _failing(msg: Message, ctxt: Context) -> Message:
    raise RuntimeError("loss diverged")


@pytest.mark.parametrize(
    "config",
    [
        {keys.DP_CLIP_NORM: 1.0, keys.DP_NOISE_STDDEV: 0.5, keys.REPORT_METRICS: []},
        {keys.LAPLACE_SENSITIVITY: 1.0, keys.LAPLACE_SCALE: 0.5, keys.REPORT_METRICS: []},
    ],
    ids=["gaussian", "laplace"],
)
@pytest.mark.parametrize("failure", ["nan", "raises"])
def test_a_client_that_noises_its_upload_hides_its_failure(config, failure):
    # Whether training failed can depend on the data: the server (which sees every
    # client-noised upload) gets the noised zero update, a reply like any other.
    trainer = _trainer({"w": [np.nan, 1.0, 1.0], "b": [0.0]})[0]
    call_next = trainer if failure == "nan" else _failing
    samples = []
    for rnd in range(1, 301):
        msg = instruction(RECEIVED, {keys.SERVER_ROUND: rnd, **config})
        mod = dp_fedavg_mod if keys.DP_CLIP_NORM in config else laplace_mod
        reply = mod(msg, _context(), call_next)
        assert not reply.has_error()
        assert dict(reply.content[keys.METRICS]) == {keys.NUM_EXAMPLES: 1}
        samples.extend(_delta(reply))
    expected = 0.5 if keys.DP_NOISE_STDDEV in config else np.sqrt(2) * 0.5  # Laplace: √2 b
    assert abs(np.mean(samples)) < 4 * expected / np.sqrt(len(samples))  # centred on zero
    assert np.std(samples) == pytest.approx(expected, rel=0.06)


def test_report_metrics_keeps_only_the_listed_keys():
    config = {keys.SERVER_ROUND: 1, keys.DP_CLIP_NORM: 1.0, keys.DP_ADAPTIVE: True}
    metrics = {"num-examples": 10, "train-loss": 0.3, "divergence": 2.0}
    msg = instruction(RECEIVED, {**config, keys.REPORT_METRICS: [keys.DP_NORM_BIT]})
    reply = dp_fedavg_mod(msg, _context(), _trainer(RECEIVED, metrics)[0])
    assert dict(reply.content[keys.METRICS]) == {keys.DP_NORM_BIT: 1.0, keys.NUM_EXAMPLES: 1}
    kept = [keys.NUM_EXAMPLES, "divergence"]  # e.g. DP-SGD under SmartFedProx
    msg = instruction(RECEIVED, {keys.SERVER_ROUND: 1, keys.REPORT_METRICS: kept})
    reply = report_metrics_mod(msg, _context(), _trainer(RECEIVED, metrics)[0])
    assert dict(reply.content[keys.METRICS]) == {"num-examples": 10, "divergence": 2.0}
    # Without the key (dp.client-metrics = true, or no privacy) everything is sent.
    reply = dp_fedavg_mod(
        instruction(RECEIVED, config), _context(), _trainer(RECEIVED, metrics)[0]
    )
    assert set(reply.content[keys.METRICS]) == {*metrics, keys.DP_NORM_BIT}


def test_report_metrics_applies_to_queries():
    msg = instruction(RECEIVED, {keys.REPORT_METRICS: ["edge-id"]}, kind="query.edge")
    metrics = {"edge-id": 1, "partition-id": 3, "num-examples": 90}
    reply = dp_fedavg_mod(msg, _context(), _trainer(RECEIVED, metrics)[0])
    assert dict(reply.content[keys.METRICS]) == {"edge-id": 1, "num-examples": 1}


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
        reply = laplace_mod(msg, _context(), _trainer(RECEIVED)[0])
        samples.extend(_delta(reply))
    assert np.mean(np.abs(samples)) == pytest.approx(scale, rel=0.05)  # E|Laplace(b)| = b
    # Clipping, with noise that is negligible: L1 of (30, 40, 0 | 0) is 70 -> 2.
    msg = instruction(
        RECEIVED, {keys.SERVER_ROUND: 1, keys.LAPLACE_SENSITIVITY: 2.0, keys.LAPLACE_SCALE: 1e-12}
    )
    reply = laplace_mod(msg, _context(), _trainer({"w": [31.0, 41.0, 1.0], "b": [0.0]})[0])
    np.testing.assert_allclose(_delta(reply), [2 * 30 / 70, 2 * 40 / 70, 0, 0], atol=1e-9)


def test_messages_without_privacy_keys_pass_through():
    msg = instruction(RECEIVED, {keys.SERVER_ROUND: 1})
    call_next, calls = _trainer({"w": [9.0, 9.0, 9.0], "b": [9.0]})
    reply = dp_fedavg_mod(msg, _context(), call_next)
    assert len(calls) == 1
    np.testing.assert_allclose(_delta(reply), [8.0, 8.0, 8.0, 9.0])
    evaluate = instruction(RECEIVED, {keys.DP_CLIP_NORM: 1.0}, kind="evaluate")
    assert not dp_fedavg_mod(evaluate, _context(), call_next).has_error()


def test_privacy_mod_runs_the_mods_of_the_runs_mechanism():
    config = {keys.SERVER_ROUND: 1, keys.LAPLACE_SENSITIVITY: 2.0, keys.LAPLACE_SCALE: 1e-12}
    trained = {"w": [31.0, 41.0, 1.0], "b": [0.0]}  # delta (30, 40, 0 | 0), L1 70 -> 2
    reply = privacy_mod(
        instruction(RECEIVED, config), _context(privacy="laplace"), _trainer(trained)[0]
    )
    np.testing.assert_allclose(_delta(reply), [2 * 30 / 70, 2 * 40 / 70, 0, 0], atol=1e-9)
    # DP-FedAvg's mod reads no Laplace key: the update goes through unclipped.
    plain = privacy_mod(
        instruction(RECEIVED, config), _context(privacy="dp-fedavg-fixed"), _trainer(trained)[0]
    )
    np.testing.assert_allclose(_delta(plain), [30.0, 40.0, 0.0, 0.0])
    none = privacy_mod(
        instruction(RECEIVED, config), _context(privacy="none"), _trainer(trained)[0]
    )
    np.testing.assert_allclose(_delta(none), [30.0, 40.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="privacy = 'gauss'; valid values: "):
        privacy_mod(instruction(RECEIVED, config), _context(privacy="gauss"), _trainer(trained)[0])
