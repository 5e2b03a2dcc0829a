"""The round loop's per-client participation rows."""

from __future__ import annotations

import types

import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from protocol import keys
from server_app import rounds
from server_app.rounds import Progress, participation, regroup
from tests.fakes import error_from, instruction, record, reply_from


def test_participation_has_one_row_per_client_sent_a_message():
    sent = [instruction({"w": [0.0]}, {}, node_id=n) for n in (3, 5, 7)]
    replies = [
        reply_from(3, {"w": [1.0]}, {"num-examples": 10, "train-loss": 0.5}),
        error_from(5, "out of memory"),
    ]  # node 7 never replied

    rows = participation(4, sent, replies)

    assert rows == [
        {
            "round": 4, "node-id": 3, "replied": True, "error": "",
            "num-examples": 10, "train-loss": 0.5,
        },
        {"round": 4, "node-id": 5, "replied": False, "error": "out of memory"},
        {"round": 4, "node-id": 7, "replied": False, "error": "no reply"},
    ]  # fmt: skip


def test_a_reply_with_non_finite_values_is_recorded_as_rejected():
    sent = [instruction({"w": [0.0]}, {}, node_id=n) for n in (3, 5)]
    replies = [
        reply_from(3, {"w": [float("nan")]}, {"num-examples": 10}),
        reply_from(5, {"w": [1.0]}, {"num-examples": 10, "train-loss": float("inf")}),
    ]
    rows = participation(1, sent, replies)
    assert [(r["replied"], r["error"]) for r in rows] == [
        (True, "rejected: array 'w' contains NaN or Inf"),
        (True, "rejected: metric 'train-loss' of 'metrics' is not finite"),
    ]


def test_regroup_weights_group_accuracy_by_the_group_count():
    # Client 1: 90 "low" examples, all right, 10 "high", none right; client 2: 10 low
    # (half right), 90 high (all right). By num-examples both weigh 100: a plain weighted
    # mean would say low 0.75, high 0.5; by group counts low = 95/100, high = 90/100.
    replies = [
        reply_from(1, None, {"num-examples": 100, "eval-accuracy-low": 1.0,
                             "num-examples-low": 90, "eval-accuracy-high": 0.0,
                             "num-examples-high": 10, "fairness-gap": 1.0}, kind="evaluate"),
        reply_from(2, None, {"num-examples": 100, "eval-accuracy-low": 0.5,
                             "num-examples-low": 10, "eval-accuracy-high": 1.0,
                             "num-examples-high": 90, "fairness-gap": 0.5}, kind="evaluate"),
        error_from(3),
    ]  # fmt: skip
    aggregated = MetricRecord(
        {"eval-accuracy-low": 0.75, "num-examples-low": 50.0, "eval-accuracy-high": 0.5,
         "num-examples-high": 50.0, "fairness-gap": 0.75, "num-examples": 200.0}
    )  # fmt: skip

    out = regroup(aggregated, replies)

    assert out["eval-accuracy-low"] == pytest.approx(0.95)
    assert out["eval-accuracy-high"] == pytest.approx(0.90)
    assert out["num-examples-low"] == 100 and out["num-examples-high"] == 100
    assert out["fairness-gap"] == pytest.approx(0.05)
    assert regroup(None, replies) is None
    plain = MetricRecord({"eval-accuracy": 0.5})
    assert regroup(plain, replies) is plain


def test_group_metric_keys_mirror_the_tasks():
    from protocol import keys
    from tasks.vision import data

    assert keys.GROUP_ACCURACY == data.GROUP_ACCURACY
    assert keys.GROUP_NUM_EXAMPLES == data.GROUP_NUM_EXAMPLES
    assert keys.FAIRNESS_GAP == data.FAIRNESS_GAP


def test_the_eta_leaves_out_the_first_rounds_start_up():
    progress = Progress(total=10)
    progress.seconds = [29.0]  # round 1: start-up included, no estimate from it
    assert progress.eta() is None
    progress.seconds = [29.0, 2.0, 4.0]
    assert progress.eta() == 3.0 * 7  # the "ETA 4:20" for a 2 s round is gone


class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


class _EchoGrid:
    """Every node answers a train message with the arrays it got; answering costs 1 s."""

    def __init__(self, clock, nodes):
        self.clock, self.nodes = clock, nodes

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        self.clock.now += 1.0
        out = []
        for m in messages:
            content = RecordDict(
                {
                    keys.ARRAYS: m.content[keys.ARRAYS],
                    keys.METRICS: MetricRecord({"num-examples": 1}),
                }
            )
            out.append(Message(content, reply_to=m))
        return out


def test_round_seconds_are_the_train_time_without_the_evaluation(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(rounds, "time", types.SimpleNamespace(monotonic=clock.monotonic))

    def central_eval(server_round, arrays):
        clock.now += 100.0  # evaluation is slow; the round's train row must not count it
        return {"eval-loss": 1.0}

    seen = []
    strategy = FedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2
    )
    rounds.run_rounds(
        strategy,
        _EchoGrid(clock, [1, 2]),
        record({"w": [0.0, 1.0]}),
        num_rounds=2,
        timeout=10.0,
        central_eval=central_eval,
        on_round=seen.append,
    )
    assert [r.server_round for r in seen] == [0, 1, 2]
    assert [r.seconds for r in seen[1:]] == [1.0, 1.0]
