"""What a result is worth: a run's ε, δ, the party the ε holds against, and how the
run ended, in one line for plot titles and as table columns.

Read live from the threat-model report (:func:`strategies.mechanisms.threat_models.run_report`)
or afterwards from a run directory's ``ledger.json`` (its ``threat-models``),
``config.json`` and ``outcome.json``. No Flower import (the analysis commands and the
notebook use it).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Who an ε holds against, shortest first in a title; the first party with a finite ε
# in this order is shown (an ε against the server itself is the stronger statement).
PARTIES = {
    "honest-but-curious-server": "the server itself (honest-but-curious)",
    "trusted-server": "observers of the released model (trusted server)",
    "local": "the receiver of each client's upload (local)",
}
ORDER = ("honest-but-curious-server", "trusted-server", "local")
NOT_PRIVATE = "NOT PRIVATE"


@dataclass(frozen=True)
class RunStatus:
    """A run's privacy statement and outcome."""

    privacy: str
    epsilon: float | None = None
    """The shown ε; None when no ε holds (no mechanism, or none against anyone)."""
    delta: float | None = None
    against: str = ""
    """The threat model the ε holds against (a key of :data:`PARTIES`)."""
    unit: str = ""
    """``client-level`` or ``sample-level``."""
    status: str = "unknown"
    """``completed``, ``stopped``, ``failed``, ``diverged`` (a failed run whose global
    model diverged) or ``unknown`` (no ``outcome.json``: still running, or killed)."""
    reason: str = ""
    recorded: bool = True
    """False when the run directory holds no final threat-model report (a run killed
    before its end): its ε is unknown, not absent."""

    @property
    def private(self) -> bool:
        return self.privacy != "none"

    @property
    def failed(self) -> bool:
        """Whether the run's numbers are not a result (failed or diverged)."""
        return self.status in ("failed", "diverged")

    def privacy_text(self) -> str:
        """``ε = 2.71, δ = 1e-05 (client-level) against …``, or why there is none."""
        if not self.private:
            return f"{NOT_PRIVATE} (privacy = none)"
        if self.epsilon is None and not self.recorded:
            return f"privacy = {self.privacy}: no ε recorded (no final ledger.json)"
        if self.epsilon is None:
            return f"privacy = {self.privacy}: no ε holds against anyone"
        return (
            f"privacy = {self.privacy}: ε = {self.epsilon:.3g}, δ = {self.delta:g} "
            f"({self.unit}) against {PARTIES.get(self.against, self.against)}"
        )

    def caption(self) -> str:
        """The privacy text, and the outcome when the run did not complete."""
        text = self.privacy_text()
        if self.status not in ("completed", "unknown"):
            text += f" · run {self.status.upper()}"
        return text

    def columns(self) -> dict[str, Any]:
        """Table columns: ``epsilon`` (∞ without DP, NaN when no ε holds in a private
        run), ``delta``, ``holds-against``, ``status``."""
        if not self.private:
            epsilon = math.inf
        else:
            epsilon = math.nan if self.epsilon is None else self.epsilon
        return {
            "epsilon": epsilon,
            "delta": math.nan if self.delta is None else self.delta,
            "holds-against": self.against if self.epsilon is not None else "",
            "status": self.status,
        }


def _shown(report: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any] | None:
    """The report entry to show: the first party of :data:`ORDER` with a finite ε."""
    entries = {entry.get("threat-model"): entry for entry in report or ()}
    for party in ORDER:
        entry = entries.get(party)
        if entry is None or not entry.get("holds"):
            continue
        epsilon = entry.get("epsilon")
        if isinstance(epsilon, int | float) and math.isfinite(epsilon):
            return entry
    return None


def outcome_status(outcome: Mapping[str, Any] | None) -> tuple[str, str]:
    """``(status, reason)`` of an ``outcome.json`` document (``diverged`` for a failed
    run whose reason says its global model diverged)."""
    if not outcome:
        return "unknown", ""
    status, reason = str(outcome.get("status", "unknown")), str(outcome.get("reason", ""))
    if status == "failed" and "diverged" in reason:
        status = "diverged"
    return status, reason


def from_report(
    privacy: str,
    report: Sequence[Mapping[str, Any]] | None,
    outcome: Mapping[str, Any] | None = None,
) -> RunStatus:
    """The status of a run of ``privacy`` from its threat-model report (``ledger.json``'s
    ``threat-models``) and ``outcome.json`` document."""
    status, reason = outcome_status(outcome)
    entry = _shown(report) if privacy != "none" else None
    if entry is None:
        return RunStatus(privacy, status=status, reason=reason, recorded=report is not None)
    return RunStatus(
        privacy,
        epsilon=float(entry["epsilon"]),
        delta=float(entry["delta"]),
        against=str(entry["threat-model"]),
        unit=str(entry.get("unit", "client-level")),
        status=status,
        reason=reason,
    )


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read(run_dir: str | Path) -> RunStatus:
    """The status of a finished (or running) run directory."""
    run_dir = Path(run_dir)
    config = _json(run_dir / "config.json") or {}
    privacy = str(config.get("run-config", {}).get("privacy", "none"))
    ledger = _json(run_dir / "ledger.json") or {}
    return from_report(privacy, ledger.get("threat-models"), _json(run_dir / "outcome.json"))


def summarise(statuses: Sequence[RunStatus]) -> dict[str, Any]:
    """Columns for runs of one configuration (e.g. seeds of an experiment): mean ε (∞
    without DP), the largest δ, the parties, and the outcomes counted
    (``3 completed``, ``2 completed, 1 diverged``)."""
    columns = [status.columns() for status in statuses]
    epsilons = [c["epsilon"] for c in columns]
    finite = [e for e in epsilons if math.isfinite(e)]
    if all(math.isinf(e) for e in epsilons):
        epsilon = math.inf
    else:
        epsilon = sum(finite) / len(finite) if len(finite) == len(epsilons) else math.nan
    deltas = [c["delta"] for c in columns if not math.isnan(c["delta"])]
    return {
        "epsilon": epsilon,
        "delta": max(deltas) if deltas else math.nan,
        "holds-against": "/".join(sorted({c["holds-against"] for c in columns} - {""})),
        "status": count_outcomes(status.status for status in statuses),
        "failed-runs": sum(status.failed for status in statuses),
    }


STATUSES = ("completed", "stopped", "failed", "diverged", "unknown")


def count_outcomes(statuses: Iterable[str]) -> str:
    """``2 completed, 1 diverged``: the outcomes counted, in :data:`STATUSES` order."""
    counts = Counter(statuses)
    order = [*STATUSES, *sorted(set(counts) - set(STATUSES))]
    return ", ".join(f"{counts[s]} {s}" for s in order if counts[s])


def epsilon_text(epsilon: float, delta: float) -> str:
    """``2.71 (δ = 1e-05)``; ``∞ (no DP)``; ``–`` when no ε holds."""
    if math.isinf(epsilon):
        return "∞ (no DP)"
    if math.isnan(epsilon):
        return "–"
    return f"{epsilon:.3g} (δ = {delta:g})" if not math.isnan(delta) else f"{epsilon:.3g}"
