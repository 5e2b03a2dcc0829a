"""What the round loop hands back to the run directory: each round's record, each
round's checkpoint, and the state a resumed run continues from; and, once the run
ends, its privacy report: ``ledger.json``'s statements of who each ε holds against
(written each round too), the summary's privacy lines, and ``certificates.json``
(privacy/certificates.py)."""

from __future__ import annotations

from logging import INFO
from typing import cast

from flwr.app import MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger
from privacy.audit import AuditResult
from privacy.certificates import run_certificates
from protocol.records import to_state_dict
from server_app.audit import RunAudit
from server_app.config import RunConfig
from server_app.failures import FailureWatch
from server_app.results import CURATOR_DIR, STRATEGY_STATE, RunDirectory
from server_app.rounds import RoundResult
from strategies.mechanisms import threat_models
from strategies.mechanisms.base import DPSettings
from strategies.runtime.capabilities import (
    MultiModel,
    Resumable,
    WritesTables,
    innermost,
    ledger_of,
    provides,
)
from strategies.runtime.checkpoint import (
    decode,
    encode,
    global_rng_state,
    load_strategy_state,
    set_global_rng_state,
    strategy_state,
)
from strategies.runtime.partitions import partition_map, wait_for_nodes

LOCAL_VIEW_FILE = f"{CURATOR_DIR}/local-view.json"  # each client's ε against the server


class RoundRecorder:
    """``on_round`` and ``on_commit`` of :func:`server_app.rounds.run_rounds`."""

    def __init__(
        self,
        run_dir: RunDirectory,
        cfg: RunConfig,
        strategy: Strategy,
        auditor: RunAudit | None,
        watch: FailureWatch | None = None,
    ) -> None:
        self.run_dir, self.cfg, self.strategy, self.auditor = run_dir, cfg, strategy, auditor
        self.watch = watch
        self.base = innermost(strategy)
        self.ledger = ledger_of(strategy)
        self.last_recorded = 0  # the last round whose model was recorded
        self._committed: tuple[int, dict] | None = None  # the last commit's round, payload

    def commit(self, result: RoundResult) -> None:
        """Checkpoint the round right after its aggregate (before anything is released),
        with the failure policy's state (the divergence guard's reference values)."""
        payload = {
            "arrays": encode(result.arrays),
            STRATEGY_STATE: strategy_state(self.strategy),
            "rng": global_rng_state(),
            "result": {
                "train": dict(result.train) if result.train is not None else None,
                "clients": result.clients,
                "seconds": result.seconds,
            },
            "guard": self.watch.state_dict() if self.watch is not None else None,
        }
        self.run_dir.commit(result.server_round, payload)
        self._committed = (result.server_round, payload)

    def reject(self, result: RoundResult, reason: str) -> None:
        """The committed round failed the divergence guard: mark its checkpoint so that
        ``resume-from`` refuses it. The payload is the commit's (a privacy charge stays
        committed; nothing is charged or released again)."""
        if self._committed is not None and self._committed[0] == result.server_round:
            self.run_dir.reject(result.server_round, self._committed[1], reason)

    def adopt(self, saved: dict) -> None:
        """A resumed run: the checkpoint it continues is the last commit (so that a
        resumed round that fails the guard again is marked too)."""
        payload = {k: v for k, v in saved.items() if k not in ("format", "round")}
        self._committed = (int(saved["round"]), payload)

    def record(self, result: RoundResult) -> None:
        """Write the evaluated round: metrics, models, the strategy's tables, the ledger."""
        if not result.diverged:
            self.last_recorded = result.server_round
            if self.auditor is not None:  # audit.canaries > 0
                self.auditor.interim(result.server_round, result.arrays)
        models = None
        multi = cast(MultiModel, self.base)
        if provides(multi, MultiModel) and multi.models:
            label = multi.MODEL_LABEL
            models = {f"{label}-{k}": to_state_dict(m) for k, m in enumerate(multi.models)}
        if provides(self.base, WritesTables):
            for name, rows in cast(WritesTables, self.base).tables().items():
                self.run_dir.write_rows(self.run_dir.table(name), rows)
        self.run_dir.record_round(result, None, models)
        if self.ledger is not None and result.server_round > 0:
            self.run_dir.write_ledger(self.ledger, ledger_report(self.cfg, self.strategy))
            view = getattr(self.strategy, "local_view", None)
            if view is not None:  # who was asked most depends on the secret sample
                self.run_dir.write_json(LOCAL_VIEW_FILE, view.summary())


def restore(
    saved: dict,
    strategy: Strategy,
    grid: Grid,
    cfg: RunConfig,
    watch: FailureWatch | None = None,
) -> RoundResult:
    """Load a checkpoint's strategy state (ledger included), generators and failure
    policy state (into ``watch``); return the committed round (its global arrays, train
    metrics and participation), which the run evaluates again before going on. State
    kept per client is handed to the nodes that report the same partition ids now (node
    ids change from run to run). A privacy wrapper then charges what the interrupted
    round may have released (``on_resume``)."""
    partitions = partition_map(strategy)  # the run's node -> partition map
    nodes = wait_for_nodes(grid, cfg.min_available_nodes, partitions, timeout=cfg.round_timeout)
    node_of = {p: n for n in nodes if (p := partitions.partition_of(n)) is not None}
    load_strategy_state(strategy, saved[STRATEGY_STATE], node_of)
    set_global_rng_state(saved["rng"])
    if watch is not None:
        watch.load_state_dict(saved.get("guard"))
    if provides(strategy, Resumable):
        cast(Resumable, strategy).on_resume()
    result = saved["result"]
    train = MetricRecord(result["train"]) if result["train"] is not None else None
    return RoundResult(
        int(saved["round"]),
        decode(saved["arrays"]),
        train=train,
        clients=list(result["clients"]),
        seconds=result["seconds"],
    )


# -- the privacy report of a finished run --------------------------------------------
AUDIT_KEYS = ("epsilon_estimate", "epsilon_lower_bound", "confidence", "canaries",
              "exceeds_accountant")  # fmt: skip


def ledger_report(cfg: RunConfig, strategy: Strategy) -> dict:
    """``ledger.json``'s record of who each epsilon holds against, and of the noise
    calibrated to ``dp.target-epsilon`` (None when the noise was given)."""
    return {
        "threat-models": threat_models.run_report(cfg.privacy, cfg, strategy),
        "calibration": getattr(strategy, "calibration", None),
    }


def certify(
    run_dir: RunDirectory,
    ledger: PrivacyLedger,
    cfg: RunConfig,
    strategy: Strategy,
    audited: AuditResult | None,
) -> None:
    """Write the final ledger (with the audit's estimate when one ran), log the privacy
    summary, and write the certificates."""
    doc = ledger_report(cfg, strategy)
    if audited is not None:
        audit = audited.to_json()
        doc["audit"] = {key: audit[key] for key in AUDIT_KEYS}
    run_dir.write_ledger(ledger, doc)
    _log_summary(ledger, cfg, doc)
    write_certificates(run_dir, ledger, strategy)


def _log_summary(ledger: PrivacyLedger, cfg: RunConfig, doc: dict) -> None:
    summary = ledger.summary()
    log(INFO, "Privacy (%s):", cfg.privacy)
    if ledger.releases:  # else the statements say plainly that no client-level epsilon exists
        log(INFO, "\t├── (epsilon, delta) = (%.4f, %g) over %d releases",
            ledger.epsilon(), ledger.target_delta, len(ledger.releases))  # fmt: skip
        log(INFO, "\t├── accountant %s, sampling %s, neighbouring relation %s",
            ledger.accountant, ledger.sampling, ledger.neighboring)  # fmt: skip
    if cfg.privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive", "subspace-dp"):
        log(INFO, "\t├── noise added by the %s", cfg.part(DPSettings).noise_site)
    for line in threat_models.summary_lines(doc["threat-models"]):
        log(INFO, "\t├── %s", line)
    for line in summary.get("statements", []):
        log(INFO, "\t├── %s", line)
    log(INFO, "\t└── full record: ledger.json in the run directory")


def write_certificates(run_dir: RunDirectory, ledger, strategy) -> dict:
    """Write ``certificates.json`` for the run's ledger and log what it says."""
    spi_values = strategy.spi_values() if hasattr(strategy, "spi_values") else None
    doc = run_certificates(ledger, spi_values=spi_values)
    run_dir.write_json("certificates.json", doc)
    log(INFO, "Certificates:")
    if doc["gdp-mu"] is not None:
        log(INFO, "\t├── mu-GDP: mu = %.4g (sound, without sampling amplification)", doc["gdp-mu"])
    for row in doc["mia"]:
        if row["tpr-bound"] is not None:
            log(
                INFO,
                "\t├── membership inference: TPR <= %.4f at FPR %g",
                row["tpr-bound"],
                row["fpr"],
            )
    if doc["spi"] is not None:
        pairs = zip(doc["spi"]["k"], doc["spi"]["value"], strict=True)
        shown = ", ".join(f"SPI({k}) = {v:.3g}" for k, v in pairs)
        log(INFO, "\t├── %s (per release; not a DP guarantee)", shown)
    for note in doc["notes"]:
        log(INFO, "\t├── %s", note)
    log(INFO, "\t└── full record: certificates.json in the run directory")
    return doc
