"""The Laplace wrapper (the PPO study): unweighted mean of noisy deltas over the clients
asked (a failed one: a zero delta with server-drawn noise), one charge per round, the
per-client view against the server, and hand-over of the checked uploads to a strategy
that aggregates them itself."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

from privacy.accounting import PrivacyLedger
from protocol import keys
from strategies.mechanisms.laplace import LaplaceDP
from tests.fakes import FakeGrid, error_from, record, reply_from


def _ledger():
    return PrivacyLedger(
        accountant="rdp",
        target_delta=1e-5,
        sampling="none",
        neighboring="zero-out",
        mechanisms=("laplace",),
    )


def _wrapper(base, *, seed=0):
    return LaplaceDP(
        base,
        sensitivity=15.0,
        epsilon=10.0,
        ledger=_ledger(),
        rng=np.random.default_rng(seed),
    )


def _configure(strategy, nodes=(1, 2, 3)):
    return strategy.configure_train(1, record({"w": [1.0, 2.0]}), ConfigRecord(), FakeGrid(nodes))


def test_sends_clip_and_scale_and_averages_deltas_unweighted():
    strategy = _wrapper(FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1))
    messages = list(_configure(strategy))
    assert len(messages) == 3
    for message in messages:
        config = message.content[keys.CONFIG]
        assert config[keys.LAPLACE_SENSITIVITY] == 15.0 and config[keys.LAPLACE_SCALE] == 1.5
    assert all(m.content[keys.CONFIG][keys.REPORT_METRICS] == [] for m in messages)
    replies = [
        reply_from(1, {"w": [2.0, 2.0]}, {"num-examples": 10}),
        reply_from(2, {"w": [1.0, 5.0]}, {"num-examples": 1000}),
        reply_from(3, {"w": [4.0, 0.0]}, {"num-examples": 10}),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    # deltas (1, 0), (0, 3), (3, -2): their unweighted mean (4/3, 1/3) added to (1, 2)
    np.testing.assert_allclose(arrays["w"].numpy(), [1 + 4 / 3, 2 + 1 / 3])
    assert len(strategy.ledger.releases) == 1
    assert strategy.ledger.basic_composition_epsilon() == pytest.approx(10.0)
    assert metrics["dp-epsilon"] == pytest.approx(strategy.ledger.epsilon()) == 10.0
    # Against the server: each client's own upload, epsilon 10 per round it was asked.
    assert metrics[keys.DP_EPSILON_LOCAL] == 10.0
    assert strategy.local_view.participations("node-2") == 1


def test_a_failed_client_is_a_zero_delta_with_the_noise_it_would_have_sent():
    # Client 3's failure (NaN, no reply) must not show in the released mean's noise:
    # the server draws its Laplace(b) and divides by the 3 clients asked.
    strategy = _wrapper(FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1))
    samples = []
    for _ in range(300):
        list(_configure(strategy))
        replies = [
            reply_from(1, {"w": [1.0, 2.0]}, {"num-examples": 1}),
            reply_from(2, {"w": [1.0, 2.0]}, {"num-examples": 1}),
            reply_from(3, {"w": [np.nan, 0.0]}, {"num-examples": 1}),
        ]
        arrays, metrics = strategy.aggregate_train(1, replies)
        samples.extend(arrays["w"].numpy() - [1.0, 2.0])
    assert metrics[keys.DP_FAILED_CLIENTS] == 1.0
    assert len(strategy.ledger.releases) == 300
    # Laplace(b = 1.5) / 3: std sqrt(2) * 1.5 / 3
    assert np.std(samples) == pytest.approx(np.sqrt(2) * 1.5 / 3, rel=0.06)
    assert abs(np.mean(samples)) < 4 * np.sqrt(2) * 1.5 / 3 / np.sqrt(len(samples))


class _UploadAggregator(FedAvg):
    """A base strategy that aggregates the uploads itself (as clustered FedAvg does)."""

    AGGREGATES_UPLOADS = True

    def __init__(self):
        super().__init__(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
        self.seen = None

    def aggregate_train(self, server_round, replies):
        self.seen = [m.metadata.src_node_id for m in replies]
        return record({"w": [7.0, 7.0]}), MetricRecord({"x": 1.0})


def test_hands_only_valid_uploads_to_an_aggregating_strategy_and_charges_once():
    base = _UploadAggregator()
    strategy = _wrapper(base)
    list(_configure(strategy))
    replies = [
        reply_from(3, {"w": [1.0, 1.0]}, {"num-examples": 1}),
        error_from(2),
        reply_from(1, {"w": [1.0, 1.0, 1.0]}, {"num-examples": 1}),  # wrong shape
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert base.seen == [3]
    np.testing.assert_allclose(arrays["w"].numpy(), [7.0, 7.0])
    assert metrics["x"] == 1.0 and metrics["dp-epsilon"] == pytest.approx(
        strategy.ledger.epsilon()
    )
    assert len(strategy.ledger.releases) == 1


def test_round_without_valid_upload_is_charged_all_the_same():
    strategy = _wrapper(_UploadAggregator())
    list(_configure(strategy))
    strategy.aggregate_train(1, [error_from(1)])
    assert len(strategy.ledger.releases) == 1
