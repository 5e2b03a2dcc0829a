"""Sending messages and collecting the replies, with a short poll for replies.

Flower's ``Grid.send_and_receive`` pushes the messages and then polls the SuperLink
for replies at a fixed interval: 0.1 s in the simulation engine (``InMemoryGrid``), 3 s
on a deployed SuperLink (``GrpcGrid``). A round whose clients need 20 ms then still
takes up to one whole interval longer; on digits with 10 clients per round that was
most of the round (``bench/vs_flower.py orchestration``). :func:`send_and_receive` uses the same
two public calls, ``push_messages`` and ``pull_messages``, polling first after
``first_poll`` seconds and backing off by 10 % per pull up to ``max_poll``: a reply is
seen at most about a tenth of the time waited so far after it arrived (a 0.15 s round
waits ~15 ms more, not up to 0.1 s), and a long round costs the SuperLink a pull every
``max_poll`` seconds.

Design notes: ``docs/notes.md``, ``strategies.runtime.messaging``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, Error, Message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.logger import log

from protocol.records import records
from protocol.replies import oversized_reason, reply_limit

FIRST_POLL = 0.002  # seconds before the first pull
MAX_POLL = 0.5  # the longest wait between two pulls, on a deployed SuperLink
SIMULATION_MAX_POLL = 0.05  # ... and in Flower's simulation, where a pull is in-process
BACKOFF = 1.1  # each wait is this much longer than the previous one
MAX_PULL_SHARE = 0.1  # the share of a core that pulls for replies use, at most
PROGRESS_EVERY_S = 10.0  # a line while replies are awaited this long (start-up: 35-55 s)


def send_and_receive(
    grid,
    messages: Iterable[Message],
    *,
    timeout: float | None,
    first_poll: float = FIRST_POLL,
    max_poll: float | None = None,
    screen: Callable[[Message], str] | None = None,
) -> list[Message]:
    """Push ``messages`` and return the replies that arrive within ``timeout`` seconds
    (``None``: wait for all of them), as ``Grid.send_and_receive`` does. ``max_poll``
    (``None``: by the grid, :data:`SIMULATION_MAX_POLL` in a simulation, else
    :data:`MAX_POLL`) caps the wait between two pulls, unless the last pull that found
    nothing used more CPU time than :data:`MAX_PULL_SHARE` of that wait.

    ``screen(reply)``: why a reply is refused ("": it is not); a refused reply becomes
    an error reply with that reason (module docstring).

    A grid without ``push_messages``/``pull_messages`` (a test double) is asked with
    its own ``send_and_receive``.
    """
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        messages = list(messages)
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        if screen is None:
            return replies
        by_node = {m.metadata.dst_node_id: m for m in messages}
        return [_screened(r, by_node.get(r.metadata.src_node_id), screen) for r in replies]
    if max_poll is None:
        max_poll = SIMULATION_MAX_POLL if is_simulation_grid(grid) else MAX_POLL
    messages = list(messages)
    pushed = list(grid.push_messages(messages))
    dst_of = dict(zip(pushed, messages, strict=False))
    pending = set(pushed)
    deadline = None if timeout is None else time.monotonic() + timeout
    wait, replies, polling = first_poll, [], 0.0
    begun = said = time.monotonic()
    while pending:
        started = time.thread_time()
        got = [
            _screened(_attributed(reply, dst_of), dst_of.get(reply.metadata.reply_to_message_id),
                      screen)
            for reply in grid.pull_messages(pending)
        ]  # fmt: skip
        if not got:  # what asking costs (a pull that brought replies spent on them)
            polling = time.thread_time() - started
        replies += got
        pending -= {reply.metadata.reply_to_message_id for reply in got}
        if not pending:
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        # The floor is the last empty pull's cost, not the schedule's: one costly
        # pull lengthens the waits until a cheaper one.
        if time.monotonic() - said >= PROGRESS_EVERY_S:  # e.g. ClientApps starting
            said = time.monotonic()
            waited = f"{len(replies)} of {len(pushed)} after {said - begun:.0f} s"
            log(
                INFO, "Waiting for replies: %s (a ClientApp starts with its first message)", waited
            )
        nap = max(wait, polling * (1 / MAX_PULL_SHARE - 1))
        time.sleep(nap if left is None else min(nap, left))
        wait = min(wait * BACKOFF, max_poll)
    return replies


def size_screen(messages: Iterable[Message]) -> Callable[[Message], str]:
    """The ``screen`` of replies to ``messages``: one larger than the largest ArrayRecord
    a message carries (none: no arrays) plus the margin of
    :func:`protocol.replies.reply_limit` is refused with the reason."""
    sent = [r for m in messages for r in records(m.content, ArrayRecord).values()]
    limit = max(reply_limit(r) for r in [ArrayRecord(), *sent])
    return lambda reply: oversized_reason(reply, limit)


def is_simulation_grid(grid) -> bool:
    """Whether ``grid`` is Flower's simulation grid (``InMemoryGrid``: the ServerApp
    reads the engine's LinkState in its own process), by name: Flower keeps the class
    in an internal module (``flwr.superlink.grid``)."""
    return type(grid).__name__ == "InMemoryGrid"


def _screened(
    reply: Message, sent: Message | None, screen: Callable[[Message], str] | None
) -> Message:
    """``reply``, or an error reply to ``sent`` with the reason ``screen`` refuses it."""
    if screen is None or sent is None or reply.has_error():
        return reply
    reason = screen(reply)
    if not reason:
        return reply
    log(WARNING, "node %d: %s", sent.metadata.dst_node_id, reason)
    error = Message(Error(code=ErrorCode.UNKNOWN, reason=reason), reply_to=sent)
    error.metadata.__dict__["_reply_to_message_id"] = reply.metadata.reply_to_message_id
    return error


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
