"""SecAgg+ replies screened for size and shape at every stage: a node whose key,
ciphertext or masked-vector reply is oversized or malformed is dropped at that stage
with its reason (the protocol removes its masks: the sum is the others'), a malformed
unmask reply contributes no shares; the participation record says why."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from protocol.masking import MASKED
from server_app.rounds import participation
from strategies.runtime.partitions import PartitionMap
from strategies.secure.secagg_plus import MAX_KEY_BYTES
from tests.inprocess import InProcessGrid, run_config, run_server
from tests.strategies.secure.test_secagg import DIM, ModGrid, _expected, _plain, _run, _updates

NODES = [11, 22, 33, 44, 55]
BAD = 33


class TamperGrid(ModGrid):
    """``ModGrid`` whose node ``BAD`` has its reply of ``stage`` rewritten by ``change``."""

    def __init__(self, updates, stage: str, change) -> None:
        super().__init__(updates)
        self.stage, self.change = stage, change

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        stage = messages[0].content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
        for reply in replies:
            if reply.metadata.src_node_id == BAD and stage == self.stage:
                self.change(reply)
        return replies


def _set(key, value):
    def change(reply: Message) -> None:
        reply.content.config_records[RECORD_KEY_CONFIGS][key] = value

    return change


def _extra_array(reply: Message) -> None:  # 2 MB beside the masked vector
    reply.content["extra"] = ArrayRecord({"x": Array(np.zeros(500_000, np.float32))})


def _extra_metrics(reply: Message) -> None:
    reply.content["metrics"] = MetricRecord({"num-examples": 10**9})


def _wrong_dtype(reply: Message) -> None:
    masked = reply.content[MASKED][MASKED].numpy()
    reply.content[MASKED] = ArrayRecord({MASKED: Array(masked.astype(np.float64))})


@pytest.mark.parametrize(
    ("stage", "change", "words"),
    [
        (Stage.SETUP, _set(Key.PUBLIC_KEY_1, b"k" * (MAX_KEY_BYTES + 1)), "at most 1024 bytes"),
        (Stage.SETUP, _set(Key.PUBLIC_KEY_2, b"-----BEGIN PUBLIC KEY-----"), "not a public key"),
        (Stage.SHARE_KEYS, _set(Key.DESTINATION_LIST, [11, 22]), "different lengths"),
        (Stage.SHARE_KEYS, _set(Key.CIPHERTEXT_LIST, [b"c" * 5000] * 4), "at most 4096"),
        (Stage.COLLECT_MASKED_VECTORS, _extra_array, "exceeds the"),
        (Stage.COLLECT_MASKED_VECTORS, _extra_metrics, "not all the reply holds"),
        (Stage.COLLECT_MASKED_VECTORS, _wrong_dtype, "no masked vector of 601 uint32"),
    ],
)
def test_a_malformed_reply_drops_its_node_at_that_stage(stage, change, words):
    grid = TamperGrid(_updates(NODES), stage, change)

    result = _run(grid)

    survivors = [n for n in NODES if n != BAD]
    assert result.survivors == survivors and result.dropped == [BAD]
    assert result.reasons[BAD].startswith(f"SecAgg+ {stage}: rejected: ")
    assert words in result.reasons[BAD]
    assert set(result.reasons) == {BAD}
    # The others' sum, within the quantization error: the dropped node's masks are gone.
    error = np.max(np.abs(_plain().decode(result.vector) - _expected(grid.updates, survivors)))
    assert error <= _plain().max_error(len(survivors), DIM + 1)


def test_a_malformed_unmask_reply_gives_no_shares_and_is_noted():
    # Shares of a node that is not its neighbour... here every node is one (SecAgg): a
    # share list longer than the node list is malformed instead.
    grid = TamperGrid(_updates(NODES), Stage.UNMASK, _set(Key.SHARE_LIST, [b"s"] * 9))

    result = _run(grid)

    # Four of five shares of each secret remain, t = 3: the sum of all five is unmasked.
    assert result.survivors == NODES
    assert result.reasons == {
        BAD: "SecAgg+ unmask: rejected: node and share lists of different lengths, or a node twice"
    }
    error = np.max(np.abs(_plain().decode(result.vector) - _expected(grid.updates, NODES)))
    assert error <= _plain().max_error(len(NODES), DIM + 1)


def test_the_participation_record_gives_a_dropped_nodes_reason():
    sent = [Message(_content(), dst_node_id=n, message_type="train") for n in (1, 2)]
    reply = Message(_content(MetricRecord({"num-examples": 1})), reply_to=sent[0])
    reply.metadata.__dict__["_src_node_id"] = 1  # as if node 1 had sent it
    notes = {2: "SecAgg+ collect: rejected: too big"}

    rows = participation(1, sent, [reply], PartitionMap(), notes, check=False)

    assert [(r["node-id"], r["replied"], r["error"]) for r in rows] == [
        (1, True, ""),
        (2, False, "SecAgg+ collect: rejected: too big"),
    ]


def _content(metrics: MetricRecord | None = None) -> RecordDict:
    content = RecordDict({"config": ConfigRecord({})})
    if metrics is not None:
        content["metrics"] = metrics
    return content


class BulkyGrid(InProcessGrid):
    """The real ClientApps; the first node's collect reply carries a 2 MB extra array."""

    def _answer(self, message: Message, context) -> Message:
        reply = super()._answer(message, context)
        stage = message.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
        if stage == Stage.COLLECT_MASKED_VECTORS and message.metadata.dst_node_id == 1:
            _extra_array(reply)
        return reply


@pytest.mark.slow  # a whole private secure run: about 10 s of CPU
def test_a_private_secure_run_records_the_refused_reply_in_the_curators_record(tmp_path):
    cfg = run_config(
        **{
            "output-dir": str(tmp_path),
            "num-server-rounds": 1,
            "secagg.enabled": True,
            "privacy": "dp-fedavg-fixed",
            "dp.sampling": "fixed",
            "dp.num-sampled-clients": 4,
            "dp.noise-multiplier": 1.0,
            "dp.clip-norm": 0.5,
            "min-available-nodes": 4,
        }
    )
    run_server(cfg, BulkyGrid(cfg, [1, 2, 3, 4]))

    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = pd.read_csv(run_dir / "curator" / "participation.csv").set_index("node-id")
    assert not rows.loc[1, "replied"]
    assert rows.loc[1, "error"].startswith("SecAgg+ collect_masked_vectors: rejected: reply of ")
    assert rows.loc[[2, 3, 4], "replied"].all()
