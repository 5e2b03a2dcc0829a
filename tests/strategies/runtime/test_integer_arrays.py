"""One rule for integer arrays (e.g. BatchNorm's ``num_batches_tracked``): they are not
released. Clipping returns them as zero deltas outside the norm, noise leaves them as
they are, and the DP wrappers keep the server's value for them whatever a client sends,
so the ε covers every array that is released and no client's step count leaves it."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from privacy.accounting import PrivacyLedger
from privacy.mechanisms import (
    LaplaceMechanism,
    add_noise,
    clip_by_l1_norm,
    clip_by_l2_norm,
    gaussian_noise_like,
    is_released,
)
from protocol import keys
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.laplace import LaplaceDP
from tests.fakes import FakeGrid


def test_clipping_zeroes_integer_deltas_and_leaves_them_out_of_the_norm():
    weights, counter = np.array([3.0, 4.0], dtype=np.float32), np.array(28, dtype=np.int64)
    clipped = clip_by_l2_norm([weights, counter], clip_norm=1.0)
    assert clipped.norm == pytest.approx(5.0)  # the counter's 28 is not in the norm
    np.testing.assert_allclose(clipped.arrays[0], [0.6, 0.8], rtol=1e-6)
    assert clipped.arrays[0].dtype == np.float32
    assert clipped.arrays[1].dtype == np.int64 and clipped.arrays[1] == 0
    l1 = clip_by_l1_norm([weights, counter], clip_norm=7.0)
    assert l1.norm == pytest.approx(7.0) and not l1.clipped and l1.arrays[1] == 0
    assert [is_released(a) for a in (weights, counter, np.array([True]))] == [
        True,
        False,
        False,
    ]


def test_noise_leaves_integer_arrays_as_they_are():
    rng = np.random.default_rng(0)
    arrays = [np.zeros(3), np.array([5], dtype=np.int64)]
    noised = add_noise(arrays, gaussian_noise_like(arrays, std=1.0, rng=rng))
    assert np.all(noised[0] != 0.0)
    assert noised[1].dtype == np.int64 and noised[1].tolist() == [5]
    laplace = LaplaceMechanism(sensitivity=1.0, epsilon=1.0)  # a client's clip, then noise
    out = laplace.noise(laplace.clip([np.ones(2), np.array([9])]).arrays, rng=rng)
    assert out[1].tolist() == [0] and np.all(out[0] != 1.0)


def _record(w, steps) -> ArrayRecord:
    return ArrayRecord(
        {
            "w": Array(np.asarray(w, dtype=np.float64)),
            "num_batches_tracked": Array(np.asarray(steps, dtype=np.int64)),
        }
    )


def _reply(node: int, arrays: ArrayRecord) -> Message:
    content = RecordDict({keys.ARRAYS: arrays, keys.METRICS: MetricRecord({"num-examples": 1})})
    sent = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    return Message(content, reply_to=sent)


def _train(strategy, clients_steps: int):
    messages = list(
        strategy.configure_train(1, _record([0.0, 0.0], 7), ConfigRecord(), FakeGrid(range(1, 4)))
    )
    replies = [
        _reply(m.metadata.dst_node_id, _record([0.1, 0.0], 7 + clients_steps)) for m in messages
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays


@pytest.mark.parametrize("site", ["server", "client"])
def test_dp_fedavg_keeps_the_servers_integer_arrays(site):
    strategy = DPFedAvgFixed(
        FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        num_sampled_clients=3,
        noise_site=site,
        ledger=PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="without-replacement"),
        rng=np.random.default_rng(0),
    )
    arrays = _train(strategy, clients_steps=28)
    assert arrays["num_batches_tracked"].numpy().tolist() == 7  # the server's value
    assert strategy.head.dim == 2  # d counts the released (floating) values only


def test_laplace_keeps_the_servers_integer_arrays():
    strategy = LaplaceDP(
        FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1),
        sensitivity=1.0,
        epsilon=1.0,
        ledger=PrivacyLedger(
            accountant="rdp",
            target_delta=1e-5,
            sampling="none",
            neighboring="zero-out",
            mechanisms=("laplace",),
        ),
        rng=np.random.default_rng(0),
    )
    arrays = _train(strategy, clients_steps=28)
    assert arrays["num_batches_tracked"].numpy().tolist() == 7
