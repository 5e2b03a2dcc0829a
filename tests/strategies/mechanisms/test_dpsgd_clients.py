"""DPSGDClients: the server's own check of each client's sample-level ε (restarted
accountants, the round under way at a resume) and the budget in every view."""

from __future__ import annotations

import re

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from privacy.accounting import PrivacyLedger
from privacy.calibration import sampled_gaussian_epsilon
from protocol import keys
from strategies import StopTraining
from strategies.mechanisms.dpsgd_clients import DPSGDClients
from tests.fakes import FakeGrid, error_from, record, reply_from

GLOBAL = {"w": [0.0, 1.0]}
STEPS = (1.1, 0.05, 20)  # noise multiplier, sample rate, steps per round


def _wrapper(max_epsilon=None):
    ledger = PrivacyLedger(
        accountant="rdp",
        target_delta=1e-5,
        sampling="none",
        mechanisms=(),
        max_epsilon=max_epsilon,
    )
    base = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    return DPSGDClients(
        base, noise_multiplier=1.1, max_grad_norm=1.0, target_epsilon=0.0, ledger=ledger
    )


def _epsilon(rounds: int) -> float:
    z, q, steps = STEPS
    return sampled_gaussian_epsilon([(z, q, steps * rounds)], target_delta=1e-5)


def _round(strategy, server_round, covered, nodes=(1, 2)):
    """One round; each client says its accountant covers ``covered[node]`` trainings and
    reports the epsilon of those."""
    messages = list(
        strategy.configure_train(server_round, record(GLOBAL), ConfigRecord(), FakeGrid(nodes))
    )
    replies = []
    for message in messages:
        node = message.metadata.dst_node_id
        metrics = {
            keys.NUM_EXAMPLES: 10,
            keys.LOCAL_EPSILON: _epsilon(covered[node]),
            keys.DPSGD_ROUNDS: covered[node],
            keys.DPSGD_ROUND_NOISE: STEPS[0],
            keys.DPSGD_ROUND_SAMPLE_RATE: STEPS[1],
            keys.DPSGD_ROUND_STEPS: STEPS[2],
        }
        replies.append(reply_from(node, GLOBAL, metrics))
    return messages, strategy.aggregate_train(server_round, replies)


def _recorded(strategy, server_round):
    return {
        g.client: g.epsilon
        for g in strategy.ledger.local_guarantees
        if g.server_round == server_round
    }


def test_an_honest_client_is_recorded_as_it_reports():
    strategy = _wrapper()
    strategy.partitions.record(1, 0)
    strategy.partitions.record(2, 1)
    messages, (_, metrics) = _round(strategy, 1, {1: 1, 2: 1})
    config = messages[0].content[keys.CONFIG]
    assert config[keys.REPORT_METRICS] == sorted(DPSGDClients.CLIENT_REPORTS)
    assert config[keys.DPSGD_MAX_EPSILON] == 0.0
    _round(strategy, 2, {1: 2, 2: 2})
    assert _recorded(strategy, 2) == {
        "partition-0": pytest.approx(_epsilon(2), rel=1e-9),
        "partition-1": pytest.approx(_epsilon(2), rel=1e-9),
    }
    assert metrics[keys.LOCAL_EPSILON] == pytest.approx(_epsilon(1))


def test_a_restarted_accountant_is_caught_and_its_lost_history_composed(caplog):
    strategy = _wrapper()
    strategy.partitions.record(1, 0)
    strategy.partitions.record(2, 1)
    _round(strategy, 1, {1: 1, 2: 1})
    _round(strategy, 2, {1: 2, 2: 2})
    # Partition 1 lost its state file: its accountant restarted and it reports 1 round.
    _round(strategy, 3, {1: 3, 2: 1})
    recorded = _recorded(strategy, 3)
    assert recorded["partition-1"] == pytest.approx(_epsilon(3), rel=1e-9)
    assert recorded["partition-1"] > _epsilon(1)
    assert "partition-1's accountant covers 1 training(s), the server asked it 3" in caplog.text


def test_a_client_reporting_less_than_its_steps_compose_to_is_overruled(caplog):
    strategy = _wrapper()
    strategy.partitions.record(1, 0)
    _round(strategy, 1, {1: 1}, nodes=(1,))
    messages = list(strategy.configure_train(2, record(GLOBAL), ConfigRecord(), FakeGrid([1])))
    metrics = {
        keys.NUM_EXAMPLES: 10,
        keys.LOCAL_EPSILON: 0.01,  # far below what its stated steps compose to
        keys.DPSGD_ROUNDS: 2,
        keys.DPSGD_ROUND_NOISE: STEPS[0],
        keys.DPSGD_ROUND_SAMPLE_RATE: STEPS[1],
        keys.DPSGD_ROUND_STEPS: STEPS[2],
    }
    strategy.aggregate_train(2, [reply_from(messages[0].metadata.dst_node_id, GLOBAL, metrics)])
    assert _recorded(strategy, 2)["partition-0"] == pytest.approx(_epsilon(2), rel=1e-9)
    assert "reported epsilon 0.0100" in caplog.text


def test_a_resume_counts_the_interrupted_round_for_every_client():
    strategy = _wrapper()
    strategy.partitions.record(1, 0)
    strategy.partitions.record(2, 1)
    _round(strategy, 1, {1: 1, 2: 1})
    strategy.on_resume()  # the server stopped while round 2 may have been training
    _round(strategy, 2, {1: 2, 2: 2})
    assert _recorded(strategy, 2)["partition-0"] == pytest.approx(_epsilon(3), rel=1e-9)


def test_budget_refuses_a_round_a_client_would_exceed_and_a_client_refusal_stops_the_run():
    budget = (_epsilon(2) + _epsilon(3)) / 2
    strategy = _wrapper(max_epsilon=budget)
    strategy.partitions.record(1, 0)
    messages, _ = _round(strategy, 1, {1: 1}, nodes=(1,))
    assert messages[0].content[keys.CONFIG][keys.DPSGD_MAX_EPSILON] == budget
    _round(strategy, 2, {1: 2}, nodes=(1,))
    with pytest.raises(StopTraining, match=re.escape("'dp.max-epsilon'")):
        _round(strategy, 3, {1: 3}, nodes=(1,))
    # A client that refuses (it knows its own steps before the server does).
    strategy = _wrapper(max_epsilon=budget)
    list(strategy.configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid([1])))
    reason = f"{keys.DPSGD_BUDGET_REFUSAL}: this round would take ..."
    strategy.aggregate_train(1, [error_from(1, reason)])
    with pytest.raises(StopTraining, match="a client refused to train"):
        strategy.configure_train(2, record(GLOBAL), ConfigRecord(), FakeGrid([1]))


def test_an_error_reply_without_a_reason_is_a_failure_not_a_refusal():
    strategy = _wrapper()
    list(strategy.configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid([1, 2])))
    sent = Message(content=RecordDict(), dst_node_id=2, message_type="train")
    no_reason = Message(Error(code=0), reply_to=sent)
    assert no_reason.error.reason is None
    arrays, _ = strategy.aggregate_train(
        1, [reply_from(1, GLOBAL, {keys.NUM_EXAMPLES: 10}), no_reason]
    )
    assert arrays is not None  # node 1's update is aggregated
    messages = list(strategy.configure_train(2, record(GLOBAL), ConfigRecord(), FakeGrid([1, 2])))
    assert len(messages) == 2  # no refusal was read into the reasonless error


def test_dpsgd_metric_keys_are_the_tasks():
    # The task reports them (tasks/ cannot import strategies/): one name each.
    from privacy import dpsgd

    assert (dpsgd.ROUNDS, dpsgd.ROUND_NOISE, dpsgd.ROUND_SAMPLE_RATE, dpsgd.ROUND_STEPS) == (
        keys.DPSGD_ROUNDS,
        keys.DPSGD_ROUND_NOISE,
        keys.DPSGD_ROUND_SAMPLE_RATE,
        keys.DPSGD_ROUND_STEPS,
    )
    assert dpsgd.BUDGET_REFUSAL == keys.DPSGD_BUDGET_REFUSAL
