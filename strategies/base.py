"""Pieces every strategy wrapper shares: a restricted grid view, reply checks,
uniform sampling with the run's generator, and the signal to end a run early."""

from __future__ import annotations

import math
import time
from abc import ABC
from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies import keys, partitions
from strategies.errors import BudgetExhausted, InvalidReply, StopTraining

# Re-exported: strategies import them from here.
__all__ = ["BudgetExhausted", "InvalidReply", "StopTraining"]

# More examples than any client of this app holds: a larger weight is a poisoning
# attempt on the example-weighted average, not data.
MAX_NUM_EXAMPLES = 10**9


class TrainingWrapper(Strategy, ABC):
    """A strategy around ``self.strategy`` that intercepts only the training half.

    Evaluation is the wrapped strategy's; subclasses implement ``configure_train``,
    ``aggregate_train`` and ``summary`` (ending with ``self.strategy.summary()``).
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation round."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's evaluation metrics."""
        return self.strategy.aggregate_evaluate(server_round, replies)


def add_to_config(messages: Iterable[Message], extra: dict) -> list[Message]:
    """Add ``extra`` to the train config of every message (each gets its own record)."""
    messages = list(messages)
    for message in messages:
        message.content[keys.CONFIG] = ConfigRecord({**message.content[keys.CONFIG], **extra})
    return messages


class GridView:
    """A grid that shows the wrapped strategy only ``node_ids`` (it samples all of them).

    Everything except ``get_node_ids`` is the underlying grid's.
    """

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid = grid
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


def wait_for_nodes(
    grid: Grid, needed: int, *, timeout: float, poll: float = 1.0, discover: bool = True
) -> list[int]:
    """The connected node ids, once at least ``needed`` are there or ``timeout`` passed,
    in partition order. ``discover``: ask new nodes for their partition id (once);
    strategies that learn it from their own query (hierarchical) pass False."""
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < needed and time.monotonic() < deadline:
        log(INFO, "Waiting for nodes: %d connected, %d needed", len(nodes), needed)
        time.sleep(poll)
    if discover:
        partitions.discover(grid, nodes, timeout=timeout)
    return partitions.order(nodes)


def nodes_for_round(
    grid: Grid,
    *,
    min_available: int,
    min_sample: int,
    timeout: float,
    discover: bool = True,
) -> list[int]:
    """The nodes a round samples from: wait up to ``timeout`` for ``min_available``
    nodes; then go on with those connected, with a warning, as long as at least
    ``min_sample`` are (a SuperNode that died leaves the survivors); else end the run
    (``StopTraining``) rather than wait forever."""
    nodes = wait_for_nodes(
        grid, max(min_available, min_sample), timeout=timeout, discover=discover
    )
    if len(nodes) < min_sample:
        raise StopTraining(
            f"{len(nodes)} node(s) connected within 'round-timeout' = {timeout:g} s, the "
            f"round needs at least {min_sample}"
        )
    if len(nodes) < min_available:
        log(
            WARNING,
            "%d node(s) connected within 'round-timeout' = %g s, fewer than "
            "'min-available-nodes' = %d: the round goes on with them",
            len(nodes),
            timeout,
            min_available,
        )
    return nodes


def sample_uniform(node_ids: list[int], size: int, rng: np.random.Generator) -> list[int]:
    """``size`` distinct nodes drawn uniformly without replacement, in partition order.

    The draw is over the nodes' positions in partition order, so the same generator
    state picks the same partitions whatever ids Flower gave their nodes.
    """
    ordered = partitions.order(node_ids)
    picked = rng.choice(len(ordered), size=size, replace=False)
    return [ordered[i] for i in sorted(picked)]


def poisson_sample(node_ids: list[int], rate: float, rng: np.random.Generator) -> list[int]:
    """Each node independently with probability ``rate`` (Poisson sampling), in
    partition order; one uniform draw per node, in that order, from ``rng``."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"sampling rate must be in (0, 1], got {rate!r}")
    ordered = partitions.order(node_ids)
    taken = rng.random(len(ordered)) < rate
    return [node for node, take in zip(ordered, taken, strict=True) if take]


_NPY_V1 = b"\x93NUMPY\x01\x00"  # .npy magic and format version 1.0 (what np.save writes)


def to_numpy(array: Array, *, copy: bool = True) -> np.ndarray:
    """``array.numpy()``, without ``np.load``'s parsing of the ``.npy`` header.

    Flower's ``Array.numpy()`` reads the header with ``ast.literal_eval``, most of the
    cost of decoding a small array (the server decodes every array of every reply;
    bench/orchestration.py). A C-order version-1.0 payload whose header states exactly
    the ``dtype`` and ``shape`` the Array declares is read directly from the bytes,
    into a new writable array as ``np.load`` returns (``copy=False``: a read-only
    view of the bytes, for a check that keeps nothing); anything else goes to
    ``array.numpy()``.
    """
    data = array.data
    if array.stype == "numpy.ndarray" and data[:8] == _NPY_V1:
        offset = 10 + int.from_bytes(data[8:10], "little")
        dtype, shape = np.dtype(array.dtype), tuple(array.shape)
        expected = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
        count = math.prod(shape)
        if (
            not dtype.hasobject
            and data[10:offset].decode("latin1").rstrip() == expected
            and len(data) - offset == count * dtype.itemsize
        ):
            view = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
            return view.copy() if copy else view
    return array.numpy()


def arrays_of(record: object, reference: ArrayRecord | None = None) -> list[np.ndarray]:
    """The arrays of ``record`` in key order, checked against ``reference``.

    Raises
    ------
    InvalidReply
        If ``record`` is not an ArrayRecord, its keys, shapes or dtypes differ from
        ``reference``, or any value is NaN or infinite.
    """
    if not isinstance(record, ArrayRecord):
        raise InvalidReply(f"expected an ArrayRecord '{keys.ARRAYS}', got {type(record).__name__}")
    if reference is not None and list(record.keys()) != list(reference.keys()):
        raise InvalidReply("array keys differ from the global model's")
    arrays = [to_numpy(record[k]) for k in record]
    if reference is not None:
        for key, got in zip(reference.keys(), arrays, strict=True):
            want = reference[key]
            if tuple(got.shape) != tuple(want.shape) or str(got.dtype) != want.dtype:
                raise InvalidReply(
                    f"array '{key}' has shape {got.shape}/{got.dtype}, "
                    f"expected {tuple(want.shape)}/{want.dtype}"
                )
    for key, value in zip(record.keys(), arrays, strict=True):
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise InvalidReply(f"array '{key}' contains NaN or Inf")
    return arrays


def non_finite_array(record: ArrayRecord) -> str | None:
    """The key of the first floating array of ``record`` holding a NaN or an infinity,
    or None; read in place (no copy), for checks on every reply and aggregate."""
    for key in record:
        value = to_numpy(record[key], copy=False)
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return key
    return None


def unusable_reason(message: Message) -> str:
    """Why a reply without error may enter no aggregate at all ("": it may): a metric
    or an array that is not finite. Each strategy checks more (:func:`check_reply`:
    keys, shapes and weights against what it sent)."""
    for name, record in message.content.metric_records.items():
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            if not all(math.isfinite(v) for v in values if is_number(v)):
                return f"rejected: metric '{key}' of '{name}' is not finite"
    for record in message.content.array_records.values():
        key = non_finite_array(record)
        if key is not None:
            return f"rejected: array '{key}' contains NaN or Inf"
    return ""


def to_record(reference: ArrayRecord, arrays: list[np.ndarray]) -> ArrayRecord:
    """An ArrayRecord with ``reference``'s keys and dtypes holding ``arrays``.

    Averages of integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are rounded,
    not truncated, so every aggregate keeps the dtypes the next replies validate against.
    """
    out = {}
    for key, value in zip(reference.keys(), arrays, strict=True):
        dtype = np.dtype(reference[key].dtype)
        value = np.rint(value) if np.issubdtype(dtype, np.integer) else value
        out[key] = Array(np.asarray(value, dtype=dtype))
    return ArrayRecord(out)


def copy_record(record: ArrayRecord) -> ArrayRecord:
    """A copy of ``record`` that shares no buffer with it."""
    return to_record(record, [record[key].numpy() for key in record])


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


def is_number(value: object) -> bool:
    """An int or float metric value (bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def metrics_of(message: Message, weight: float | None = None) -> MetricRecord:
    """The reply's single MetricRecord (a copy; ``num-examples`` set to ``weight`` if given)."""
    record = message.content.get(keys.METRICS)
    if not isinstance(record, MetricRecord):
        raise InvalidReply(f"reply has no MetricRecord '{keys.METRICS}'")
    copy = MetricRecord(dict(record))
    if weight is not None:
        copy[keys.NUM_EXAMPLES] = weight
    return copy


def checked_metrics(message: Message) -> MetricRecord:
    """The reply's metrics with a finite, non-negative ``num-examples`` (or InvalidReply)."""
    if message.has_error():
        raise InvalidReply(f"error reply: {message.error.reason}")
    metrics = metrics_of(message)
    weight = metrics.get(keys.NUM_EXAMPLES)
    if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise InvalidReply(f"'{keys.NUM_EXAMPLES}' = {weight!r} is not a valid weight")
    return metrics


def check_reply(message: Message, reference: ArrayRecord) -> tuple[list[np.ndarray], MetricRecord]:
    """The reply's arrays (key order) and metrics if it may enter an aggregate, else
    InvalidReply with the reason.

    A reply passes when it is not an error, holds exactly one ArrayRecord with the
    global model's keys, shapes and dtypes and only finite values, and one MetricRecord
    whose values are finite numbers and whose ``num-examples`` is an integer in
    [0, MAX_NUM_EXAMPLES]. An empty ``reference`` (no global model, e.g. ``local``)
    checks only that the arrays are finite.
    """
    metrics = checked_metrics(message)
    arrays = arrays_of(message.content.get(keys.ARRAYS), reference if len(reference) else None)
    if len(message.content.array_records) != 1 or len(message.content.metric_records) != 1:
        raise InvalidReply("expected exactly one ArrayRecord and one MetricRecord")
    weight = metrics[keys.NUM_EXAMPLES]
    if weight != int(weight) or weight > MAX_NUM_EXAMPLES:
        raise InvalidReply(
            f"'{keys.NUM_EXAMPLES}' = {weight!r} is not an integer in [0, {MAX_NUM_EXAMPLES}]"
        )
    for key, value in metrics.items():
        numbers = value if isinstance(value, list) else [value]
        if not all(is_number(v) and math.isfinite(v) for v in numbers):
            raise InvalidReply(f"metric '{key}' = {value!r} is not a finite number")
    return arrays, metrics


def screen_replies(
    replies: Iterable[Message], reference: ArrayRecord, *, who: str
) -> list[Message]:
    """The replies that pass :func:`check_reply`; each other one is logged with its
    reason (``who`` names the strategy)."""
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


def unweighted(message: Message) -> RecordDict:
    """A RecordDict with the reply's metrics weighted 1 (for unweighted averaging)."""
    return RecordDict({keys.METRICS: metrics_of(message, weight=1.0)})
