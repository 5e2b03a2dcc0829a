"""Clustered FedAvg under DP-FedAvg: K private means against hand-computed values, noise
on every model (an empty cluster's too), and one Gaussian release per round, charged
exactly as DP-FedAvg's one model."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from privacy.accounting import PrivacyLedger
from protocol import keys
from strategies.algorithms.clustered import ClusteredFedAvg
from strategies.mechanisms.clustered_dp import ClusteredDPFedAvgAdaptive, ClusteredDPFedAvgFixed
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from tests.fakes import FakeGrid, error_from, record, reply_from

# Three models; nodes 1-2 last uploaded near model 0, nodes 3-4 near model 1, none near 2.
MODELS = [{"w": [0.0, 0.0]}, {"w": [10.0, 10.0]}, {"w": [-10.0, 5.0]}]
LAST_UPLOADS = {1: [0.1, 0.0], 2: [0.0, 0.2], 3: [10.0, 9.9], 4: [9.9, 10.0]}
NODES = range(1, 5)


def _inner(assign="l2") -> ClusteredFedAvg:
    inner = ClusteredFedAvg(
        k=3,
        assign=assign,
        fraction_train=1.0,
        fraction_evaluate=1.0,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=1,
        seed=1,
        query_timeout=0.0,
    )
    inner.models = [record(m) for m in MODELS]
    inner.book.uploads = {n: np.asarray(u) for n, u in LAST_UPLOADS.items()}
    return inner


def _wrapper(
    cls=ClusteredDPFedAvgFixed, *, z=1e-12, clip=1.0, sampling="without-replacement", **kw
):
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling=sampling)
    return cls(
        _inner(),
        clip_norm=clip,
        noise_multiplier=z,
        num_sampled_clients=4,
        noise_site="server",
        ledger=ledger,
        rng=np.random.default_rng(5),
        **kw,
    )


def _round(strategy, deltas, server_round=1, fail=()):
    """Configure, reply with the assigned model + deltas[node], aggregate."""
    messages = strategy.configure_train(
        server_round, record(MODELS[0]), ConfigRecord({}), FakeGrid(NODES)
    )
    replies = []
    for message in messages:
        node = message.metadata.dst_node_id
        if node in fail:
            replies.append(error_from(node))
            continue
        sent = message.content[keys.ARRAYS]["w"].numpy()
        replies.append(reply_from(node, {"w": sent + deltas[node]}, {"num-examples": 7}))
    return messages, strategy.aggregate_train(server_round, replies)


def test_each_model_moves_by_its_clusters_clipped_sum_over_m():
    strategy = _wrapper(clip=1.0)
    deltas = {1: [3.0, 4.0], 2: [0.2, 0.0], 3: [0.0, -0.5], 4: [0.0, 0.1]}
    messages, (arrays, metrics) = _round(strategy, deltas)
    assigned = {m.metadata.dst_node_id: m.content[keys.CONFIG][keys.CLUSTER_ID] for m in messages}
    assert assigned == {1: 0, 2: 0, 3: 1, 4: 1}
    models = [m["w"].numpy() for m in strategy.strategy.models]
    # Cluster 0: (0.6, 0.8) clipped + (0.2, 0) = (0.8, 0.8), over m = 4.
    np.testing.assert_allclose(models[0], [0.2, 0.2], atol=1e-9)
    # Cluster 1: (0, -0.5) + (0, 0.1) = (0, -0.4), over 4.
    np.testing.assert_allclose(models[1], [10.0, 9.9], atol=1e-9)
    np.testing.assert_allclose(models[2], [-10.0, 5.0], atol=1e-9)  # empty: noise only
    np.testing.assert_allclose(arrays["w"].numpy(), models[0])  # model 0 is "the" model
    assert metrics["cluster-0-size"] == 2 and metrics["cluster-2-size"] == 0
    assert not strategy.releases_metric("cluster-0-size")  # sizes stay with the curator
    assert strategy.strategy.book.clusters == {1: 0, 2: 0, 3: 1, 4: 1}
    assert [r["cluster"] for r in strategy.strategy.history] == [0, 0, 1, 1]


def test_a_failed_client_is_a_zero_update_of_its_cluster():
    strategy = _wrapper()
    deltas = {1: [0.4, 0.0], 2: [0.4, 0.0], 3: [0.0, 0.8], 4: [0.0, 0.8]}
    _, (_, metrics) = _round(strategy, deltas, fail=(2, 3))
    models = [m["w"].numpy() for m in strategy.strategy.models]
    np.testing.assert_allclose(models[0], [0.1, 0.0], atol=1e-9)  # 0.4 / 4
    np.testing.assert_allclose(models[1], [10.0, 10.2], atol=1e-9)  # 0.8 / 4
    assert metrics[keys.DP_FAILED_CLIENTS] == 2


def test_every_model_gets_noise_of_std_zC_over_m_empty_ones_included():
    z, clip = 0.8, 0.5
    moves = {0: [], 2: []}
    for seed in range(300):
        strategy = _wrapper(z=z, clip=clip)
        strategy.rng = np.random.default_rng(seed)
        _round(strategy, {node: [0.0, 0.0] for node in NODES})
        for k in moves:
            moves[k].extend(strategy.strategy.models[k]["w"].numpy() - MODELS[k]["w"])
    for k, values in moves.items():
        assert np.std(values) == pytest.approx(z * clip / 4, rel=0.07), k


@pytest.mark.parametrize("sampling", ["without-replacement", "poisson"])
def test_the_round_is_charged_as_dp_fedavgs_one_model(sampling):
    clustered = _wrapper(z=1.3, sampling=sampling)
    for rnd in (1, 2, 3):
        _round(clustered, {node: [0.0, 0.1] for node in NODES}, server_round=rnd)
    reference = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling=sampling)
    plain = DPFedAvgFixed(
        clustered.strategy,
        clip_norm=1.0,
        noise_multiplier=1.3,
        num_sampled_clients=4,
        noise_site="server",
        ledger=reference,
        rng=np.random.default_rng(0),
    )
    reference.charge(plain.releases_with(1.3, 1, 4, count=3))
    assert len(clustered.ledger.releases) == 3
    assert clustered.ledger.epsilon() == pytest.approx(reference.epsilon(), rel=1e-9)


def test_adaptive_clipping_moves_one_clip_norm_for_all_clusters():
    strategy = _wrapper(
        ClusteredDPFedAvgAdaptive, target_quantile=0.5, clip_lr=0.5, clip_count_stddev=1e-9
    )
    messages = strategy.configure_train(1, record(MODELS[0]), ConfigRecord({}), FakeGrid(NODES))
    replies = []
    for message in messages:
        node = message.metadata.dst_node_id
        sent = message.content[keys.ARRAYS]["w"].numpy()
        bit = 1.0  # every update within the clip: C shrinks
        replies.append(
            reply_from(node, {"w": sent + 0.01}, {"num-examples": 1, keys.DP_NORM_BIT: bit})
        )
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["dp-clip-norm"] == 1.0
    assert strategy.clip_norm == pytest.approx(np.exp(-0.5 * (1.0 - 0.5)))


class NobodySampled:
    """A generator whose Poisson draws never take a node; its normals are real."""

    def __init__(self):
        self.normals = np.random.default_rng(0)

    def random(self, size):
        return np.ones(size)

    def normal(self, *args, **kwargs):
        return self.normals.normal(*args, **kwargs)


def test_an_empty_poisson_cohort_in_round_one_releases_noise_on_every_model():
    strategy = _wrapper(z=0.5, sampling="poisson")
    strategy.strategy.models = None  # the clustered strategy has not been asked yet
    strategy.rng = NobodySampled()
    messages = strategy.configure_train(1, record(MODELS[0]), ConfigRecord({}), FakeGrid(NODES))
    assert messages == []
    _, metrics = strategy.aggregate_train(1, [])
    models = [m["w"].numpy() for m in strategy.strategy.models]
    assert len(models) == 3 and all(not np.allclose(m, MODELS[0]["w"]) for m in models)
    assert metrics["cluster-0-size"] == 0 and len(strategy.ledger.releases) == 1
