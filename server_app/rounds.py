"""The federated round loop, with a progress line and callbacks per round.

It drives a Flower ``Strategy`` through the same four calls as ``Strategy.start``
(configure/aggregate train, configure/aggregate evaluate, then central evaluation).
``Strategy.start`` is not used because it offers no per-round hook for the
aggregated train/eval metrics, which the run directory records and checkpoints
every round.

The progress line replaces Flower's per-round lines (:func:`quiet_flower_rounds`, the
comment above it says why).

Design notes: ``docs/notes.md``, ``server_app.rounds``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any, ClassVar, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import FLOWER_LOGGER, log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from config.settings import Settings, setting
from protocol import keys
from protocol.records import InvalidReply, as_float, non_finite_array, records
from protocol.replies import check_reply, oversized_reason, reply_limit, unusable_reason
from server_app.failures import FailureWatch, Outcome, RunFailed
from strategies import StopTraining
from strategies.errors import BudgetExhausted
from strategies.runtime.capabilities import provides
from strategies.runtime.messaging import send_and_receive
from strategies.runtime.partitions import PartitionMap, partition_map
from strategies.secure.secure_aggregation import SecureExchange

CentralEval = Callable[[int, ArrayRecord], MetricRecord | None]

_SHOWN = ("loss", "accuracy", "reward", "epsilon")  # metric-name endings on the progress line


def regroup(aggregated: MetricRecord | None, replies: list[Message]) -> MetricRecord | None:
    """Re-weight per-group accuracies by ``num-examples-<group>`` (a weighted mean by
    ``num-examples`` is wrong for them) and recompute ``fairness-gap`` from the result."""
    if aggregated is None or keys.FAIRNESS_GAP not in aggregated:
        return aggregated
    prefix = keys.GROUP_NUM_EXAMPLES.format("")
    groups = [k[len(prefix) :] for k in aggregated if k.startswith(prefix)]
    records = [m.content[keys.METRICS] for m in replies if not m.has_error()]
    seen: list[float] = []
    for group in groups:
        acc, count = keys.GROUP_ACCURACY.format(group), keys.GROUP_NUM_EXAMPLES.format(group)
        pairs = [
            (as_float(r[acc]), as_float(r[count])) for r in records if acc in r and count in r
        ]
        total = sum(n for _, n in pairs)
        aggregated[count] = total
        aggregated[acc] = mean = sum(a * n for a, n in pairs) / total if total else 0.0
        if total:
            seen.append(mean)
    aggregated[keys.FAIRNESS_GAP] = max(seen) - min(seen) if seen else 0.0
    return aggregated


@dataclass
class RoundResult:
    """What one round produced (``None`` where nothing was aggregated)."""

    server_round: int
    arrays: ArrayRecord
    train: MetricRecord | None = None
    federated_eval: MetricRecord | None = None
    central_eval: MetricRecord | None = None
    clients: list[dict] = field(default_factory=list)
    """One row per client sent a train message: its node id, whether it replied
    without error (else the reason), and the metrics it reported."""
    seconds: float | None = None
    """Wall time of the round: sampling, training, aggregation and the federated and
    central evaluations (not the writing of its results)."""
    diverged: bool = False
    """The round's model diverged: its metrics are recorded, its model is not kept."""


def _replies_to(sent: list[Message], replies: list[Message]) -> dict[int, Message]:
    """``id(message) -> its reply``, matched by message id (the SuperLink's own error
    reply for an unreachable node comes from the SuperLink, not from the node), or by
    node where messages carry no id (grids that do not push them)."""
    by_id = {r.metadata.reply_to_message_id: r for r in replies if r.metadata.reply_to_message_id}
    by_node = {r.metadata.src_node_id: r for r in replies}
    matched = {}
    for message in sent:
        reply = by_id.get(message.metadata.message_id) if message.metadata.message_id else None
        if reply is None:
            reply = by_node.get(message.metadata.dst_node_id)
        if reply is not None:
            matched[id(message)] = reply
    return matched


def participation(
    server_round: int,
    sent: list[Message],
    replies: list[Message],
    partitions: PartitionMap | None = None,
    notes: Mapping[int, str] | None = None,
    *,
    check: bool = True,
) -> list[dict]:
    """The ``clients`` rows of a round from the train messages and their replies, in
    partition order (the order Flower's FedAvg sends in is random).

    A reply not aggregated as sent says why: ``error`` = ``"rejected: <reason>"`` for
    one no aggregate took (its metrics are left out of the row, as of the round's
    aggregates), ``note`` for one aggregated otherwise (a clipped weight) or left out
    by a robust rule. ``notes`` are the strategy's verdicts (node -> reason, ""
    accepted; :meth:`PartitionMap.note`; for a node without a reply, e.g. one SecAgg+
    dropped at a stage, the error); a reply without one is checked here against
    the model it was sent (:func:`check_reply`) unless ``check`` is false (SecAgg+:
    the replies hold masked vectors, not models).
    """
    rows = []
    answers = _replies_to(sent, replies)
    partitions = partitions if partitions is not None else PartitionMap()  # none: node ids
    notes = notes or {}
    for message in sorted(sent, key=lambda m: partitions.sort_key(m.metadata.dst_node_id)):
        node = message.metadata.dst_node_id
        row: dict = {"round": server_round, "node-id": node, "replied": False, "error": ""}
        reply = answers.get(id(message))
        if reply is None:  # SecAgg+: a node dropped at a stage, with its reason
            row["error"] = notes.get(node) or "no reply"
        elif reply.has_error():
            row["error"] = reply.error.reason
        else:
            row["replied"] = True
            verdict = notes.get(node)
            if verdict is None:
                verdict = unusable_reason(reply) or (_check(message, reply) if check else "")
            if verdict.startswith("rejected"):
                row["error"] = verdict
                rows.append(row)
                continue
            metrics = reply.content.get(keys.METRICS)
            if isinstance(metrics, MetricRecord):
                row.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
            if verdict:
                row["note"] = verdict
        rows.append(row)
    return rows


def _check(sent: Message, reply: Message) -> str:
    """``"rejected: <reason>"`` when ``reply`` fails :func:`check_reply` against the
    model ``sent`` carried, else ""."""
    reference = sent.content.get(keys.ARRAYS) if sent.has_content() else None
    if not isinstance(reference, ArrayRecord):
        return ""
    try:
        check_reply(reply, reference)
    except InvalidReply as err:
        return f"rejected: {err}"
    return ""


@dataclass
class Progress:
    """Elapsed time, and an ETA from the warm rounds: the first round of a run also
    starts the ClientApps (Ray workers, imports), so it is left out of the estimate
    once a second round has finished."""

    total: int
    started: float = field(default_factory=time.monotonic)
    seconds: list[float] = field(default_factory=list)

    @property
    def done(self) -> int:
        return len(self.seconds)

    def eta(self) -> float | None:
        """Seconds left: the mean warm round times the rounds left; None until a warm
        round finished (round 1's time is mostly start-up: no estimate from it)."""
        warm = self.seconds[1:]
        if self.done >= self.total:
            return 0.0
        return sum(warm) / len(warm) * (self.total - self.done) if warm else None

    def line(self, result: RoundResult, round_seconds: float) -> str:
        self.seconds.append(round_seconds)
        elapsed = time.monotonic() - self.started
        eta = self.eta()
        parts = [
            f"[round {result.server_round}/{self.total}]",
            f"{round_seconds:.1f}s",
            f"elapsed {_clock(elapsed)}",
            f"ETA {_clock(eta)}" if eta is not None else "ETA after round 2",
        ]
        for name, record in (
            ("train", result.train),
            ("fed", result.federated_eval),
            ("central", result.central_eval),
        ):
            for key, value in (record or {}).items():
                if isinstance(value, float) and key.endswith(_SHOWN):
                    parts.append(f"{name} {key} {value:.4f}")
        return " | ".join(parts)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# -- Flower's per-round chatter, which the progress line replaces -------------------
# Flower's strategies log, every round, ``configure_train: Sampled 5 nodes (out of 5)``
# and ``aggregate_train: Received 5 results and 0 failures`` (and the same for
# evaluation), which repeat the progress line or contradict it (Flower's count is of its
# own sampling, which the app's strategies replace). quiet_flower_rounds demotes them to
# DEBUG on Flower's logger; ``log.flower-rounds = true`` keeps them. Replies with errors
# are still logged (Flower's ``Received error in reply`` lines).
CHATTER = re.compile(
    r"^(configure_(train|evaluate): Sampled \d+ nodes|aggregate_(train|evaluate): Received \d+)"
)


@dataclass(frozen=True)
class ConsoleSettings(Settings):
    """The console keys (``log.*``)."""

    PREFIX: ClassVar[str] = "log"
    flower_rounds: bool = setting(
        False,
        "Show Flower's per-round lines (sampled nodes, received results) at INFO; "
        "false: at DEBUG (the app's progress line says the same).",
    )


class RoundChatter(logging.Filter):
    """Turns Flower's per-round INFO lines into DEBUG records (dropped unless the
    logger shows DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not CHATTER.match(record.getMessage()):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return FLOWER_LOGGER.isEnabledFor(logging.DEBUG)


_FILTER = RoundChatter()


def quiet_flower_rounds(show: bool) -> None:
    """Demote Flower's per-round lines (``show`` false) or show them (true)."""
    FLOWER_LOGGER.removeFilter(_FILTER)
    if not show:
        FLOWER_LOGGER.addFilter(_FILTER)


def _exchange(
    grid: Grid, messages: list[Message], timeout: float, what: str, arrays: ArrayRecord
) -> list[Message]:
    """:func:`~strategies.runtime.messaging.send_and_receive`, logging the nodes that did not
    answer in ``timeout`` seconds (what arrived by then is returned; the strategy
    decides what that means). A reply larger than the global ``arrays`` (or the
    largest ArrayRecord a message carries, if larger) plus a margin is refused as it
    is pulled (:func:`~protocol.replies.oversized_reason`): it becomes an error reply
    with the reason, which the participation record keeps."""
    sent = (r for m in messages for r in records(m.content, ArrayRecord).values())
    limit = max([reply_limit(arrays), *(reply_limit(r) for r in sent)])
    replies = send_and_receive(
        grid, messages, timeout=timeout, screen=lambda reply: oversized_reason(reply, limit)
    )
    answers = _replies_to(messages, replies)
    silent = sorted(m.metadata.dst_node_id for m in messages if id(m) not in answers)
    if silent:
        log(
            WARNING,
            "%s: %d of %d node(s) sent no reply within 'round-timeout' = %g s: %s",
            what,
            len(silent),
            len(messages),
            timeout,
            silent,
        )
    return replies


def _without_examples(server_round: int, replies: list[Message]) -> bool:
    """Whether the round's evaluation replies (those without an error) each count 0
    examples, logged: a mean weighted by ``num-examples`` has nothing to weigh (every
    sampled client's local test split empty, e.g. ``vision.test-fraction`` = 0), and
    Flower's would divide by zero after the round's work is done."""
    answered = [m for m in replies if not m.has_error()]
    counts = [
        record.get(keys.NUM_EXAMPLES)
        for m in answered
        for record in records(m.content, MetricRecord).values()
    ]
    if not counts or any(not isinstance(c, int | float) or c != 0 for c in counts):
        return False
    log(
        WARNING,
        "Round %d: the %d clients that evaluated hold no test examples; no federated "
        "evaluation this round (their local test splits are empty)",
        server_round,
        len(answered),
    )
    return True


def evaluate_round(
    strategy: Strategy,
    grid: Grid,
    result: RoundResult,
    *,
    timeout: float,
    central_eval: CentralEval | None,
    train_config: Mapping[str, str | int | float | bool] | None = None,
) -> RoundResult:
    """Federated and central evaluation of a committed round's model, into ``result``."""
    server_round, arrays = result.server_round, result.arrays
    try:
        evaluate = list(
            strategy.configure_evaluate(
                server_round, arrays, ConfigRecord(dict(train_config or {})), grid
            )
        )
    except StopTraining as stop:
        log(WARNING, "Round %d: federated evaluation skipped: %s", server_round, stop)
        evaluate = []
    replies = _exchange(grid, evaluate, timeout, f"round {server_round} evaluate", arrays)
    aggregated = None
    if not _without_examples(server_round, replies):
        aggregated = strategy.aggregate_evaluate(server_round, replies)
    result.federated_eval = regroup(aggregated, replies)
    result.central_eval = central_eval(server_round, arrays) if central_eval else None
    return result


def _train(
    strategy: Strategy,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
    messages: list[Message],
    timeout: float,
    watch: FailureWatch,
    *,
    first: bool,
) -> tuple[RoundResult, str | None]:
    """Send the round's train messages, aggregate the replies; the round's result (not
    yet evaluated) and the failure policy's verdict on it."""
    if first:
        log(
            INFO,
            "Round %d: training on %d clients; a ClientApp's first training also loads "
            "its data and what PyTorch imports on first use, so this round takes longer",
            server_round,
            len(messages),
        )
    if provides(strategy, SecureExchange):  # SecAgg+: several exchanges
        replies = cast(SecureExchange, strategy).exchange_train(grid, messages, timeout)
    else:
        replies = _exchange(grid, messages, timeout, f"round {server_round} train", arrays)
    partitions = partition_map(strategy)
    partitions.take_notes()  # nothing of an earlier round
    new_arrays, train_metrics = strategy.aggregate_train(server_round, replies)
    secure = provides(strategy, SecureExchange)
    clients = participation(
        server_round, messages, replies, partitions, partitions.take_notes(), check=not secure
    )
    if new_arrays is not None:
        bad = non_finite_array(new_arrays)
        if bad is not None:  # never committed, evaluated or released
            raise RunFailed(
                f"round {server_round}: the aggregate's array '{bad}' is not finite; "
                "the global model diverged (likely a learning rate too large, "
                "'vision.lr' or 'server.lr')"
            )
    failure = watch.after_train(server_round, clients, first=first)
    result = RoundResult(
        server_round,
        new_arrays if new_arrays is not None else arrays,
        train=train_metrics,
        clients=clients,
    )
    return result, failure


def _evaluate(
    strategy: Strategy,
    grid: Grid,
    result: RoundResult,
    watch: FailureWatch,
    evaluation: Mapping[str, Any],
) -> str | None:
    """Evaluate the committed round and apply the divergence guard to its metrics: why
    its model diverged, or None. ``result.seconds`` stays the round's train time
    (messages out to aggregate), as its checkpoint holds it."""
    evaluate_round(strategy, grid, result, **evaluation)
    reason = watch.diverged(
        result.server_round,
        {"central-eval": result.central_eval, "federated-eval": result.federated_eval},
    )
    result.diverged = reason is not None
    return reason


def run_rounds(
    strategy: Strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    timeout: float,
    central_eval: CentralEval | None,
    on_round: Callable[[RoundResult], None],
    on_commit: Callable[[RoundResult], None] = lambda _result: None,
    on_reject: Callable[[RoundResult, str], None] = lambda _result, _reason: None,
    train_config: Mapping[str, str | int | float | bool] | None = None,
    resumed: RoundResult | None = None,
    watch: FailureWatch | None = None,
) -> tuple[ArrayRecord, Outcome]:
    """Run the rounds up to ``num_rounds``; return the last good global arrays and how
    the run ended.

    ``central_eval`` (if given) runs on the initial model as round 0 and after every
    round; ``on_commit`` receives each round's result right after its aggregate (only
    ``train`` and ``clients`` are set), ``on_round`` the whole result once evaluated,
    round 0 included; ``on_reject`` a committed round whose model failed the divergence
    guard, with the reason. ``resumed``: the committed round a resumed run continues after;
    it is evaluated again, recorded, and the rounds after it run. A strategy ends the
    run early by raising ``StopTraining`` from ``configure_train``, before anything is
    sent (``BudgetExhausted``: status ``stopped``, else ``failed``). ``watch`` applies
    the failure policy (:mod:`server_app.failures`): failed rounds, a first round in
    which every client failed alike, a diverged model. ``train_config`` entries are
    added to every round's train and evaluate config (e.g. where clients write logs).
    """
    watch = watch or FailureWatch()
    evaluation = {"timeout": timeout, "central_eval": central_eval, "train_config": train_config}
    if resumed is None:
        arrays, start = initial_arrays, 1
        if central_eval is not None:
            first = RoundResult(0, arrays, central_eval=central_eval(0, arrays))
            watch.diverged(0, {"central-eval": first.central_eval})  # the reference values
            on_round(first)
    else:
        arrays, start = resumed.arrays, resumed.server_round + 1
        again = _evaluate(strategy, grid, resumed, watch, evaluation)
        if again is not None:
            on_reject(resumed, again)
            on_round(resumed)
            log(ERROR, "Stopping: the resumed round %d: %s", resumed.server_round, again)
            return arrays, Outcome("failed", again, resumed.server_round - 1)
        on_round(resumed)
    progress = Progress(num_rounds - start + 1)
    last_round = start - 1
    try:
        for server_round in range(start, num_rounds + 1):
            started = time.monotonic()
            try:
                messages = list(
                    strategy.configure_train(
                        server_round, arrays, ConfigRecord(dict(train_config or {})), grid
                    )
                )
            except StopTraining as stop:
                status = "stopped" if isinstance(stop, BudgetExhausted) else "failed"
                log(WARNING if status == "stopped" else ERROR,
                    "Stopping before round %d: %s", server_round, stop)  # fmt: skip
                return arrays, Outcome(status, str(stop), last_round)
            first_round = server_round == start
            result, failure = _train(
                strategy, grid, server_round, arrays, messages, timeout, watch, first=first_round
            )
            result.seconds = time.monotonic() - started
            on_commit(result)
            diverged = _evaluate(strategy, grid, result, watch, evaluation)
            if diverged is not None:
                on_reject(result, diverged)
            on_round(result)
            log(INFO, progress.line(result, time.monotonic() - started))
            if diverged is not None:
                raise RunFailed(diverged)
            arrays, last_round = result.arrays, server_round
            if failure is not None:
                raise RunFailed(failure)
    except RunFailed as failed:
        log(ERROR, "Stopping after round %d: %s", server_round, failed)
        return arrays, Outcome("failed", str(failed), last_round)
    never = watch.never_contributed(num_rounds)  # the streak is kept across a resume
    if never is not None:
        log(ERROR, "After round %d: %s", num_rounds, never)
        return arrays, Outcome("failed", never, last_round)
    return arrays, Outcome("completed", "", last_round)
