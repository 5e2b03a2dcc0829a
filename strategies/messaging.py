"""Sending messages and collecting the replies, with a short poll for replies.

Flower's ``Grid.send_and_receive`` pushes the messages and then polls the SuperLink
for replies at a fixed interval: 0.1 s in the simulation engine (``InMemoryGrid``), 3 s
on a deployed SuperLink (``GrpcGrid``). A round whose clients need 20 ms then still
takes up to one whole interval longer; on digits with 10 clients per round that was
most of the round (``bench/orchestration.py``). :func:`send_and_receive` uses the same
two public calls, ``push_messages`` and ``pull_messages``, polling first after
``first_poll`` seconds and backing off to ``max_poll``, so short rounds return soon
and long ones cost the SuperLink a pull every ``max_poll`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message

FIRST_POLL = 0.002  # seconds before the first pull
MAX_POLL = 0.5  # the longest wait between two pulls
BACKOFF = 1.5  # each wait is this much longer than the previous one


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
    pending = set(grid.push_messages(messages))
    deadline = None if timeout is None else time.monotonic() + timeout
    wait, replies = first_poll, []
    while pending:
        got = list(grid.pull_messages(pending))
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
