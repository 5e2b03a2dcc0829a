"""DP-FedAvg wrappers: sampling, config keys, hand-computed aggregates, failed clients
counted as zero updates, budget rules, adaptive clipping, the ledger entries they make
and the local view of client-side noise."""

from __future__ import annotations

import math
import re

import dp_accounting
import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from privacy.accounting import PrivacyLedger
from protocol import keys
from strategies import StopTraining
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.dp_fedavg_adaptive import DPFedAvgAdaptive
from tests.fakes import FakeGrid, error_from, record, reply_from

GLOBAL = {"w": [0.0, 0.0], "b": [1.0]}
# The noise tests read many coordinates a round rather than many rounds: a round's
# ledger charge costs ~10 ms, a coordinate's draw nothing.
WIDE = {"w": [0.0] * 100, "b": [1.0]}


def _ledger(**kw) -> PrivacyLedger:
    return PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="without-replacement", **kw)


def _wrapper(cls=DPFedAvgFixed, *, m=3, z=1.0, clip=1.0, site="server", seed=0, ledger=None, **kw):
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    return cls(
        base,
        clip_norm=clip,
        noise_multiplier=z,
        num_sampled_clients=m,
        noise_site=site,
        ledger=ledger or _ledger(),
        rng=np.random.default_rng(seed),
        **kw,
    )


def _configure(strategy, nodes=range(1, 6), server_round=1, model=GLOBAL):
    return list(
        strategy.configure_train(server_round, record(model), ConfigRecord(), FakeGrid(nodes))
    )


def _replies(messages, deltas, extra=None, model=GLOBAL):
    """Replies whose arrays are ``model`` + delta, one per configured message."""
    out = []
    for message, (dw, db) in zip(messages, deltas, strict=True):
        arrays = {"w": np.add(model["w"], dw), "b": np.add(model["b"], db)}
        out.append(
            reply_from(
                message.metadata.dst_node_id,
                arrays,
                {"num-examples": 100, "train-loss": 1.0, **(extra or {})},
            )
        )
    return out


def test_samples_exactly_m_distinct_nodes_reproducibly():
    first = {m.metadata.dst_node_id for m in _configure(_wrapper(seed=3))}
    again = {m.metadata.dst_node_id for m in _configure(_wrapper(seed=3))}
    assert len(first) == 3 and first <= set(range(1, 6)) and first == again
    draws = {
        frozenset(m.metadata.dst_node_id for m in _configure(_wrapper(seed=s))) for s in range(20)
    }
    assert len(draws) > 3  # the generator, not a fixed choice, decides


def test_config_keys_server_and_client_site():
    server = _configure(_wrapper(site="server", clip=2.0))
    assert all(m.content[keys.CONFIG][keys.DP_CLIP_NORM] == 2.0 for m in server)
    assert all(keys.DP_NOISE_STDDEV not in m.content[keys.CONFIG] for m in server)
    client = _configure(_wrapper(site="client", clip=2.0, z=1.5, m=3))
    stds = [m.content[keys.CONFIG][keys.DP_NOISE_STDDEV] for m in client]
    assert stds == [pytest.approx(1.5 * 2.0 / math.sqrt(3))] * 3  # sigma_Delta / sqrt(m)


def test_unweighted_mean_of_clipped_updates_by_hand():
    # Noise so small it vanishes next to the tolerance: clipping and averaging exactly.
    strategy = _wrapper(z=1e-12, clip=1.0)
    messages = _configure(strategy)
    deltas = [([3.0, 4.0], [0.0]), ([0.3, 0.0], [0.4]), ([0.0, 0.0], [-2.0])]
    arrays, metrics = strategy.aggregate_train(1, _replies(messages, deltas))
    # Clipped: (0.6, 0.8 | 0), (0.3, 0 | 0.4) unchanged (norm 0.5), (0, 0 | -1).
    np.testing.assert_allclose(arrays["w"].numpy(), [(0.6 + 0.3) / 3, 0.8 / 3], atol=1e-9)
    np.testing.assert_allclose(arrays["b"].numpy(), [1.0 + (0.4 - 1.0) / 3], atol=1e-9)
    assert metrics["train-loss"] == pytest.approx(1.0)
    assert metrics["dp-epsilon"] > 0 and len(strategy.ledger.releases) == 1


def test_server_noise_has_std_zC_over_m_on_the_mean():
    z, clip, m = 0.8, 0.5, 4
    strategy = _wrapper(z=z, clip=clip, m=m, seed=11)
    rounds = []
    for rnd in range(1, 16):  # 15 rounds x 100 coordinates
        messages = _configure(strategy, server_round=rnd, model=WIDE)
        replies = _replies(messages, [(0.0, 0.0)] * m, model=WIDE)
        rounds.append(strategy.aggregate_train(rnd, replies)[0]["w"].numpy())
    assert np.std(rounds) == pytest.approx(z * clip / m, rel=0.03)
    assert not np.allclose(rounds[0], rounds[1])  # a fresh draw each round


FAILURES = ["error", "missing", "nan", "wrong-shape", "no-arrays", "unasked"]


def _fail(replies, failure):
    """``replies`` with the first one's failure of kind ``failure``."""
    replies = list(replies)
    node = replies[0].metadata.src_node_id
    if failure == "error":
        replies[0] = error_from(node)
    elif failure == "missing":
        replies = replies[1:]
    elif failure == "nan":
        replies[0] = reply_from(node, {"w": [np.nan, 0.0], "b": [1.0]}, {"num-examples": 1})
    elif failure == "wrong-shape":
        replies[0] = reply_from(node, {"w": [0.0], "b": [1.0]}, {"num-examples": 1})
    elif failure == "no-arrays":
        replies[0] = reply_from(node, None, {"num-examples": 1})
    else:  # a reply from a node that was not asked replaces the asked node's
        replies[0] = reply_from(999, {"w": [5.0, 5.0], "b": [5.0]}, {"num-examples": 1})
    return replies


@pytest.mark.parametrize("failure", FAILURES)
def test_failed_client_counts_as_a_zero_update_and_the_round_is_charged(failure):
    # Whether a client fails can depend on its data: an aborted round would be an
    # uncharged release. The round goes on: the failed client's update is zero, the
    # denominator stays m, and the round is charged like any other.
    strategy = _wrapper(z=1e-12)
    messages = _configure(strategy)
    replies = _fail(_replies(messages, [([0.3, 0.0], [0.3])] * 3), failure)
    arrays, metrics = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [2 * 0.3 / 3, 0.0], atol=1e-9)
    np.testing.assert_allclose(arrays["b"].numpy(), [1.0 + 2 * 0.3 / 3], atol=1e-9)
    assert len(strategy.ledger.releases) == 1 and metrics["dp-epsilon"] > 0
    assert metrics[keys.DP_FAILED_CLIENTS] == 1.0


def test_a_round_where_every_client_failed_releases_noise_and_is_charged():
    strategy = _wrapper(z=1.0, clip=1.0, seed=4)
    messages = _configure(strategy)
    arrays, _ = strategy.aggregate_train(1, [error_from(m.metadata.dst_node_id) for m in messages])
    assert not np.allclose(arrays["w"].numpy(), GLOBAL["w"])  # N(0, (zC)^2) / m, nothing else
    assert len(strategy.ledger.releases) == 1


def test_client_side_noise_of_failed_clients_is_drawn_by_the_server():
    # Each client adds N(0, (zC)^2 / m); with 2 of 4 failing, the server adds their two
    # shares, so the mean still carries N(0, (zC/m)^2) (the clients' replies here are
    # noise-free fakes, so only the server's draws are seen: std zC sqrt(2/m) / m).
    z, clip, m = 1.0, 1.0, 4
    strategy = _wrapper(z=z, clip=clip, m=m, site="client", seed=2)
    rounds = []
    for rnd in range(1, 17):  # 16 rounds x 100 coordinates
        messages = _configure(strategy, nodes=range(1, 5), server_round=rnd, model=WIDE)
        replies = _replies(messages, [(0.0, 0.0)] * m, model=WIDE)[2:]
        rounds.append(strategy.aggregate_train(rnd, replies)[0]["w"].numpy())
    assert np.std(rounds) == pytest.approx(z * clip * math.sqrt(2 / m) / m, rel=0.04)
    assert not np.allclose(rounds[0], rounds[1])  # a fresh draw each round


def test_budget_refusal_before_sending():
    ledger = _ledger(max_epsilon=5.0)
    strategy = _wrapper(z=5.0, ledger=ledger)  # about 1.4 per round (3 of 5 sampled)
    rounds = 0
    with pytest.raises(StopTraining, match=re.escape("would exceed 'dp.max-epsilon'")):
        for rnd in range(1, 200):
            messages = _configure(strategy, server_round=rnd)
            strategy.aggregate_train(rnd, _replies(messages, [([0, 0], [0])] * 3))
            rounds += 1
    assert 0 < rounds < 199
    assert ledger.epsilon() <= 5.0
    assert len(ledger.releases) == rounds  # the refused round charged nothing


def test_ledger_entry_matches_dp_accounting_with_replace_one_sensitivity():
    z, m, population = 1.2, 3, 5
    strategy = _wrapper(z=z, m=m)
    messages = _configure(strategy)
    strategy.aggregate_train(1, _replies(messages, [([0, 0], [0])] * m))
    # Fixed-size sampling is accounted under REPLACE_ONE: swapping one clipped update
    # moves the sum by up to 2C, so the event's multiplier is z/2.
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    accountant.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(
            population, m, dp_accounting.GaussianDpEvent(z / 2)
        )
    )
    assert strategy.ledger.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-2)


def test_adaptive_clip_update_by_hand():
    gamma, eta, sigma_b, clip = 0.5, 0.2, 2.0, 1.0
    strategy = _wrapper(
        DPFedAvgAdaptive,
        site="client",
        clip=clip,
        seed=5,
        target_quantile=gamma,
        clip_lr=eta,
        clip_count_stddev=sigma_b,
    )
    messages = _configure(strategy)
    assert all(m.content[keys.CONFIG][keys.DP_ADAPTIVE] for m in messages)
    replies = _replies(messages, [([0, 0], [0])] * 3)
    for reply, bit in zip(replies, [1.0, 0.0, 1.0], strict=True):
        reply.content[keys.METRICS][keys.DP_NORM_BIT] = bit
    # Client-side noise: the server's only draw this round is the count noise.
    expected_noise = np.random.default_rng(5)
    expected_noise.choice(5, size=3, replace=False)  # the sampling draw comes first
    noisy = (2.0 + expected_noise.normal(0.0, sigma_b)) / 3
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["dp-noisy-unclipped-fraction"] == pytest.approx(noisy)
    assert strategy.clip_norm == pytest.approx(clip * math.exp(-eta * (noisy - gamma)))
    assert metrics["dp-clip-norm"] == clip  # the norm used this round


def test_adaptive_noise_split_and_validation():
    strategy = _wrapper(
        DPFedAvgAdaptive, z=1.0, target_quantile=0.5, clip_lr=0.2, clip_count_stddev=1.0
    )
    assert strategy.update_noise_multiplier() == pytest.approx((1 - 0.25) ** -0.5)
    (release,) = strategy.release(1, 5)
    assert release.noise_multiplier == pytest.approx(0.5)  # z (not z_delta), over 2C
    with pytest.raises(ValueError, match="must exceed z/2"):
        _wrapper(DPFedAvgAdaptive, z=2.0, target_quantile=0.5, clip_lr=0.2, clip_count_stddev=1.0)


def test_adaptive_counts_a_reply_without_a_valid_bit_as_a_zero_update():
    strategy = _wrapper(
        DPFedAvgAdaptive, z=1e-3, target_quantile=0.5, clip_lr=0.2, clip_count_stddev=1e-3
    )
    messages = _configure(strategy)
    replies = _replies(messages, [([0.3, 0], [0])] * 3)
    for reply, bit in zip(replies, [1.0, 0.5, None], strict=True):
        if bit is not None:
            reply.content[keys.METRICS][keys.DP_NORM_BIT] = bit
    arrays, metrics = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [0.3 / 3, 0.0], atol=1e-2)
    assert metrics[keys.DP_FAILED_CLIENTS] == 2.0  # a bit of 0.5, and none
    # Centred bits: the valid client adds 1 - 1/2, each failed one nothing (a bit of 1/2).
    assert metrics["dp-noisy-unclipped-fraction"] == pytest.approx(0.5 / 3 + 0.5, abs=1e-2)
    assert len(strategy.ledger.releases) == 1


def test_too_few_nodes_stops_cleanly_after_waiting():
    strategy = _wrapper(m=3, connect_timeout=0.3)
    with pytest.raises(StopTraining, match=re.escape("'dp.num-sampled-clients' = 3")):
        _configure(strategy, nodes=[1, 2])


def test_waits_for_late_nodes():
    class LateGrid(FakeGrid):
        calls = 0

        def get_node_ids(self):
            LateGrid.calls += 1
            return self.node_ids if LateGrid.calls > 2 else self.node_ids[:1]

    strategy = _wrapper(m=3, connect_timeout=30)
    messages = list(
        strategy.configure_train(1, record(GLOBAL), ConfigRecord(), LateGrid(range(1, 6)))
    )
    assert len(messages) == 3 and LateGrid.calls >= 3


def test_federated_evaluation_only_with_client_metrics():
    # Each client's accuracy on its own data is a release no epsilon covers.
    strategy = _wrapper()
    assert not list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), FakeGrid([1])))
    strategy = _wrapper(client_metrics=True)
    messages = strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), FakeGrid([1, 2]))
    assert len(list(messages)) == 2


def test_clients_are_asked_for_only_what_the_mechanism_needs():
    (message, *_) = _configure(_wrapper())
    assert message.content[keys.CONFIG][keys.REPORT_METRICS] == []
    adaptive = _wrapper(DPFedAvgAdaptive, target_quantile=0.5, clip_lr=0.2, clip_count_stddev=1.0)
    (message, *_) = _configure(adaptive)
    assert message.content[keys.CONFIG][keys.REPORT_METRICS] == [keys.DP_NORM_BIT]
    (message, *_) = _configure(_wrapper(client_metrics=True))
    assert keys.REPORT_METRICS not in message.content[keys.CONFIG]


def test_released_metrics_are_those_computed_from_released_quantities():
    adaptive = _wrapper(DPFedAvgAdaptive, target_quantile=0.5, clip_lr=0.2, clip_count_stddev=1.0)
    released = ["dp-epsilon", "dp-clip-norm", "dp-noisy-unclipped-fraction", "dp-noise-from-seed"]
    assert all(adaptive.releases_metric(k) for k in released)
    for key in ("train-loss", "dpfedavg-norm-bit", keys.DP_FAILED_CLIENTS, "num-examples"):
        assert not adaptive.releases_metric(key)


def test_client_side_noise_is_charged_per_client_against_the_server():
    z, m = 1.0, 3
    strategy = _wrapper(z=z, m=m, site="client", seed=1)
    assert _wrapper(site="server").local_view is None  # the server sees raw updates
    asked = {}
    for rnd in range(1, 5):
        messages = _configure(strategy, server_round=rnd)
        for message in messages:
            node = message.metadata.dst_node_id
            asked[node] = asked.get(node, 0) + 1
        _, metrics = strategy.aggregate_train(rnd, _replies(messages, [([0, 0], [0])] * m))
    # Replace-one (fixed-size sampling): each upload has multiplier z / (2 sqrt(m)); the
    # worst client's uploads compose into one Gaussian (dp-accounting's analytic loss).
    busiest = max(asked.values())
    loss = dp_accounting.pld.privacy_loss_mechanism.GaussianPrivacyLoss(
        z / (2 * math.sqrt(m)) / math.sqrt(busiest)
    )
    worst = metrics[keys.DP_EPSILON_LOCAL_WORST]  # depends on the sample: curator-only
    assert loss.get_delta_for_epsilon(worst) <= 1e-5
    assert loss.get_delta_for_epsilon(worst - 1e-6) > 1e-5
    assert worst > metrics[keys.DP_EPSILON]  # no amplification
    assert not strategy.releases_metric(keys.DP_EPSILON_LOCAL_WORST)
    # Published: a client asked in all 4 rounds, whoever was sampled.
    every = dp_accounting.pld.privacy_loss_mechanism.GaussianPrivacyLoss(
        z / (2 * math.sqrt(m)) / math.sqrt(4)
    )
    bound = metrics[keys.DP_EPSILON_LOCAL]
    assert every.get_delta_for_epsilon(bound) <= 1e-5 < every.get_delta_for_epsilon(bound - 1e-6)
    assert bound >= worst and strategy.releases_metric(keys.DP_EPSILON_LOCAL)
    # A resumed run charges every client the round that was under way.
    before = strategy.local_view.participations("node-1")
    strategy.on_resume()
    assert strategy.local_view.participations("node-1") == before + 1


def test_client_side_noise_budget_holds_for_the_worst_client_too():
    ledger = _ledger(max_epsilon=40.0)  # generous for observers, not against the server
    strategy = _wrapper(z=1.0, m=3, site="client", ledger=ledger)
    rounds = 0
    with pytest.raises(StopTraining, match="against the server"):
        for rnd in range(1, 50):
            messages = _configure(strategy, server_round=rnd)
            strategy.aggregate_train(rnd, _replies(messages, [([0, 0], [0])] * 3))
            rounds += 1
    assert strategy.local_view.worst()[1] <= 40.0 and ledger.epsilon() <= 40.0


def test_data_dependent_selection_claims_no_amplification():
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, sampling="none")
    strategy = _wrapper(z=1.0, m=3, ledger=ledger, uniform_sampling=False)
    base_fraction = FedAvg(fraction_train=0.6, min_train_nodes=1, min_available_nodes=1)
    strategy.strategy = base_fraction  # the wrapped strategy picks its 3 of 5 itself
    messages = _configure(strategy)
    strategy.aggregate_train(1, _replies(messages, [([0, 0], [0])] * 3))
    (release,) = ledger.releases
    assert release.sampling == "none" and "no amplification" in release.note
    unsampled = dp_accounting.rdp.RdpAccountant()
    unsampled.compose(dp_accounting.GaussianDpEvent(1.0))
    assert ledger.epsilon() == pytest.approx(unsampled.get_epsilon(1e-5), rel=1e-2)


def test_the_aggregate_on_a_device_gives_the_by_hand_mean():
    # The by-hand case above with aggregate_device: clip, sum and noise in float32 torch
    # (on the CPU here; the clients' GPU in a run), within float32 tolerance.
    strategy = _wrapper(z=1e-12, clip=1.0, aggregate_device="cpu")
    assert strategy.site.device == "cpu"
    messages = _configure(strategy)
    deltas = [([3.0, 4.0], [0.0]), ([0.3, 0.0], [0.4]), ([0.0, 0.0], [-2.0])]
    arrays, _ = strategy.aggregate_train(1, _replies(messages, deltas))
    np.testing.assert_allclose(arrays["w"].numpy(), [(0.6 + 0.3) / 3, 0.8 / 3], atol=1e-6)
    np.testing.assert_allclose(arrays["b"].numpy(), [1.0 + (0.4 - 1.0) / 3], atol=1e-6)
    assert len(strategy.ledger.releases) == 1
    assert getattr(_wrapper(site="client", aggregate_device="cpu").site, "device", None) is None


def test_contributions_note_each_replys_verdict_as_participation_would_find_it():
    # The notes let the participation record skip its own check of each reply: the rows
    # with them equal the rows it computes by checking (valid, rejected, error, silent).
    from protocol.replies import check_reply
    from server_app.rounds import participation
    from strategies.mechanisms.dp_fedavg import contributions
    from tests.fakes import error_from, instruction, reply_from

    sent = [instruction({"w": [0.0, 0.0]}, {}, node_id=n) for n in (1, 2, 3, 4)]
    metrics = {"num-examples": 10, "train-loss": 0.5}
    replies = [
        reply_from(1, {"w": [1.0, 2.0]}, metrics),
        reply_from(2, {"w": [0.0, 0.0, 0.0]}, metrics),  # wrong shape
        error_from(3),
    ]  # node 4: silent
    reference = sent[0].content[keys.ARRAYS]
    notes: dict[int, str] = {}
    deltas, records, failed = contributions(
        replies,
        [1, 2, 3, 4],
        lambda _node: (reference, [np.zeros(2)]),
        check_reply,
        lambda delta: delta,
        notes,
    )
    assert notes == {1: "", 2: "rejected: array 'w' has shape (3,)/float64, expected (2,)/float64"}
    assert list(deltas) == [1] and failed == [2, 3, 4] and len(records) == 1
    np.testing.assert_array_equal(deltas[1][0], [1.0, 2.0])
    assert participation(1, sent, replies, notes=notes) == participation(1, sent, replies)
