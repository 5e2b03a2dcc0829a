"""A bound on what one reply may cost the server: a reply larger than the global
model's arrays plus a margin is refused as it is pulled, recorded with its reason, and
enters no aggregate (under DP it counts as a zero update)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from protocol import keys
from protocol.replies import (
    REPLY_MARGIN_BYTES,
    oversized_reason,
    reply_bytes,
    reply_limit,
)
from strategies.runtime.messaging import send_and_receive
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]
BIG = 33


NPY_HEADER = 128  # Flower serialises an Array as a .npy file: 128 header bytes here


def _npy(n_floats: int) -> int:
    """The bytes of ``n_floats`` float32 as Flower's Array holds them."""
    return 4 * n_floats + NPY_HEADER


def _record(n_floats: int) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(n_floats, dtype=np.float32))})


def _reply(arrays: ArrayRecord, metrics: dict | None = None, config: dict | None = None):
    sent = Message(RecordDict({"arrays": arrays}), dst_node_id=7, message_type="train")
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics or {})})
    if config:
        content["config"] = ConfigRecord(config)
    return sent, Message(content, reply_to=sent)


def test_reply_bytes_and_the_limit_by_hand():
    # 1 000 float32 = 4 000 bytes + the header; 2 metric numbers = 16; "abc" + b"xy" = 5.
    _, reply = _reply(_record(1000), {"num-examples": 3, "loss": 0.5}, {"s": "abc", "b": b"xy"})
    assert len(_record(1000)["w"].data) == _npy(1000) == 4128
    assert reply_bytes(reply) == 4128 + 16 + 5
    # A small model: the margin is the 1 MiB floor. A large one: 10 % of its bytes.
    assert reply_limit(_record(1000)) == 4128 + REPLY_MARGIN_BYTES
    assert reply_limit(_record(10_000_000)) == 40_000_128 + 4_000_012


def test_oversized_reason_names_the_sizes():
    limit = reply_limit(_record(1000))
    # The limit is _npy(1000) + 2**20 = 4 * (1000 + 2**18) + 128: a reply of 2**18 more
    # floats fits exactly; one more float does not.
    _, fits = _reply(_record(1000 + REPLY_MARGIN_BYTES // 4))
    assert reply_bytes(fits) == limit
    assert oversized_reason(fits, limit) == ""
    _, big = _reply(_record(1000 + REPLY_MARGIN_BYTES // 4 + 1))
    size = _npy(1001 + REPLY_MARGIN_BYTES // 4)
    assert oversized_reason(big, limit) == (
        f"rejected: reply of {size} bytes exceeds the {limit} bytes a reply may hold (the "
        f"global model's arrays plus a margin of 10%, at least {REPLY_MARGIN_BYTES} bytes)"
    )


class _PullGrid:
    """A grid with Flower's push/pull calls: every message answered at the first pull."""

    def __init__(self, answers):
        self.answers = answers  # node -> the reply content to send
        self.sent = {}

    def push_messages(self, messages):
        ids = []
        for i, message in enumerate(messages):
            message.metadata.__dict__["_message_id"] = f"m{i}"
            self.sent[f"m{i}"] = message
            ids.append(f"m{i}")
        return ids

    def pull_messages(self, ids):
        replies = [
            Message(self.answers[self.sent[i].metadata.dst_node_id], reply_to=self.sent[i])
            for i in ids
        ]
        return replies

    def get_node_ids(self):
        return list(self.answers)


def test_a_pulled_reply_over_the_limit_becomes_an_error_reply():
    small = RecordDict({"arrays": _record(10), "metrics": MetricRecord({"num-examples": 1})})
    big = RecordDict({"arrays": _record(10 + REPLY_MARGIN_BYTES), "metrics": MetricRecord()})
    grid = _PullGrid({1: small, 2: big})
    messages = [Message(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2)]
    limit = reply_limit(_record(10))
    replies = send_and_receive(
        grid, messages, timeout=1.0, screen=lambda r: oversized_reason(r, limit)
    )
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert not by_node[1].has_error()
    assert by_node[2].has_error()
    big_size = _npy(10 + REPLY_MARGIN_BYTES)
    assert by_node[2].error.reason.startswith(f"rejected: reply of {big_size} bytes")
    assert by_node[2].metadata.reply_to_message_id == "m1"


class _BigReplyGrid(InProcessGrid):
    """Node BIG adds an extra 2 MiB array to every train reply."""

    def _answer(self, message, context):
        reply = super()._answer(message, context)
        if message.metadata.dst_node_id == BIG and message.metadata.message_type == "train":
            reply.content[keys.ARRAYS]["extra"] = Array(np.zeros(1 << 19, dtype=np.float32))
        return reply


def _run(tmp_path, **overrides):
    config = run_config(**{"output-dir": str(tmp_path), "num-server-rounds": 1, **overrides})
    run_server(config, _BigReplyGrid(config, NODES))
    (path,) = list(tmp_path.iterdir())
    return path


def test_an_oversized_reply_is_refused_and_recorded(tmp_path, caplog):
    path = _run(tmp_path)
    rows = pd.read_csv(path / "participation.csv").set_index("node-id")
    assert rows.loc[BIG, "error"].startswith("rejected: reply of ")
    assert "exceeds the" in rows.loc[BIG, "error"]
    assert not rows.loc[BIG, "replied"]
    assert rows.drop(index=BIG)["replied"].all()
    assert f"node {BIG}: rejected: reply of" in caplog.text
    assert (path / "model.pt").exists()


@pytest.mark.parametrize("privacy", ["dp-fedavg-fixed"])
def test_under_dp_an_oversized_reply_is_a_zero_update(tmp_path, caplog, privacy):
    dp = {"dp.num-sampled-clients": 4, "dp.sampling": "fixed", "dp.clip-norm": 0.5}
    path = _run(tmp_path, privacy=privacy, **dp)
    rows = pd.read_csv(path / "curator" / "participation.csv").set_index("node-id")
    assert rows.loc[BIG, "error"].startswith("rejected: reply of ")
    assert f"node {BIG} counts as a zero update" in caplog.text


def test_the_limit_follows_the_largest_record_a_message_carries():
    # A message that carries more than the global model (e.g. the model and a basis):
    # a reply of that size fits; one the margin above it does not.
    from server_app.rounds import _exchange

    carried = _record(10 + REPLY_MARGIN_BYTES)
    fits = RecordDict({"arrays": carried, "metrics": MetricRecord({"num-examples": 1})})
    over = RecordDict({"arrays": _record(10 + REPLY_MARGIN_BYTES // 2 * 3)})
    grid = _PullGrid({1: fits, 2: over})
    messages = [
        Message(RecordDict({"arrays": carried}), dst_node_id=n, message_type="train")
        for n in (1, 2)
    ]
    replies = _exchange(grid, messages, 1.0, "round 1 train", _record(10))
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert not by_node[1].has_error()
    assert by_node[2].has_error() and "exceeds the" in by_node[2].error.reason
