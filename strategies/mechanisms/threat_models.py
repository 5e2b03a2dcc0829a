"""Who each ε holds against: the threat models of docs/privacy.md, per privacy mechanism.

Three parties may want to learn about one client's data:

* **trusted server** (central DP): the server and its ``curator/`` are trusted; the ε
  protects what the server releases (global models, central evaluation) against anyone
  who sees them;
* **honest-but-curious server**: the server runs the protocol but reads everything it
  receives; the ε that holds against the server itself;
* **local**: each client's own upload, as the server (or an edge) receives it.

Design notes: ``docs/notes.md``, ``strategies.mechanisms.threat_models``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from config.settings import Typed
from privacy.settings import DPSettings
from strategies.secure.secagg_plus import SecAggSettings

THREAT_MODELS = ("trusted-server", "honest-but-curious-server", "local")
TITLES = {
    "trusted-server": "trusted server (observers of the released model)",
    "honest-but-curious-server": "honest-but-curious server",
    "local": "local (each client's upload)",
}

# What a cell reports: the run's ledger ε; against the server, the ε of a client asked
# in every round (no amplification; a bound on every client's that does not depend on
# who was sampled, which is secret: the worst client's own is curator-only); the edge
# view (every edge aggregation at rate 1); the worst client-reported sample-level ε; or
# nothing.
CENTRAL, LOCAL, EDGE, SAMPLE, NONE = "central", "local", "edge", "sample-level", "none"
# Secure aggregation: no upload reaches the server on its own (a cryptographic, not a DP,
# protection; no ε).
MASKED = "masked"


@dataclass(frozen=True)
class Cell:
    """What holds against one party (``kind``) and, in words, why."""

    kind: str
    text: str


@dataclass(frozen=True)
class Row:
    """One ``privacy`` value (under the settings ``when`` describes)."""

    privacy: str
    when: str
    applies: Callable[[Typed], bool]  # of the run's settings
    cells: tuple[Cell, Cell, Cell]  # in THREAT_MODELS order


def _noise_site(site: str) -> Callable[[Typed], bool]:
    return lambda run: run.part(DPSettings).noise_site == site


def _always(_run: Typed) -> bool:
    return True


def _secagg(site: str | None) -> Callable[[Typed], bool]:
    def applies(run: Typed) -> bool:
        on = SecAggSettings.on_in(run)
        return on and (site is None or run.part(DPSettings).noise_site == site)

    return applies


# SecAgg+ as built protects against a server that follows the protocol; an actively
# lying one is refused only where one client can see the lie (client_app.secagg_mod).
_MALICIOUS = (
    "not against a malicious server, which can substitute the clients' public keys (keys "
    "are not signed) or tell different clients different dropout lists (no consistency "
    "round) and unmask single uploads"
)
_MASKED = Cell(
    MASKED,
    "no single upload reaches an honest-but-curious server: SecAgg+ shows it only the sum "
    "(unless it colludes with t of a client's neighbours, t = secagg.reconstruction-"
    f"threshold); {_MALICIOUS}",
)
_SECAGG_ROWS = (
    Row(
        "none",
        "secagg.enabled",
        _secagg(None),
        (
            Cell(NONE, "none: no privacy mechanism"),
            Cell(NONE, "none: no noise; the server sees the exact sum of the updates"),
            _MASKED,
        ),
    ),
    *(
        Row(
            privacy,
            "secagg.enabled, dp.noise-site = server",
            _secagg("server"),
            (
                Cell(CENTRAL, "client-level epsilon of the ledger (the server adds the noise)"),
                Cell(NONE, "none: the server sees the unnoised sum (but no single update)"),
                _MASKED,
            ),
        )
        for privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive")
    ),
    Row(
        "dp-fedavg-fixed",
        "secagg.enabled, dp.noise-site = client",
        _secagg("client"),
        (
            Cell(
                CENTRAL,
                "client-level epsilon of the ledger: the most-participating client's sums, "
                "each at the least distributed Skellam noise a sum carries; no amplification",
            ),
            Cell(
                CENTRAL,
                "the same epsilon against an honest-but-curious server, which sees only the "
                "noised sum (SecAgg+, up to collusion with t of a client's neighbours); it "
                "assumes that every surviving client adds its noise share and that none "
                "colludes with the server (each that withholds or reveals its share lowers "
                f"the noise below what the ledger charges); {_MALICIOUS}",
            ),
            _MASKED,
        ),
    ),
)


_SERVER_SEES_RAW = Cell(NONE, "none: the server sees every client's update before it is noised")
_NO_SECAGG = "without secure aggregation the server sees every noisy upload: the local epsilon"
_CENTRAL = Cell(CENTRAL, "client-level epsilon of the ledger (amplified by the secret sample)")
_CENTRAL_UNAMPLIFIED = (
    "client-level epsilon of the ledger, no amplification claimed (the strategy selects "
    "clients from what they report)"
)
_BIT_IN_CLEAR = Cell(NONE, "none: each client's unclipped-norm bit reaches the server in clear")
_PER_BATCH = Cell(NONE, "none: per-batch clipping bounds no example's or client's influence")
_UPLOAD = Cell(
    LOCAL,
    "every client's, at most that of a client asked in every round (no amplification; "
    "independent of who was sampled)",
)
_SAMPLE = Cell(SAMPLE, "sample-level epsilon only (one example of one client), no client-level")

ROWS: tuple[Row, ...] = (
    *_SECAGG_ROWS,  # first: row_for takes the first row that applies
    Row("none", "", _always, (Cell(NONE, "none: no privacy mechanism"),) * 3),
    *(
        Row(
            privacy,
            "dp.noise-site = server",
            _noise_site("server"),
            (_CENTRAL, _SERVER_SEES_RAW, _SERVER_SEES_RAW),
        )
        for privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive")
    ),
    Row(
        "dp-fedavg-fixed",
        "dp.noise-site = client",
        _noise_site("client"),
        (_CENTRAL, Cell(LOCAL, _NO_SECAGG), _UPLOAD),
    ),
    Row(
        "dp-fedavg-adaptive",
        "dp.noise-site = client",
        _noise_site("client"),
        (_CENTRAL, _BIT_IN_CLEAR, _BIT_IN_CLEAR),
    ),
    Row("subspace-dp", "", _always, (_CENTRAL, _SERVER_SEES_RAW, _SERVER_SEES_RAW)),
    Row(
        "laplace",
        "",
        _always,
        (
            Cell(CENTRAL, "every round composed (min of the accountant and basic composition)"),
            Cell(LOCAL, _NO_SECAGG),
            _UPLOAD,
        ),
    ),
    *(
        Row(
            privacy,
            "",
            _always,
            (
                Cell(
                    CENTRAL,
                    "client-level epsilon of the ledger: the whole run's correlated noise "
                    "on the strategy matrix's sensitivity for the schema's participations "
                    "(correlated.schema: cyclic, no amplification; amplified: Poisson "
                    "within the round's group)",
                ),
                _SERVER_SEES_RAW,
                _SERVER_SEES_RAW,
            ),
        )
        for privacy in ("banded-mf", "dp-ftrl")
    ),
    Row("dp-sgd", "", _always, (_SAMPLE, _SAMPLE, _SAMPLE)),
    Row(
        "cg-ng",
        "dp.per-example = true",
        lambda run: run.part(DPSettings).per_example,
        (_SAMPLE, _SAMPLE, _SAMPLE),
    ),
    Row(
        "cg-ng",
        "dp.per-example = false",
        lambda run: not run.part(DPSettings).per_example,
        (_PER_BATCH,) * 3,
    ),
    Row("cg-np", "", _always, (_PER_BATCH,) * 3),
    Row(
        "cp-np",
        "",
        _always,
        (
            Cell(CENTRAL, "client-level epsilon of the ledger (amplified by the edges' sample)"),
            Cell(EDGE, "the edge view: the server runs the edges and sees each noisy delta"),
            Cell(EDGE, "the edge view: every edge aggregation, no amplification"),
        ),
    ),
)


def row_for(privacy: str, run: Typed) -> Row:
    """The row describing ``privacy`` under the run's settings ``run``."""
    for row in ROWS:
        if row.privacy == privacy and row.applies(run):
            return row
    raise KeyError(f"no threat-model row for privacy = {privacy!r}")


def markdown_table() -> str:
    """The README's table: mechanism × threat model → which ε holds."""
    head = "| `privacy` | " + " | ".join(TITLES[t] for t in THREAT_MODELS) + " |"
    lines = [head, "| --- | --- | --- | --- |"]
    for row in ROWS:
        name = f"`{row.privacy}`" + (f" ({row.when})" if row.when else "")
        lines.append(f"| {name} | " + " | ".join(c.text for c in row.cells) + " |")
    return "\n".join(lines)


def _epsilon(kind: str, strategy) -> tuple[float | None, float | None, str | None]:
    """(ε, δ, who) a run reached for a cell of ``kind``; ε None when nothing was released."""
    if kind == CENTRAL:
        ledger = strategy.ledger
        return (ledger.epsilon() if ledger.releases else None), ledger.target_delta, None
    if kind == LOCAL:
        view = strategy.local_view
        epsilon = view.bound()
        return (epsilon if epsilon else None), view.target_delta, None
    if kind == EDGE:
        view = strategy.edge_view
        return (view.epsilon() if view.releases else None), view.target_delta, None
    guarantees = strategy.ledger.local_guarantees
    if not guarantees:
        return None, strategy.ledger.target_delta, None
    worst = max(guarantees, key=lambda g: g.epsilon)
    return worst.epsilon, worst.delta, worst.client


def run_report(privacy: str, run: Typed, strategy) -> list[dict[str, Any]]:
    """For each threat model: whether an ε holds, its value (worst client where per
    client) and what it rests on, for ``ledger.json`` and the run's summary."""
    row = row_for(privacy, run)
    seed_known = run.part(DPSettings).reproducible_noise and privacy != "none"
    report = []
    for threat, cell in zip(THREAT_MODELS, row.cells, strict=True):
        entry: dict[str, Any] = {"threat-model": threat, "holds": cell.kind != NONE}
        entry["unit"] = "sample-level" if cell.kind == SAMPLE else "client-level"
        entry["basis"] = cell.text
        if cell is _CENTRAL and strategy.ledger.sampling == "none":  # e.g. SmartFedProx
            entry["basis"] = _CENTRAL_UNAMPLIFIED
        if cell.kind not in (NONE, MASKED):
            epsilon, delta, client = _epsilon(cell.kind, strategy)
            entry |= {"epsilon": epsilon, "delta": delta}
            if client is not None:
                entry["worst-client"] = client
            if epsilon is not None and not math.isfinite(epsilon):
                entry["holds"] = False
        if seed_known and entry["holds"]:
            entry["caveat"] = (
                "dp.reproducible-noise = true: holds only against parties who do not know "
                "the run seed; against anyone who knows it, no epsilon holds"
            )
        report.append(entry)
    return report


def summary_lines(report: list[dict[str, Any]]) -> list[str]:
    """One log line per threat model."""
    lines = []
    for entry in report:
        title = TITLES[entry["threat-model"]]
        if not entry["holds"] or "epsilon" not in entry:  # none, or secure aggregation's
            lines.append(f"against the {title}: {entry['basis']}")
            continue
        if entry.get("epsilon") is None:
            lines.append(f"against the {title}: nothing released yet ({entry['basis']})")
            continue
        who = f", worst client {entry['worst-client']}" if "worst-client" in entry else ""
        lines.append(
            f"against the {title}: {entry['unit']} (epsilon, delta) = "
            f"({entry['epsilon']:.4f}, {entry['delta']:g}){who} [{entry['basis']}]"
            + (" -- ONLY IF THE SEED IS SECRET" if "caveat" in entry else "")
        )
    return lines
