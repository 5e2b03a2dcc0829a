"""``certificates.json`` and the summary's certificate lines (privacy/certificates.py)."""

from __future__ import annotations

from logging import INFO

from flwr.common.logger import log

from privacy.certificates import run_certificates
from server_app.results import RunDirectory


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
