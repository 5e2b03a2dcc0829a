"""The run's privacy audit (``audit.canaries`` > 0): ``audit.json`` (with the interim
audits of ``audit.every`` as ``history``), ``plots/audit.png`` and the summary lines
beside the accountant's ε (:mod:`privacy.audit` has the method,
:mod:`client_app.canary` the canary clients).

The audit reads only what the run released (the initial and the final global model)
and the canaries' own synthetic truth (directions and coins from the run seed), so
``audit.json`` is post-processing: covered by the run's ε like ``model.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

import numpy as np
from flwr.app import ArrayRecord
from flwr.common.logger import log

from config.settings import Choice, Settings, SettingsError, listed, setting
from privacy import audit
from strategies.mechanisms.base import DPSettings

S = TypeVar("S", bound=Settings)


class RunConfig(Protocol):
    """What the audit reads of the run's config (``server_app.config.RunConfig``, which
    reads :class:`AuditSettings` from here: a Protocol, not an import, keeps no circle)."""

    seed: int
    num_server_rounds: int
    privacy: str

    def part(self, kind: type[S]) -> S: ...


AUDIT_FILE = "audit.json"


def _flat(record: ArrayRecord) -> np.ndarray:
    return audit.flatten([record[key].numpy() for key in record])


class RunAudit:
    """The audit of one run: ``interim`` after rounds (``audit.every``), ``final`` after
    the last; both read the released global model and the initial one only."""

    def __init__(self, cfg: RunConfig, initial: ArrayRecord, ledger) -> None:
        self.cfg, self.ledger = cfg, ledger
        self.settings = cfg.part(AuditSettings)
        self.canaries, self.every = self.settings.canaries, self.settings.every
        self.initial = _flat(initial) if self.canaries else None
        self.history: list[dict] = []

    def _audit(self, arrays: ArrayRecord) -> audit.AuditResult:
        ledger = self.ledger
        epsilon = ledger.epsilon() if ledger is not None and ledger.releases else None
        dp = self.cfg.part(DPSettings)
        delta = ledger.target_delta if ledger is not None else dp.target_delta
        return audit.audit(
            _flat(arrays) - self.initial,
            seed=self.cfg.seed,
            canaries=self.canaries,
            delta=float(delta),
            confidence=self.settings.confidence,
            accountant_epsilon=epsilon,
        )

    def interim(self, server_round: int, arrays: ArrayRecord) -> None:
        """Audit round ``server_round``'s model when ``audit.every`` asks for it."""
        if not self.canaries or not self.every or server_round < 1 or server_round % self.every:
            return
        if server_round >= self.cfg.num_server_rounds:  # the final audit covers it
            return
        result = self._audit(arrays)
        self.history.append(
            {
                "round": server_round,
                "epsilon_estimate": result.epsilon_estimate,
                "epsilon_lower_bound": result.epsilon_lower_bound,
                "accountant_epsilon": result.accountant_epsilon,
            }
        )
        for level, line in summary_lines(result):
            log(level, "Round %d: %s", server_round, line)

    def final(self, run_dir, final: ArrayRecord) -> audit.AuditResult | None:
        """Audit the final model (None when ``audit.canaries`` = 0); write ``audit.json``
        and the plot and log the summary."""
        if not self.canaries:
            return None
        result = self._audit(final)
        if self.cfg.part(DPSettings).reproducible_noise and self.cfg.privacy != "none":
            result.notes.append(
                "dp.reproducible-noise: the noise derives from the seed; this audit is of an "
                "auditor who does not subtract it"
            )
        if any(h["accountant_epsilon"] is not None and h["epsilon_lower_bound"]
               > h["accountant_epsilon"] + 1e-9 for h in self.history):  # fmt: skip
            result.notes.append("an interim audit's lower bound exceeded its epsilon")
        doc = result.to_json() | {"history": self.history}
        run_dir.write_json(AUDIT_FILE, doc)
        _plot(result, run_dir.path / "plots" / "audit.png")
        for level, line in summary_lines(result):
            log(level, "%s", line)
        return result


def summary_lines(result: audit.AuditResult) -> list[tuple[int, str]]:
    """(log level, line) of the audit's summary."""
    estimate = "n/a" if result.epsilon_estimate is None else f"{result.epsilon_estimate:.3f}"
    if result.epsilon_estimate_interval is not None:
        low, high = result.epsilon_estimate_interval
        estimate += f" (95 % sampling interval {low:.3f}..{high:.3f})"
    against = (
        "no accountant epsilon (privacy = 'none')"
        if result.accountant_epsilon is None
        else f"accountant epsilon {result.accountant_epsilon:.3f} (the ledger's, against "
        "observers of the released models)"
    )
    lines = [
        (
            INFO,
            f"Audit ({result.canaries} canaries, {result.inserted} inserted, d = "
            f"{result.dimension}): epsilon estimate {estimate} (Andrew et al.), lower bound "
            f"{result.epsilon_lower_bound:.3f} at {result.confidence:g} confidence (Steinke "
            f"et al.; at most {result.epsilon_lower_bound_max:.3f} with these canaries), "
            f"{against}, delta {result.delta:g}",
        )
    ]
    if result.exceeds:
        lines.append(
            (
                ERROR,
                f"AUDIT FAILED: the lower bound {result.epsilon_lower_bound:.3f} exceeds the "
                f"accountant's epsilon {result.accountant_epsilon:.3f}; with probability "
                f">= {result.confidence:g} the run is not as private as its ledger says (a "
                "bug or a broken assumption)",
            )
        )
    elif result.estimate_exceeds:
        lines.append(
            (
                WARNING,
                f"Audit: the epsilon estimate {result.epsilon_estimate:.3f} and its whole 95 % "
                f"sampling interval exceed the accountant's {result.accountant_epsilon:.3f} "
                "(an estimate, not a bound: check with more canaries or seeds)",
            )
        )
    lines.extend((INFO, f"Audit: {note}") for note in result.notes)
    return lines


def _plot(result: audit.AuditResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from server_app.plots import save_figure

    figure, ax = plt.subplots(figsize=(6.4, 4.0))
    values = result.cosines_inserted + result.cosines_held_out
    bins = np.linspace(min(values), max(values), 30) if values else 10
    ax.hist(result.cosines_held_out, bins=bins, alpha=0.6, label="held-out canaries")
    ax.hist(result.cosines_inserted, bins=bins, alpha=0.6, label="inserted canaries")
    if result.threshold is not None:
        ax.axvline(result.threshold, color="black", linestyle="--", label="guess threshold")
    null = 1 / np.sqrt(max(result.dimension, 1))
    ax.axvspan(-2 * null, 2 * null, color="grey", alpha=0.12, label="±2/√d (random direction)")
    estimate = "n/a" if result.epsilon_estimate is None else f"{result.epsilon_estimate:.2f}"
    accountant = "—" if result.accountant_epsilon is None else f"{result.accountant_epsilon:.2f}"
    ax.set_title(
        f"ε estimate {estimate}, lower bound {result.epsilon_lower_bound:.2f} "
        f"({result.confidence:g}), accountant {accountant}",
        fontsize=9,
    )
    ax.set_xlabel("cosine of the final model delta with the canary direction")
    ax.set_ylabel("canaries")
    ax.legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)


# What the audit's canaries fit: one global model that averages uploads, released under
# a client-level mechanism (or none). DP-SGD is sample-level (a canary client would
# exceed its epsilon by design); the hierarchical modes, clusters and SmartFedProx's
# selection are not one average of sampled uploads.
AUDIT_STRATEGIES = ("fedavg", "fedprox")
AUDIT_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive", "laplace", "subspace-dp")


@dataclass(frozen=True)
class AuditSettings(Settings):
    """The empirical privacy audit's run-config keys (``audit.*``)."""

    PREFIX: ClassVar[str] = "audit"
    OFF: ClassVar[dict] = {"canaries": 0}
    canaries: int = setting(
        0,
        "Empirical privacy audit: k canary clients, the federation's last k partition"
        " ids (simulation: num-supernodes = N + k); each is inserted with probability"
        " 1/2, the rest are held out. 0: no audit.",
        low=0,
    )
    canary_rate: float = setting(
        1.0,
        "Audit: probability that a sampled inserted canary uploads its direction in a"
        " round (1: it is sampled and uploads exactly like a real client).",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    every: int = setting(
        0,
        "Audit also the global model of every this many rounds (its delta from the "
        "initial model; audit.json 'history'); 0: only the final model.",
        low=0,
    )
    confidence: float = setting(
        0.95,
        "Audit: confidence of the one-run epsilon lower bound (Steinke et al. 2023).",
        low=0.5,
        high=1.0,
        high_open=True,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """Enough canaries, in a run whose release the audit's method fits."""
        k = choice.part(AuditSettings).canaries
        if not k:
            return
        if k < 4:
            raise SettingsError(
                f"'audit.canaries' = {k} is too few: the estimate fits a Gaussian to the "
                "inserted and to the held-out canaries (each about k/2); valid values: 0 "
                "(off) or >= 4"
            )
        if choice.strategy not in AUDIT_STRATEGIES:
            raise SettingsError(
                f"'audit.canaries' = {k} is not available with 'strategy' = "
                f"{choice.strategy!r}; valid strategies: " + listed(AUDIT_STRATEGIES)
            )
        if choice.privacy not in AUDIT_PRIVACY:
            raise SettingsError(
                f"'audit.canaries' = {k} is not available with 'privacy' = "
                f"{choice.privacy!r} (the audit tests a client-level guarantee of one "
                "released model); valid values: " + listed(AUDIT_PRIVACY)
            )
