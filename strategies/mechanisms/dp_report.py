"""What DP-FedAvg reads from the replies and what it logs of itself.

:func:`contributions` turns the sampled clients' replies into their released deltas (a
client without a valid reply counts as a zero update); :func:`log_summary` states the
wrapper's settings at the start of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log

from protocol import keys
from protocol.records import InvalidReply

Check = Callable[[Message, ArrayRecord], tuple[list[np.ndarray], MetricRecord]]


def contributions(
    replies: Iterable[Message],
    sent: list[int],
    reference_of: Callable[[int], tuple[ArrayRecord, list[np.ndarray]]],
    check: Check,
    select: Callable[[list[np.ndarray]], list[np.ndarray]],
) -> tuple[dict[int, list[np.ndarray]], list[MetricRecord], list[int]]:
    """(node -> released delta of its valid reply, their metrics weighted 1, the sampled
    nodes counted as a zero update), in the order of ``sent``. ``reference_of`` gives the
    model a node was sent, as a record and as arrays; ``check`` validates a reply;
    ``select`` keeps the released arrays of a delta."""
    by_node: dict[int, Message] = {}
    for reply in replies:
        by_node.setdefault(reply.metadata.src_node_id, reply)
    deltas, records, failed = {}, [], []
    for node in sent:
        current, reference = reference_of(node)
        message = by_node.get(node)
        try:
            if message is None:
                raise InvalidReply("no reply")
            received, metrics = check(message, current)
        except InvalidReply as err:
            failed.append(node)
            log(WARNING, "DP-FedAvg: node %d counts as a zero update: %s", node, err)
            continue
        deltas[node] = select([r - c for r, c in zip(received, reference, strict=True)])
        metrics[keys.NUM_EXAMPLES] = 1.0
        records.append(metrics)
    return deltas, records, failed


def log_summary(dp) -> None:
    """Log the settings of ``dp`` (a :class:`~strategies.mechanisms.dp_fedavg.DPFedAvgFixed`)."""
    log(INFO, "\t├──> DP-FedAvg (%s):", type(dp).__name__)
    log(
        INFO,
        "\t│\t├── clip norm C = %g, noise multiplier z = %s",
        dp.clip_norm,
        f"{dp.noise_multiplier:g}"
        if dp.noise_multiplier is not None
        else f"calibrated in round 1 to epsilon {dp.target_epsilon:g}",
    )
    log(
        INFO,
        "\t│\t├── m = %d clients per round (%s), noise added by the %s",
        dp.num_sampled_clients,
        "expected, Poisson" if dp.ledger.sampling == "poisson" else "exactly",
        dp.site.name,
    )
    log(
        INFO,
        "\t│\t└── accounting: %s, sampling %s, delta %g, max epsilon %s",
        dp.ledger.accountant,
        dp.ledger.sampling,
        dp.ledger.target_delta,
        dp.ledger.max_epsilon or "none",
    )
    if dp.divergence is not None:
        dp.divergence.summary()
    if dp.uploads is not None:
        dp.uploads.summary(dp)
