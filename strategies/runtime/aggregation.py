"""What strategies do with the replies of a round: screen them, bound their weights,
aggregate their arrays (the mean or a Byzantine-robust rule) and average their metrics.

The robust rules reuse Flower's own aggregation functions (``flwr.serverapp.strategy``:
FedMedian's coordinate-wise median, FedTrimmedAvg's ``trim_mean``, MultiKrum's
``select_multikrum``, Bulyan's ``aggregate_n_closest_weights``) on the arrays the
screening decoded; rationale and numbers in docs/robustness.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from config.settings import Choice, Settings, SettingsError, listed, setting
from protocol import keys
from protocol.records import InvalidReply, as_float, records, to_numpy, to_record
from protocol.replies import check_reply, is_number
from strategies.secure.secagg_plus import SecAggSettings

RULES = ("mean", "median", "trimmed-mean", "krum", "multi-krum", "bulyan")
# Strategies whose aggregate is one (weighted) mean of the replies' models, which a
# robust rule can replace; the others aggregate by their own structure.
ROBUST_STRATEGIES = ("fedavg", "fedprox")
# No reply within this multiple of the round's median weight is clipped (partition
# sizes of a label-skewed split vary that much between honest clients).
MEDIAN_FLOOR = 2.0
# Privacy under which the server averages the clients' models as sent: none, and DP-SGD
# (each client's model is already private; any aggregate of them is post-processing).
ROBUST_PRIVACY = ("none", "dp-sgd")


@dataclass(frozen=True)
class AggregationSettings(Settings):
    """How the server combines a round's replies (``aggregation.*``)."""

    PREFIX: ClassVar[str] = "aggregation"
    rule: str = setting(
        "mean",
        "Aggregation of the round's models (fedavg, fedprox): `mean` (example-weighted), "
        "or a Byzantine-robust rule on Flower's functions: `median` (coordinate-wise, "
        "FedMedian), `trimmed-mean` (FedTrimmedAvg), `krum`, `multi-krum`, `bulyan`.",
        choices=RULES,
    )
    trim_fraction: float = setting(
        0.2,
        "trimmed-mean: share of the replies cut at each end of every coordinate "
        "(Flower's FedTrimmedAvg beta).",
        low=0.0,
        high=0.5,
        high_open=True,
    )
    num_byzantine: int = setting(
        2,
        "krum, multi-krum, bulyan: the number f of Byzantine replies per round to resist "
        "(bulyan needs at least 4f + 3 replies).",
        low=0,
    )
    num_selected: int = setting(
        0,
        "multi-krum: replies averaged after the selection (0: n - f).",
        low=0,
    )
    max_weight_share: float = setting(
        0.2,
        "Most of a round one reply s may weigh when the server knows no partition size "
        "for it: its num-examples is clipped to max(2, s(n-1)/(1-s)) times the round's "
        "median weight (n >= 3 replies); 1 disables the cap.",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    max_update_norm: float = setting(
        2.0,
        "rule mean: a reply's update (its model minus the global one) is clipped to this "
        "multiple of the round's median update norm (n >= 3 replies); 0 disables the clip.",
        low=0.0,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """A robust rule replaces the mean of fedavg/fedprox, without DP or SecAgg+."""
        rule = choice.part(AggregationSettings).rule
        if rule == "mean":
            return
        if choice.strategy not in ROBUST_STRATEGIES:
            raise SettingsError(
                f"'aggregation.rule' = {rule!r} needs 'strategy' in "
                f"{listed(ROBUST_STRATEGIES)} (one mean of the clients' models); "
                f"'strategy' = {choice.strategy!r} aggregates by its own structure"
            )
        if choice.privacy not in ROBUST_PRIVACY:
            raise SettingsError(
                f"'aggregation.rule' = {rule!r} cannot run with 'privacy' = "
                f"{choice.privacy!r}: the mechanism's sensitivity is that of the clipped "
                "mean; a robust aggregate would need its own sensitivity analysis "
                f"(valid: 'privacy' in {listed(ROBUST_PRIVACY)})"
            )
        if SecAggSettings.on_in(choice):
            raise SettingsError(
                f"'aggregation.rule' = {rule!r} cannot run with 'secagg.enabled' = true: "
                "the server sees only the sum of the updates"
            )


def weighted_metrics(records: list[MetricRecord]) -> MetricRecord:
    """The ``num-examples``-weighted mean of every numeric metric (scalar, or list of
    one length) over the records that report it, divided by the weight of those
    records alone (unweighted when it is 0); ``num-examples`` itself is left out.

    Flower's ``aggregate_metricrecords`` divides by the weight of every record, so a
    key only some replies report came out too small.
    """
    if not records:
        return MetricRecord({})
    weights = [as_float(r[keys.NUM_EXAMPLES]) for r in records]
    names = sorted(set().union(*(r.keys() for r in records)) - {keys.NUM_EXAMPLES})
    out: dict[str, Any] = {}
    for name in names:
        pairs = [(w, r[name]) for w, r in zip(weights, records, strict=True) if name in r]
        values: list[Any] = [v for _, v in pairs]
        lists = all(isinstance(v, list) and v and all(map(is_number, v)) for v in values)
        if not (all(map(is_number, values)) or (lists and len({len(v) for v in values}) == 1)):
            continue  # not numbers, or lists of different lengths
        stacked = np.asarray(values, dtype=float)
        w = np.asarray([p[0] for p in pairs])
        if not w.sum() > 0:
            w = np.ones(len(pairs))
        mean = w @ stacked / w.sum()
        out[name] = float(mean) if stacked.ndim == 1 else [float(x) for x in mean]
    return MetricRecord(out)


def screen_replies(
    replies: Iterable[Message],
    reference: ArrayRecord,
    *,
    who: str,
    notes: dict[int, str] | None = None,
) -> list[tuple[Message, list[np.ndarray]]]:
    """The replies that pass :func:`protocol.replies.check_reply`, each with its arrays
    as the check decoded them (key order); each other one is logged with its reason
    (``who`` names the strategy) and, with ``notes``, noted there as
    ``node -> "rejected: <reason>"`` (a valid reply: ``node -> ""``)."""
    valid = []
    for message in replies:
        node = int(message.metadata.src_node_id)
        try:
            arrays, _ = check_reply(message, reference)
        except InvalidReply as err:
            log(WARNING, "%s: reply of node %d rejected, not aggregated: %s", who, node, err)
            if notes is not None:
                notes[node] = f"rejected: {err}"
            continue
        if notes is not None:
            notes[node] = ""
        valid.append((message, arrays))
    return valid


def weight_of(message: Message, key: str = keys.NUM_EXAMPLES) -> float:
    """The weight ``key`` of a screened reply's (single) MetricRecord."""
    return as_float(next(iter(records(message.content, MetricRecord).values()))[key])


def bounded_weights(
    weights: Sequence[float], sizes: Sequence[int | None], max_share: float
) -> tuple[list[float], dict[int, str]]:
    """Each weight clipped to what the server can justify, and ``index -> why`` for
    every clipped one.

    A reply whose partition size the server learnt at start-up weighs at most that
    size, and every reply at most ``max(2, s(n-1)/(1-s))`` times the median weight of
    the round's ``n`` replies (``s = max_share``; a size is the client's own word, so
    it bounds, never raises, the cap): with the other replies at the median it carries
    at most ``max(s, 2/(n+1))`` of the round, and no reply within twice the median is
    clipped. The median is robust while fewer than half the replies lie; with fewer
    than 3 replies (no robust median) or ``s = 1`` only known sizes bound.
    """
    n = len(weights)
    cap = None
    if n >= 3 and max_share < 1.0:
        multiple = max(MEDIAN_FLOOR, max_share * (n - 1) / (1.0 - max_share))
        cap = multiple * float(np.median(np.asarray(weights, dtype=float)))
    bounded, notes = [], {}
    for i, (weight, size) in enumerate(zip(weights, sizes, strict=True)):
        if size is not None and weight > size and (cap is None or size <= cap):
            bounded.append(float(size))
            notes[i] = (
                f"weight clipped: '{keys.NUM_EXAMPLES}' = {weight:g} above its partition's "
                f"size {size}"
            )
        elif cap is not None and weight > cap:
            bounded.append(cap)
            notes[i] = (
                f"weight clipped: '{keys.NUM_EXAMPLES}' = {weight:g} above {cap:g} "
                f"('aggregation.max-weight-share' = {max_share:g} of {n} replies)"
            )
        else:
            bounded.append(float(weight))
    return bounded, notes


def bounded_updates(
    screened: list[tuple[Message, list[np.ndarray]]],
    weights: Sequence[float],
    reference: ArrayRecord,
    multiple: float,
) -> tuple[list[tuple[Message, list[np.ndarray]]], list[float], dict[int, str]]:
    """The screened replies with each update (model minus ``reference``, floating-point
    arrays only) clipped to ``multiple`` times the round's median update norm, their
    weights (a clipped reply's at most the round's median weight), and ``index -> why``
    for every clipped one.

    Norm bounding (Sun et al., 2019, "Can you really backdoor federated learning?") with
    a bound taken from the round itself: the median is robust while fewer than half the
    replies lie; with fewer than 3 replies or ``multiple = 0`` nothing is clipped. A
    reply outlying in its update gets no more than a typical weight: it then moves the
    mean by at most about ``multiple / n`` median updates. Written here because
    Flower's strategies clip only under DP, to a fixed norm.
    """
    weights = [float(w) for w in weights]
    if len(screened) < 3 or not multiple > 0:
        return screened, weights, {}
    typical = float(np.median(np.asarray(weights)))
    base = [to_numpy(reference[key]) for key in reference]
    floats = [i for i, array in enumerate(base) if np.issubdtype(array.dtype, np.floating)]
    norms = np.asarray(
        [
            np.sqrt(sum(float(np.sum(np.square(arrays[i] - base[i], dtype=np.float64)))
                        for i in floats))
            for _, arrays in screened
        ]
    )  # fmt: skip
    bound = multiple * float(np.median(norms))
    out, notes = [], {}
    for index, ((message, arrays), norm) in enumerate(zip(screened, norms, strict=True)):
        if not norm > bound:
            out.append((message, arrays))
            continue
        factor = bound / norm
        clipped = list(arrays)
        for i in floats:
            clipped[i] = (base[i] + (arrays[i] - base[i]) * factor).astype(arrays[i].dtype)
        out.append((message, clipped))
        notes[index] = (
            f"update clipped: norm {norm:.4g} above {bound:.4g} "
            f"('aggregation.max-update-norm' = {multiple:g} times the round's median)"
        )
        if weights[index] > typical:
            notes[index] += f", weight {weights[index]:g} to the median {typical:g}"
            weights[index] = typical
    return out, weights, notes


def fedavg_arrays(
    screened: list[tuple[Message, list[np.ndarray]]],
    weighted_by_key: str,
    reference: ArrayRecord,
    weights: Sequence[float] | None = None,
) -> ArrayRecord:
    """The weighted mean of the screened replies' arrays (:func:`screen_replies`), as
    Flower's FedAvg computes it (``flwr.serverapp.strategy.strategy_utils.
    aggregate_arrayrecords``: weights ``w / sum(w)`` from each reply's MetricRecord,
    products summed in reply order, so the result is bit for bit the same), in
    ``reference``'s keys and dtypes; ``weights`` replaces the replies' own (bounded).

    Written here because Flower's decodes every array of every reply again with
    ``np.load`` (which parses each header with ``literal_eval``), after the screening
    has decoded them once, and its float64 averages of integer arrays are decoded once
    more to restore the dtypes; at 50 clients per round that was most of the server's
    time per reply (``bench/vs_flower.py``).
    """
    if weights is None:
        weights = [weight_of(message, weighted_by_key) for message, _ in screened]
    weights = list(weights)
    total = sum(weights)
    if not total > 0:  # no weight at all: the plain mean
        weights, total = [1.0] * len(weights), float(len(weights))
    sums: list[np.ndarray] = []
    for (_, arrays), weight in zip(screened, weights, strict=True):
        factor = weight / total
        if not sums:
            sums = [array * factor for array in arrays]
        else:
            for i, array in enumerate(arrays):
                sums[i] += array * factor  # by index: a 0-d product is a NumPy scalar
    return to_record(reference, sums)


@dataclass
class Aggregate:
    """A rule's result: the new arrays (None: the round aggregated nothing), the
    indices of the replies whose models entered it, and ``index -> why`` for the
    others."""

    arrays: ArrayRecord | None
    used: list[int]
    left_out: dict[int, str]


def robust_arrays(
    rule: str,
    screened: list[tuple[Message, list[np.ndarray]]],
    weights: Sequence[float],
    reference: ArrayRecord,
    settings: AggregationSettings,
) -> Aggregate:
    """The screened replies aggregated by ``rule`` (:data:`RULES`), in ``reference``'s
    keys and dtypes. ``mean``, ``krum`` and ``multi-krum`` average with ``weights``
    (bounded); ``median``, ``trimmed-mean`` and ``bulyan`` weigh every reply alike, as
    Flower's strategies do."""
    n = len(screened)
    everyone = list(range(n))
    layers = [np.stack(group) for group in zip(*(arrays for _, arrays in screened), strict=True)]
    if rule == "mean":
        return Aggregate(fedavg_arrays(screened, "", reference, weights), everyone, {})
    if rule == "median":  # FedMedian
        median = [np.median(x, axis=0) for x in layers]
        return Aggregate(to_record(reference, median), everyone, {})
    if rule == "trimmed-mean":  # FedTrimmedAvg
        beta = settings.trim_fraction
        return Aggregate(to_record(reference, [trim_mean(x, beta) for x in layers]), everyone, {})
    f = settings.num_byzantine
    contents = [message.content for message, _ in screened]
    if rule in ("krum", "multi-krum"):
        k = 1 if rule == "krum" else settings.num_selected or max(1, n - f)
        chosen = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=k)
        used = sorted(_indices(contents, chosen))
        picked = [screened[i] for i in used]
        arrays = fedavg_arrays(picked, "", reference, [weights[i] for i in used])
        why = f"not aggregated: not selected by {rule} ('aggregation.num-byzantine' = {f})"
        return Aggregate(arrays, used, {i: why for i in everyone if i not in used})
    if rule == "bulyan":
        if n < 4 * f + 3:
            why = (
                f"not aggregated: bulyan needs at least 4f + 3 = {4 * f + 3} valid replies "
                f"('aggregation.num-byzantine' = {f}), the round had {n}"
            )
            return Aggregate(None, [], dict.fromkeys(everyone, why))
        theta, beta = n - 2 * f, n - 4 * f
        chosen = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=theta)
        used = _indices(contents, chosen)  # in Krum's order, as Flower's Bulyan averages
        selected = [screened[i][1] for i in used]
        median = [np.median(x, axis=0) for x in zip(*selected, strict=True)]
        arrays = to_record(reference, aggregate_n_closest_weights(median, selected, beta))
        why = f"not aggregated: not selected by bulyan's krum ('aggregation.num-byzantine' = {f})"
        return Aggregate(arrays, sorted(used), {i: why for i in everyone if i not in used})
    raise ValueError(f"'aggregation.rule' = {rule!r}; valid values: {listed(RULES)}")


def _indices(contents: list, chosen: list) -> list[int]:
    """The positions in ``contents`` of the (identical) objects ``chosen``."""
    position = {id(c): i for i, c in enumerate(contents)}
    return [position[id(c)] for c in chosen]
