"""Checks over many run directories: failed runs and failed privacy audits.

The analysis commands (study, comparison, figures) write what they can, then exit
non-zero naming the runs whose ``outcome.json`` says ``failed`` or whose
``audit.json`` lower bound exceeds the accountant's ε.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

# The file names are kept here, not imported: ``server_app.audit`` and
# ``server_app.failures`` import Flower and the strategies, and the analysis commands'
# ``--help`` imports this module (tests/lab/test_lazy_imports.py checks they agree).
AUDIT_FILE = "audit.json"
OUTCOME_FILE = "outcome.json"


def failed_runs(run_dirs: Iterable[str | Path]) -> list[str]:
    """``"<run dir>: <reason>"`` for each run whose ``outcome.json`` says ``failed`` (the
    analysis commands exit non-zero on them; runs written before the file existed have
    none and are not counted)."""
    failed = []
    for run_dir in run_dirs:
        path = Path(run_dir) / OUTCOME_FILE
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("status") == "failed":
            failed.append(f"{run_dir}: {doc.get('reason', '')}")
    return failed


def exit_on_failed(command: str, run_dirs: Iterable[str | Path]) -> None:
    """``SystemExit`` naming the failed runs among ``run_dirs`` and the runs whose privacy
    audit's lower bound exceeds their epsilon, if any (after the command wrote its
    output, so what could be analysed is there)."""
    run_dirs = list(run_dirs)
    messages = []
    if failed := failed_runs(run_dirs):
        listed = "\n  ".join(failed)
        messages.append(f"{command}: {len(failed)} run(s) failed (outcome.json):\n  {listed}")
    if audits := failed_audits(run_dirs):
        listed = "\n  ".join(audits)
        messages.append(
            f"{command}: AUDIT FAILED in {len(audits)} run(s) (audit.json; the run is not as "
            f"private as its ledger says, or an assumption is broken):\n  {listed}"
        )
    if messages:
        raise SystemExit("\n".join(messages))


def _read(run_dir: str | Path) -> dict | None:
    """A run directory's ``audit.json``, or None (not audited)."""
    try:
        return json.loads((Path(run_dir) / AUDIT_FILE).read_text())
    except (OSError, ValueError):
        return None


def failed_audits(run_dirs: Iterable[str | Path]) -> list[str]:
    """``"<run dir>: <why>"`` for each run whose audit's lower bound exceeds its ε."""
    return [
        f"{run_dir}: audit lower bound {doc['epsilon_lower_bound']:.3f} > accountant "
        f"epsilon {doc['accountant_epsilon']:.3f}"
        for run_dir in run_dirs
        if (doc := _read(run_dir)) is not None and doc.get("exceeds_accountant")
    ]


def audit_markdown(runs: Mapping[str, Iterable[str | Path]]) -> str | None:
    """A table of the experiments' audits (None when no run was audited): per experiment
    the accountant's epsilon, the estimate (mean ± std over seeds) and the largest lower
    bound, and whether any seed's audit failed."""
    lines = [
        "| experiment | canaries | accountant epsilon | estimate | lower bound (largest) "
        "| audit |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, run_dirs in runs.items():
        docs = [doc for run_dir in run_dirs if (doc := _read(run_dir)) is not None]
        if not docs:
            continue
        accountant = [d["accountant_epsilon"] for d in docs]
        accountant = [e for e in accountant if e is not None]
        estimates = np.array([e for d in docs if (e := d["epsilon_estimate"]) is not None])
        spread = float(np.std(estimates, ddof=1)) if len(estimates) > 1 else 0.0
        lines.append(
            f"| {name} | {docs[0]['canaries']} | "
            f"{f'{max(accountant):.3f}' if accountant else '-'} | "
            f"{f'{estimates.mean():.3f} ± {spread:.3f}' if len(estimates) else '-'} | "
            f"{max(d['epsilon_lower_bound'] for d in docs):.3f} | "
            f"{'**FAILED**' if any(d['exceeds_accountant'] for d in docs) else 'passed'} |"
        )
    return "\n".join(lines) if len(lines) > 2 else None
