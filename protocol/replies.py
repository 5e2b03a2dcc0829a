"""What makes a reply usable: its metrics and arrays finite, its example count a weight.

The server checks every reply with these before anything enters an aggregate; the
ClientApp's mods decode what they post-process with the same rules."""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from protocol import keys
from protocol.records import InvalidReply, arrays_of, non_finite_array, records

# More examples than any client of this app holds: a larger weight is a poisoning
# attempt on the example-weighted average, not data.
MAX_NUM_EXAMPLES = 10**9


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or float metric value (bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def unusable_reason(message: Message) -> str:
    """Why a reply without error may enter no aggregate at all ("": it may): a metric
    or an array that is not finite. Each strategy checks more (:func:`check_reply`:
    keys, shapes and weights against what it sent)."""
    for name, metric_record in records(message.content, MetricRecord).items():
        for key, value in metric_record.items():
            values = value if isinstance(value, list) else [value]
            if not all(math.isfinite(v) for v in values if is_number(v)):
                return f"rejected: metric '{key}' of '{name}' is not finite"
    for array_record in records(message.content, ArrayRecord).values():
        bad = non_finite_array(array_record)
        if bad is not None:
            return f"rejected: array '{bad}' contains NaN or Inf"
    return ""


def metrics_of(message: Message, weight: float | None = None) -> MetricRecord:
    """The reply's single MetricRecord (a copy; ``num-examples`` set to ``weight`` if given)."""
    record = message.content.get(keys.METRICS)
    if not isinstance(record, MetricRecord):
        raise InvalidReply(f"reply has no MetricRecord '{keys.METRICS}'")
    copy = MetricRecord(dict(record))
    if weight is not None:
        copy[keys.NUM_EXAMPLES] = weight
    return copy


def checked_metrics(message: Message) -> MetricRecord:
    """The reply's metrics with a finite, non-negative ``num-examples`` (or InvalidReply)."""
    if message.has_error():
        raise InvalidReply(f"error reply: {message.error.reason}")
    metrics = metrics_of(message)
    weight = metrics.get(keys.NUM_EXAMPLES)
    if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise InvalidReply(f"'{keys.NUM_EXAMPLES}' = {weight!r} is not a valid weight")
    return metrics


def check_reply(message: Message, reference: ArrayRecord) -> tuple[list[np.ndarray], MetricRecord]:
    """The reply's arrays (key order) and metrics if it may enter an aggregate, else
    InvalidReply with the reason.

    A reply passes when it is not an error, holds exactly one ArrayRecord with the
    global model's keys, shapes and dtypes and only finite values, and one MetricRecord
    whose values are finite numbers and whose ``num-examples`` is an integer in
    [0, MAX_NUM_EXAMPLES]. An empty ``reference`` (no global model, e.g. ``local``)
    checks only that the arrays are finite.
    """
    metrics = checked_metrics(message)
    arrays = arrays_of(message.content.get(keys.ARRAYS), reference if len(reference) else None)
    content = message.content
    if len(records(content, ArrayRecord)) != 1 or len(records(content, MetricRecord)) != 1:
        raise InvalidReply("expected exactly one ArrayRecord and one MetricRecord")
    weight = metrics[keys.NUM_EXAMPLES]
    assert isinstance(weight, int | float)  # checked_metrics: a finite number
    if weight != int(weight) or weight > MAX_NUM_EXAMPLES:
        raise InvalidReply(
            f"'{keys.NUM_EXAMPLES}' = {weight!r} is not an integer in [0, {MAX_NUM_EXAMPLES}]"
        )
    for key, value in metrics.items():
        numbers = value if isinstance(value, list) else [value]
        if not all(is_number(v) and math.isfinite(v) for v in numbers):
            raise InvalidReply(f"metric '{key}' = {value!r} is not a finite number")
    return arrays, metrics


# What one reply may cost the server: the global model's arrays plus this margin (a
# share of them, and at least this many bytes for metrics and configs).
REPLY_MARGIN_SHARE = 0.1
REPLY_MARGIN_BYTES = 1 << 20


def reply_bytes(message: Message) -> int:
    """The bytes a reply's content holds: its arrays' data, its config records' strings
    and bytes, 8 per metric number."""
    total = 0
    for arrays in records(message.content, ArrayRecord).values():
        total += sum(len(array.data) for array in arrays.values())
    for configs in records(message.content, ConfigRecord).values():
        for value in configs.values():
            for item in value if isinstance(value, list) else [value]:
                total += len(item) if isinstance(item, str | bytes) else 8
    for metrics in records(message.content, MetricRecord).values():
        total += sum(8 * (len(v) if isinstance(v, list) else 1) for v in metrics.values())
    return total


def reply_limit(reference: ArrayRecord) -> int:
    """The most bytes a reply to a message carrying ``reference`` may hold."""
    model = sum(len(array.data) for array in reference.values())
    return model + max(int(REPLY_MARGIN_SHARE * model), REPLY_MARGIN_BYTES)


def oversized_reason(message: Message, limit: int) -> str:
    """Why a reply is refused for its size ("": it is not): more than ``limit`` bytes
    (:func:`reply_limit`)."""
    size = reply_bytes(message)
    if size <= limit:
        return ""
    return (
        f"rejected: reply of {size} bytes exceeds the {limit} bytes a reply may hold (the "
        f"global model's arrays plus a margin of {REPLY_MARGIN_SHARE:.0%}, at least "
        f"{REPLY_MARGIN_BYTES} bytes)"
    )
