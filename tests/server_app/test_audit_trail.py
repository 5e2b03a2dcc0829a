"""The participation record says what became of every reply: a reply rejected by the
checks is recorded as rejected with its reason and without its metrics, a clipped
weight is noted, and the round's train metrics are those of the aggregated replies,
each key divided by the weight of the replies that report it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from flwr.app import Array, ArrayRecord, Message

from protocol import keys
from server_app.rounds import participation
from tests.fakes import instruction, reply_from
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")


def test_participation_records_each_rejection_with_its_reason_and_no_metrics():
    sent = [instruction({"w": [0.0, 0.0]}, {}, node_id=n) for n in (1, 2, 3, 4, 5)]
    metrics = {"num-examples": 10, "train-loss": 0.5}
    float32 = reply_from(2, None, metrics)
    float32.content[keys.ARRAYS] = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    replies = [
        reply_from(1, {"w": [0.0, 0.0, 0.0]}, metrics),  # wrong shape
        float32,  # wrong dtype
        reply_from(3, {"w": [0.0, 0.0], "extra": [1.0]}, metrics),  # an extra array
        reply_from(4, {"w": [0.0, 0.0]}, {"num-examples": -5, "train-loss": 0.5}),
        reply_from(5, {"w": [1.0, 1.0]}, metrics),
    ]
    rows = participation(1, sent, replies)
    assert [(r["node-id"], r["replied"]) for r in rows] == [(n, True) for n in (1, 2, 3, 4, 5)]
    errors = [r["error"] for r in rows]
    assert errors[0] == "rejected: array 'w' has shape (3,)/float64, expected (2,)/float64"
    assert errors[1] == "rejected: array 'w' has shape (2,)/float32, expected (2,)/float64"
    assert errors[2] == "rejected: array keys differ from the global model's"
    assert errors[3] == "rejected: 'num-examples' = -5 is not a valid weight"
    assert errors[4] == ""
    assert all("train-loss" not in r for r in rows[:4])  # never mixed into anything
    assert rows[4]["train-loss"] == 0.5 and "note" not in rows[4]


def test_the_strategys_verdicts_come_first():
    sent = [instruction({"w": [0.0]}, {}, node_id=n) for n in (1, 2)]
    replies = [reply_from(n, {"w": [1.0]}, {"num-examples": 7}) for n in (1, 2)]
    notes = {1: "weight clipped: 'num-examples' = 7 above its partition's size 5", 2: ""}
    rows = participation(1, sent, replies, notes=notes)
    assert rows[0]["note"].startswith("weight clipped") and rows[0]["error"] == ""
    assert rows[0]["num-examples"] == 7  # what the client sent
    assert "note" not in rows[1]


class HostileGrid(InProcessGrid):
    """Node 1 replies float64 arrays, node 2 a negative weight, node 3 a huge weight and
    no train-loss; nodes 4 and 5 are honest."""

    def _answer(self, message: Message, context) -> Message:
        reply = super()._answer(message, context)
        if message.metadata.message_type != "train" or reply.has_error():
            return reply
        node, metrics = message.metadata.dst_node_id, reply.content[keys.METRICS]
        if node == 1:
            arrays = reply.content[keys.ARRAYS]
            reply.content[keys.ARRAYS] = ArrayRecord(
                {k: Array(arrays[k].numpy().astype(np.float64)) for k in arrays}
            )
        elif node == 2:
            metrics[keys.NUM_EXAMPLES] = -5
        elif node == 3:
            metrics[keys.NUM_EXAMPLES] = 999_999_999
            if keys.TRAIN_LOSS in metrics:  # under DP the client reports none
                del metrics[keys.TRAIN_LOSS]
        return reply


def _table(run_dir: Path, name: str) -> pd.DataFrame:
    """``name``, under ``curator/`` in a privacy run (what no epsilon covers)."""
    curator = run_dir / "curator" / name
    return pd.read_csv(curator if curator.exists() else run_dir / name)


@pytest.mark.parametrize("privacy", ["none", "dp-fedavg-fixed"])
def test_a_hostile_round_is_recorded_as_aggregated(tmp_path, privacy):
    config = run_config(
        **{
            "privacy": privacy,
            "output-dir": str(tmp_path),
            "num-server-rounds": 1,
            "fraction-train": 1.0,
            "min-train-nodes": 5,
            "min-available-nodes": 5,
            "fraction-evaluate": 0.0,
            "dp.num-sampled-clients": 5,
            "dp.sampling": "fixed",
        }
    )
    run_server(config, HostileGrid(config, [1, 2, 3, 4, 5]))
    (run_dir,) = list(tmp_path.iterdir())
    rows = _table(run_dir, "participation.csv").set_index("node-id")
    assert rows["replied"].all()
    assert rows.loc[1, "error"].startswith("rejected: array ")
    assert "expected" in rows.loc[1, "error"] and "float32" in rows.loc[1, "error"]
    assert rows.loc[2, "error"] == "rejected: 'num-examples' = -5 is not a valid weight"
    assert rows.loc[[1, 2], "num-examples"].isna().all()  # their metrics are not recorded
    assert rows.loc[[3, 4, 5], "num-examples"].notna().all()
    assert rows.loc[[3, 4, 5], "error"].isna().all()
    metrics = _table(run_dir, "metrics.csv")
    train = metrics[metrics["scope"] == "train"].iloc[0]
    honest = rows.loc[[4, 5]]
    if privacy == "none":
        assert rows.loc[3, "note"].startswith("weight clipped: 'num-examples' = 1e+09 above")
        # train-loss: the honest two only (node 3 sent none), by their num-examples
        expected = np.average(honest["train-loss"], weights=honest["num-examples"])
        assert train["train-loss"] == pytest.approx(expected)
    else:  # DP-FedAvg: the two count as zero updates; no weights, no client metrics
        assert "note" not in rows or rows["note"].isna().all()
        assert train["dp-failed-clients"] == 2
