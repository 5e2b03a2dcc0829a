"""One failure policy for every strategy, and the outcome record of a run.

Design notes: ``docs/notes.md``, ``server_app.failures``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from logging import ERROR, INFO, WARNING, getLogger
from typing import Any, ClassVar

from config.settings import Settings, setting

STATUSES = ("completed", "stopped", "failed")
OUTCOME_FILE = "outcome.json"
# Flower's own logger (what flwr.common.logger.log writes to), named rather than imported:
# reading a run's outcome (a notebook, lab.figures) needs no Flower.
log = getLogger("flwr").log


@dataclass
class Outcome:
    """How a run ended (``outcome.json``)."""

    status: str
    reason: str = ""
    last_round: int = 0
    """The last round whose global model was recorded (0: none after the initial one)."""
    checkpoint: str | None = None
    """The last good global model (``checkpoint/global.pt``), if a round was recorded."""
    empty_last_round: str = ""
    """Set when the last round that trained aggregated no client's update: which, and why."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    def to_json(self) -> dict[str, Any]:
        doc = {k.replace("_", "-"): v for k, v in asdict(self).items()}
        if not doc["empty-last-round"]:
            doc.pop("empty-last-round")
        return doc

    def line(self) -> str:
        """The one-line summary the log ends with."""
        text = f"Run {self.status} after round {self.last_round}"
        return f"{text}: {self.reason}" if self.reason else text


class RunFailed(Exception):
    """The run cannot learn: it stops with status ``failed`` and this reason."""


def grouped_reasons(rows: Iterable[Mapping[str, Any]]) -> str:
    """The errors of a round's participation rows grouped by message, most frequent
    first: ``"10 of 10 clients: <reason>; ..."`` (rows that contributed count in the
    total only)."""
    rows = list(rows)
    counts = Counter(str(row["error"]) for row in rows if row.get("error"))
    return "; ".join(
        f"{count} of {len(rows)} clients: {reason}" for reason, count in counts.most_common()
    )


def contributed(row: Mapping[str, Any]) -> bool:
    """Whether a participation row's client sent a reply that may enter an aggregate."""
    return bool(row.get("replied")) and not row.get("error")


@dataclass
class FailureWatch:
    """Applies the policy round by round (see the module docstring)."""

    max_failed_rounds: int = 3
    divergence_factor: float = 1000.0
    private: bool = False
    """Under a privacy mechanism: the divergence guard reads the central evaluation only."""
    failed_streak: int = 0
    last_reasons: str = ""
    """The grouped reasons of the last failed round."""
    reference: dict[tuple[str, str], float] = field(default_factory=dict)
    empty_round: str = ""
    """The last trained round, when no client contributed to it: its number and reasons."""

    @classmethod
    def for_run(cls, options: Mapping[str, Any], *, private: bool) -> FailureWatch:
        """The policy of the run-config's ``run.*`` keys (:class:`FailurePolicy`)."""
        policy = FailurePolicy.from_options(options)
        return cls(
            max_failed_rounds=policy.max_failed_rounds,
            divergence_factor=policy.divergence_factor,
            private=private,
        )

    def after_train(self, server_round: int, rows: list[dict], *, first: bool) -> str | None:
        """The reason to stop after this round's training, or None (always None under a
        privacy mechanism: the clients' outcomes are not read)."""
        if self.private or not rows or any(contributed(row) for row in rows):
            self.failed_streak = 0
            self.empty_round = ""
            return None
        self.failed_streak += 1
        reasons = self.last_reasons = grouped_reasons(rows)
        self.empty_round = f"round {server_round} aggregated no client's update: {reasons}"
        errors = {str(row["error"]) for row in rows}
        replied_with_errors = all(row.get("replied") is False and row["error"] for row in rows)
        if first and len(errors) == 1 and "no reply" not in errors and replied_with_errors:
            return f"round {server_round}, every client failed the same way: {reasons}"
        if self.max_failed_rounds and self.failed_streak >= self.max_failed_rounds:
            return (
                f"no client contributed in {self.failed_streak} consecutive rounds "
                f"('run.max-failed-rounds' = {self.max_failed_rounds}); round "
                f"{server_round}: {reasons}"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the policy: the guard's reference values, the
        failed-round streak and its last reasons (plain data)."""
        return {
            "reference": [[scope, key, value] for (scope, key), value in self.reference.items()],
            "failed-streak": self.failed_streak,
            "last-reasons": self.last_reasons,
            "empty-round": self.empty_round,
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint written without it)."""
        if state is None:
            return
        self.reference = {(scope, key): float(value) for scope, key, value in state["reference"]}
        self.failed_streak = int(state["failed-streak"])
        self.last_reasons = str(state["last-reasons"])
        self.empty_round = str(state.get("empty-round", ""))

    def never_contributed(self, rounds_run: int) -> str | None:
        """After a run's last round: the reason to call it failed when no client
        contributed in any of the ``rounds_run`` rounds it ran (fewer than
        ``run.max-failed-rounds``, so the streak rule did not stop it), or None.
        ``run.max-failed-rounds = 0`` never fails a run on failed rounds, nor does a
        privacy mechanism."""
        if self.private or not (
            self.max_failed_rounds and rounds_run and self.failed_streak >= rounds_run
        ):
            return None
        return (
            f"no client contributed in any of the run's {rounds_run} round(s), so the global "
            f"model is the one it started from; last round: {self.last_reasons}"
        )

    def diverged(self, server_round: int, records: Mapping[str, Any]) -> str | None:
        """The reason the global model counts as diverged after ``server_round``, from
        its evaluation records by scope (``central-eval``, ``federated-eval``), or None."""
        scopes = ("central-eval",) if self.private else ("central-eval", "federated-eval")
        for scope in scopes:
            for key, value in (records.get(scope) or {}).items():
                if not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                if not math.isfinite(value):
                    return (
                        f"round {server_round}: {scope} '{key}' = {value}: the global model "
                        f"diverged ({_causes(self.private)})"
                    )
                if not key.endswith("loss"):
                    continue
                first = self.reference.setdefault((scope, key), float(value))
                if self.divergence_factor and first > 0 and value > self.divergence_factor * first:
                    return (
                        f"round {server_round}: {scope} '{key}' = {value:.4g} > "
                        f"'run.divergence-factor' = {self.divergence_factor:g} x its first "
                        f"value {first:.4g}: the global model diverged ({_causes(self.private)})"
                    )
        return None


def _causes(private: bool) -> str:
    causes = "a learning rate too large ('vision.lr', 'server.lr')"
    if private:
        causes += ", or noise that swamps the updates ('dp.noise-multiplier', 'dp.clip-norm')"
    return f"likely {causes}"


def write_outcome(run_dir, outcome: Outcome, watch: FailureWatch | None = None) -> None:
    """``outcome.json`` and the log's last line: how the run ended (and, from ``watch``,
    whether its last round trained nothing: never read under a privacy mechanism)."""
    if outcome.last_round > 0:
        outcome.checkpoint = str(run_dir.path / "checkpoint" / "global.pt")
    if watch is not None:
        outcome.empty_last_round = outcome.empty_last_round or watch.empty_round
    log(ERROR if outcome.status == "failed" else INFO, "%s", outcome.line())
    if outcome.empty_last_round:
        log(WARNING, "The last round trained nothing: %s", outcome.empty_last_round)
    run_dir.write_outcome(outcome)


@dataclass(frozen=True)
class FailurePolicy(Settings):
    """The failure policy's run-config keys (``run.*``)."""

    PREFIX: ClassVar[str] = "run"
    max_failed_rounds: int = setting(
        3,
        "Stop the run (outcome 'failed') after this many consecutive rounds in which "
        "no client contributed; 0: never.",
        low=0,
    )
    divergence_factor: float = setting(
        1000.0,
        "Stop the run (outcome 'failed') when an evaluation loss exceeds this many "
        "times its first value (non-finite metrics always stop it); 0: no ratio "
        "check.",
        low=0.0,
    )
