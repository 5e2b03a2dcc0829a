"""protocol.replies: what makes a reply usable (finite metrics and arrays, a valid
example count), the server's check of every reply before an aggregate."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from protocol import keys
from protocol.records import InvalidReply
from protocol.replies import (
    MAX_NUM_EXAMPLES,
    check_reply,
    checked_metrics,
    is_number,
    metrics_of,
    unusable_reason,
)
from tests.fakes import error_from, record, reply_from

GLOBAL = record({"w": np.zeros(3), "b": np.zeros(1)})
GOOD = {"w": np.array([1.0, 2.0, 3.0]), "b": np.array([0.5])}


def _reply(content: dict) -> Message:
    sent = Message(content=RecordDict(), dst_node_id=7, message_type="train")
    return Message(RecordDict(content), reply_to=sent)


@pytest.mark.parametrize(
    ("value", "number"),
    [(1, True), (2.5, True), (float("nan"), True), (True, False), (False, False),
     ("3", False), (None, False), ([1.0], False), (np.float64(1.0), True)],
)  # fmt: skip
def test_is_number_is_an_int_or_float_but_not_a_bool(value, number):
    assert is_number(value) is number


def test_unusable_reason_is_empty_for_a_finite_reply():
    assert unusable_reason(reply_from(1, GOOD, {"num-examples": 4, "loss": [1.0, 2.0]})) == ""
    assert unusable_reason(reply_from(1, None, {"num-examples": 4})) == ""


@pytest.mark.parametrize(
    ("arrays", "metrics", "reason"),
    [
        (GOOD, {"num-examples": 4, "loss": float("inf")}, "metric 'loss' of 'metrics'"),
        (GOOD, {"num-examples": 4, "loss": [1.0, float("nan")]}, "metric 'loss' of 'metrics'"),
        ({**GOOD, "b": np.array([np.nan])}, {"num-examples": 4}, "array 'b' contains NaN"),
    ],
)
def test_unusable_reason_names_what_is_not_finite(arrays, metrics, reason):
    assert reason in unusable_reason(reply_from(1, arrays, metrics))


def test_metrics_of_is_a_copy_with_the_weight_it_is_given():
    message = reply_from(1, GOOD, {"num-examples": 4, "loss": 0.5})
    copy = metrics_of(message, weight=1)
    assert dict(copy) == {"num-examples": 1, "loss": 0.5}
    assert message.content[keys.METRICS][keys.NUM_EXAMPLES] == 4  # the reply is unchanged
    assert dict(metrics_of(message)) == {"num-examples": 4, "loss": 0.5}
    with pytest.raises(InvalidReply, match="reply has no MetricRecord 'metrics'"):
        metrics_of(_reply({keys.ARRAYS: GLOBAL}))
    with pytest.raises(InvalidReply, match="reply has no MetricRecord 'metrics'"):
        metrics_of(_reply({keys.METRICS: ConfigRecord({"num-examples": 4})}))


@pytest.mark.parametrize("weight", [-1, float("nan"), float("inf"), -0.5])
def test_checked_metrics_refuses_a_weight_that_is_no_weight(weight):
    with pytest.raises(InvalidReply, match=r"'num-examples' = .* is not a valid weight"):
        checked_metrics(reply_from(1, GOOD, {"num-examples": weight}))


def test_checked_metrics_refuses_an_error_reply_and_a_missing_weight():
    with pytest.raises(InvalidReply, match="error reply: out of memory"):
        checked_metrics(error_from(1, "out of memory"))
    with pytest.raises(InvalidReply, match="'num-examples' = None is not a valid weight"):
        checked_metrics(reply_from(1, GOOD, {"loss": 1.0}))
    assert checked_metrics(reply_from(1, GOOD, {"num-examples": 0}))["num-examples"] == 0


def test_check_reply_returns_the_arrays_in_the_global_models_key_order():
    arrays, metrics = check_reply(reply_from(1, GOOD, {"num-examples": 4, "loss": 0.5}), GLOBAL)
    assert [a.tolist() for a in arrays] == [[1.0, 2.0, 3.0], [0.5]]
    assert dict(metrics) == {"num-examples": 4, "loss": 0.5}


@pytest.mark.parametrize(
    ("weight", "valid"),
    [(0, True), (MAX_NUM_EXAMPLES, True), (MAX_NUM_EXAMPLES + 1, False), (2.5, False),
     (3.0, True)],
)  # fmt: skip
def test_check_reply_takes_an_integer_weight_up_to_the_bound(weight, valid):
    message = reply_from(1, GOOD, {"num-examples": weight})
    if valid:
        assert check_reply(message, GLOBAL)[1]["num-examples"] == weight
    else:
        with pytest.raises(InvalidReply, match=rf"is not an integer in \[0, {MAX_NUM_EXAMPLES}\]"):
            check_reply(message, GLOBAL)


def test_check_reply_wants_exactly_one_array_record_and_one_metric_record():
    two_arrays = _reply({
        keys.ARRAYS: record(GOOD), "extra": record({"x": np.zeros(1)}),
        keys.METRICS: MetricRecord({"num-examples": 4}),
    })  # fmt: skip
    two_metrics = _reply({
        keys.ARRAYS: record(GOOD), keys.METRICS: MetricRecord({"num-examples": 4}),
        "more": MetricRecord({"x": 1.0}),
    })  # fmt: skip
    for message in (two_arrays, two_metrics):
        with pytest.raises(InvalidReply, match="exactly one ArrayRecord and one MetricRecord"):
            check_reply(message, GLOBAL)


def test_check_reply_refuses_a_non_finite_metric_and_bad_arrays():
    with pytest.raises(InvalidReply, match=r"metric 'loss' = \[1.0, nan\] is not a finite"):
        check_reply(reply_from(1, GOOD, {"num-examples": 4, "loss": [1.0, float("nan")]}), GLOBAL)
    with pytest.raises(InvalidReply, match="array keys differ"):
        check_reply(reply_from(1, {"w": GOOD["w"]}, {"num-examples": 4}), GLOBAL)
    with pytest.raises(InvalidReply, match="error reply"):
        check_reply(error_from(1), GLOBAL)


def test_with_no_global_model_check_reply_checks_only_finiteness():
    """``local`` keeps no global model: any finite arrays pass, of any shape."""
    arrays, _ = check_reply(reply_from(1, {"own": np.ones((4, 4))}, {"num-examples": 2}),
                            ArrayRecord())  # fmt: skip
    assert arrays[0].shape == (4, 4)
    bad = reply_from(1, {"own": np.array([np.inf])}, {"num-examples": 2})
    with pytest.raises(InvalidReply, match="array 'own' contains NaN or Inf"):
        check_reply(bad, ArrayRecord())
