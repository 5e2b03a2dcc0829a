"""What strategies do with the replies of a round: screen them, average their metrics."""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log

from protocol import keys
from protocol.records import InvalidReply, to_record
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
) -> list[tuple[Message, list[np.ndarray]]]:
    """The replies that pass :func:`protocol.replies.check_reply`, each with its arrays
    as the check decoded them (key order); each other one is logged with its reason
    (``who`` names the strategy)."""
    valid = []
    for message in replies:
        try:
            arrays, _ = check_reply(message, reference)
        except InvalidReply as err:
            log(
                WARNING,
                "%s: reply of node %d rejected, not aggregated: %s",
                who,
                message.metadata.src_node_id,
                err,
            )
            continue
        valid.append((message, arrays))
    return valid


def fedavg_arrays(
    screened: list[tuple[Message, list[np.ndarray]]], weighted_by_key: str, reference: ArrayRecord
) -> ArrayRecord:
    """The weighted mean of the screened replies' arrays (:func:`screen_replies`), as
    Flower's FedAvg computes it (``flwr.serverapp.strategy.strategy_utils.
    aggregate_arrayrecords``: weights ``w / sum(w)`` from each reply's MetricRecord,
    products summed in reply order, so the result is bit for bit the same), in
    ``reference``'s keys and dtypes.

    Written here because Flower's decodes every array of every reply again with
    ``np.load`` (which parses each header with ``literal_eval``), after the screening
    has decoded them once, and its float64 averages of integer arrays are decoded once
    more to restore the dtypes; at 50 clients per round that was most of the server's
    time per reply (``bench/vs_flower.py``).
    """
    weights = [
        float(next(iter(message.content.metric_records.values()))[weighted_by_key])
        for message, _ in screened
    ]
    total = sum(weights)
    sums: list[np.ndarray] = []
    for (_, arrays), weight in zip(screened, weights, strict=True):
        factor = weight / total
        if not sums:
            sums = [array * factor for array in arrays]
        else:
            for i, array in enumerate(arrays):
                sums[i] += array * factor  # by index: a 0-d product is a NumPy scalar
    return to_record(reference, sums)
