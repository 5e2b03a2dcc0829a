"""The round loop's per-client participation rows."""

from __future__ import annotations

from server_app.rounds import participation
from tests.fakes import error_from, instruction, reply_from


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
