"""What strategies do with the replies of a round: screen them, average their metrics."""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log

from protocol import keys
from protocol.records import InvalidReply
from protocol.replies import check_reply, is_number


def weighted_metrics(records: list[MetricRecord]) -> MetricRecord:
    """The ``num-examples``-weighted mean of every scalar metric all ``records`` report
    (unweighted when the weights sum to 0); ``num-examples`` itself is left out.

    Unlike Flower's ``aggregate_metricrecords``, a key only some replies report is left
    out rather than summed over those replies alone.
    """
    if not records:
        return MetricRecord({})
    weights = np.asarray([float(r[keys.NUM_EXAMPLES]) for r in records])
    if not weights.sum() > 0:
        weights = np.ones(len(records))
    common = set.intersection(*(set(r.keys()) for r in records)) - {keys.NUM_EXAMPLES}
    scalar = [k for k in sorted(common) if all(is_number(r[k]) for r in records)]
    return MetricRecord(
        {k: float(weights @ [float(r[k]) for r in records] / weights.sum()) for k in scalar}
    )


def screen_replies(
    replies: Iterable[Message], reference: ArrayRecord, *, who: str
) -> list[Message]:
    """The replies that pass :func:`protocol.replies.check_reply`; each other one is
    logged with its reason (``who`` names the strategy)."""
    valid = []
    for message in replies:
        try:
            check_reply(message, reference)
        except InvalidReply as err:
            log(
                WARNING,
                "%s: reply of node %d rejected, not aggregated: %s",
                who,
                message.metadata.src_node_id,
                err,
            )
            continue
        valid.append(message)
    return valid
