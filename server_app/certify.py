"""The privacy report of a finished run: ``ledger.json``'s statements of who each ε
holds against, the summary's privacy lines, and ``certificates.json``
(privacy/certificates.py)."""

from __future__ import annotations

from logging import INFO

from flwr.common.logger import log
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger
from privacy.audit import AuditResult
from privacy.certificates import run_certificates
from server_app.config import RunConfig
from server_app.results import RunDirectory
from strategies.mechanisms import threat_models
from strategies.mechanisms.base import DPSettings

AUDIT_KEYS = ("epsilon_estimate", "epsilon_lower_bound", "confidence", "canaries",
              "exceeds_accountant")  # fmt: skip


def ledger_report(cfg: RunConfig, strategy: Strategy) -> dict:
    """``ledger.json``'s record of who each epsilon holds against, and of the noise
    calibrated to ``dp.target-epsilon`` (None when the noise was given)."""
    return {
        "threat-models": threat_models.run_report(cfg.privacy, cfg, strategy),
        "calibration": getattr(strategy, "calibration", None),
    }


def finish(
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
    report(run_dir, ledger, strategy)


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


def report(run_dir: RunDirectory, ledger, strategy) -> dict:
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
