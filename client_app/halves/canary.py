"""Audit canaries, client half: a canary node replies its own update (:mod:`client_app.canary`).

It replies without training when the config lets clients report nothing training
computes, and evaluates with weight 0 (``num-examples = 0``).
"""

from __future__ import annotations

from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from client_app import canary
from client_app.halves import ClientHalf, Round
from client_app.node import node_partition
from protocol import keys
from protocol.records import to_record


def canary_of(context: Context) -> int | None:
    """This node's canary index, or None for a real client."""
    pid, num = node_partition(context.node_config)
    return canary.canary_index(context.run_config, pid, num)


def canary_reply(msg: Message, context: Context, index: int, metrics: dict) -> Message:
    """Canary ``index``'s train reply: the received model plus its update (a held-out
    canary that must be absent: an error reply, :func:`canary.absent_when_held_out`)."""
    received, config = msg.content[keys.ARRAYS], msg.content[keys.CONFIG]
    arrays, inserted = canary.update(received, config, context.run_config, index)
    if not inserted and canary.absent_when_held_out(config, context.run_config):
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=canary.HELD_OUT)
        return Message(error, reply_to=msg)
    content = RecordDict({keys.ARRAYS: to_record(received, arrays)})
    content[keys.METRICS] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


class CanaryHalf(ClientHalf):
    """The canary's update replaces the model it trained (if it trained at all)."""

    def without_training(self, msg: Message, context: Context) -> Message | None:
        if not canary.reports_nothing_trained(msg.content[keys.CONFIG]):
            return None
        return canary_reply(msg, context, canary_of(context), {keys.NUM_EXAMPLES: 1})

    def reply(self, r: Round, metrics: dict[str, float], local) -> Message:
        return canary_reply(r.msg, r.context, canary_of(r.context), metrics)

    def evaluated(self, r: Round, metrics: dict[str, float]) -> None:
        metrics[keys.NUM_EXAMPLES] = 0
