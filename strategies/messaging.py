"""Sending messages and collecting the replies, with a short poll for replies.

Flower's ``Grid.send_and_receive`` pushes the messages and then polls the SuperLink
for replies at a fixed interval: 0.1 s in the simulation engine (``InMemoryGrid``), 3 s
on a deployed SuperLink (``GrpcGrid``). A round whose clients need 20 ms then still
takes up to one whole interval longer; on digits with 10 clients per round that was
most of the round (``bench/orchestration.py``). :func:`send_and_receive` uses the same
two public calls, ``push_messages`` and ``pull_messages``, polling first after
``first_poll`` seconds and backing off by 10 % per pull up to ``max_poll``: a reply is
seen at most about a tenth of the time waited so far after it arrived (a 0.15 s round
waits ~15 ms more, not up to 0.1 s), and a long round costs the SuperLink a pull every
``max_poll`` seconds.

The SuperLink answers a message to a node that went offline itself, with an error
reply whose sender is the SuperLink (``SUPERLINK_NODE_ID`` = 1). Such a reply is
attributed here to the node the message was sent to, so that logs, participation
tables and strategies name the dead node, not "node 1".
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID

FIRST_POLL = 0.002  # seconds before the first pull
MAX_POLL = 0.5  # the longest wait between two pulls
BACKOFF = 1.1  # each wait is this much longer than the previous one


def send_and_receive(
    grid,
    messages: Iterable[Message],
    *,
    timeout: float | None,
    first_poll: float = FIRST_POLL,
    max_poll: float = MAX_POLL,
) -> list[Message]:
    """Push ``messages`` and return the replies that arrive within ``timeout`` seconds
    (``None``: wait for all of them), as ``Grid.send_and_receive`` does.

    A grid without ``push_messages``/``pull_messages`` (a test double) is asked with
    its own ``send_and_receive``.
    """
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        return list(grid.send_and_receive(messages, timeout=timeout))
    messages = list(messages)
    pushed = list(grid.push_messages(messages))
    dst_of = dict(zip(pushed, messages, strict=False))
    pending = set(pushed)
    deadline = None if timeout is None else time.monotonic() + timeout
    wait, replies = first_poll, []
    while pending:
        got = [_attributed(reply, dst_of) for reply in grid.pull_messages(pending)]
        replies += got
        pending -= {reply.metadata.reply_to_message_id for reply in got}
        if not pending:
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        time.sleep(wait if left is None else min(wait, left))
        wait = min(wait * BACKOFF, max_poll)
    return replies


def _attributed(reply: Message, sent: dict) -> Message:
    """``reply``, with the SuperLink's own error reply attributed to the node the
    message it answers went to (Flower sets no setter: its own code writes the
    metadata's ``__dict__`` the same way)."""
    metadata = reply.metadata
    if getattr(metadata, "src_node_id", None) == SUPERLINK_NODE_ID:
        message = sent.get(metadata.reply_to_message_id)
        if message is not None:
            metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
    return reply
