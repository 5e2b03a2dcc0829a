"""Experiment tracking: TensorBoard hparams for every run, MLflow and W&B when asked.

At the end of a run, from the files of its run directory:

* **TensorBoard hparams** (always; the scalars are written round by round by
  :class:`server_app.results.RunDirectory`): the run-config and the final metrics into
  the run's ``tensorboard/`` (``tensorboard --logdir runs/``: its HParams tab).
* **MLflow** (``tracking.mlflow = true``): params (the run-config), per-round metrics
  (``<scope>/<metric>`` at step = round), the ε the ledger states and whom it holds
  against, and the run directory's published files as artifacts. Default store: a local
  file store ``<output-dir>/mlruns`` (``mlflow ui --backend-store-uri runs/mlruns``).
* **Weights & Biases** (``tracking.wandb = true``): the same, one offline run under
  ``<output-dir>/wandb`` (unless ``WANDB_MODE`` is set: nothing leaves the machine).

Design notes: ``docs/notes.md``, ``server_app.tracking``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar, cast

import pandas as pd

from config.settings import Settings, setting

MLFLOW_BATCH = 100  # params per MLflow log_batch request (its limit), metrics: 1000
# Always private (never tracked), whatever the mechanism.
NEVER = ("curator/*", "clients/*", "checkpoint/server.pt", ".*", "*/.*")
# Published without a mechanism too; under one, ledger.json's covered list decides.
TAGS = ("task", "strategy", "privacy", "seed")


@dataclass(frozen=True)
class TrackingSettings(Settings):
    """The tracking keys (``tracking.*``)."""

    PREFIX: ClassVar[str] = "tracking"
    mlflow: bool = setting(
        False,
        "Log the run to MLflow at its end: run-config, per-round metrics, epsilon, the "
        "published files of the run directory (needs the `tracking` extra).",
    )
    mlflow_uri: str = setting(
        "",
        "MLflow tracking URI; empty: the local file store `<output-dir>/mlruns`.",
    )
    mlflow_experiment: str = setting("", "MLflow experiment name; empty: the task's name.")
    wandb: bool = setting(
        False,
        "Log the run to Weights & Biases at its end, offline unless WANDB_MODE says "
        "otherwise: run-config, per-round metrics, epsilon, the published files of the "
        "run directory as an artifact (needs the `wandb` extra).",
    )
    wandb_dir: str = setting(
        "", "Where W&B writes its offline runs (`<dir>/wandb/`); empty: `<output-dir>`."
    )
    wandb_project: str = setting("", "W&B project name; empty: the task's name.")


def published(name: str, covered: list[str] | None) -> bool:
    """Whether the run directory's file ``name`` (relative, ``/``-separated) may go to a
    tracker: never the private files; under a mechanism (``covered``: ledger.json's
    ``covered-by-epsilon`` list) only those it lists."""
    if any(fnmatch.fnmatch(name, pattern) for pattern in NEVER):
        return False
    if covered is None:
        return True
    for entry in covered:
        pattern = entry.replace("<model>", "*")
        if pattern.endswith("/"):
            pattern += "*"
        if fnmatch.fnmatch(name, pattern):
            return True
    return False


@dataclass(frozen=True)
class RunRecord:
    """What a tracker may see of one finished run directory."""

    path: Path
    run_config: dict[str, Any]
    metrics: pd.DataFrame
    """The top-level ``metrics.csv`` (under a mechanism: what the ε covers)."""
    ledger: dict | None
    outcome: dict | None
    """``outcome.json``; None under a mechanism (no ε covers it) or when absent."""

    @property
    def private(self) -> bool:
        return self.ledger is not None

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        config = json.loads((path / "config.json").read_text())["run-config"]
        metrics_csv = path / "metrics.csv"
        metrics = pd.read_csv(metrics_csv) if metrics_csv.is_file() else pd.DataFrame()
        ledger = _json(path / "ledger.json") if config.get("privacy", "none") != "none" else None
        outcome = None if ledger is not None else _json(path / "outcome.json")
        return cls(path, config, metrics, ledger, outcome)

    def covered(self) -> list[str] | None:
        if self.ledger is None:
            return None
        return list(self.ledger.get("run-directory", {}).get("covered-by-epsilon", []))

    def files(self) -> Iterator[Path]:
        """The published files of the run directory."""
        covered = self.covered()
        for file in sorted(self.path.rglob("*")):
            if file.is_file() and published(file.relative_to(self.path).as_posix(), covered):
                yield file

    def per_round(self) -> Iterator[tuple[str, float, int]]:
        """``(<scope>/<metric>, value, round)`` of every finite number of metrics.csv."""
        if self.metrics.empty:
            return
        for row in self.metrics.to_dict("records"):
            for key, value in row.items():
                if key in ("round", "scope") or isinstance(value, bool):
                    continue
                if isinstance(value, int | float) and math.isfinite(value):
                    yield f"{row['scope']}/{key}", float(value), int(row["round"])

    def final(self) -> dict[str, float]:
        """The last value of every per-round metric (``final/<scope>/<metric>``), and the
        privacy numbers (``privacy/epsilon``, ``privacy/delta``)."""
        final = {f"final/{key}": value for key, value, _ in self.per_round()}
        return final | self.privacy_numbers()

    def privacy_numbers(self) -> dict[str, float]:
        """The ledger's ε and δ, and each threat model's ε (``privacy/epsilon-<party>``)."""
        if self.ledger is None:
            return {}
        summary = self.ledger.get("summary", {})
        numbers = {}
        if isinstance(summary.get("epsilon"), int | float):
            numbers["privacy/epsilon"] = float(summary["epsilon"])
        if isinstance(summary.get("target-delta"), int | float):
            numbers["privacy/delta"] = float(summary["target-delta"])
        for entry in self.ledger.get("threat-models", []):
            epsilon = entry.get("epsilon")
            if entry.get("holds") and isinstance(epsilon, int | float) and math.isfinite(epsilon):
                numbers[f"privacy/epsilon-{entry['threat-model']}"] = float(epsilon)
        return numbers

    def params(self) -> dict[str, Any]:
        """The run-config, values as TensorBoard and MLflow take them."""
        return {k: v if isinstance(v, bool | int | float | str) else str(v)
                for k, v in self.run_config.items()}  # fmt: skip


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_hparams(record: RunRecord) -> None:
    """The run-config and final metrics as TensorBoard hparams in ``tensorboard/``,
    beside the per-round scalars (one run in TensorBoard's HParams tab)."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    final = record.final()
    writer = SummaryWriter(log_dir=str(record.path / "tensorboard"))
    assert writer.file_writer is not None  # SummaryWriter() opens it
    try:
        for summary in hparams(record.params(), final):
            writer.file_writer.add_summary(summary)
        last = int(record.metrics["round"].max()) if not record.metrics.empty else 0
        for key, value in final.items():  # the HParams tab reads these scalars
            writer.add_scalar(key, value, last)
    finally:
        writer.close()


def mlflow_uri(settings: TrackingSettings, record: RunRecord) -> str:
    """The tracking URI: the key's, else the local file store beside the run."""
    return settings.mlflow_uri or (record.path.parent / "mlruns").resolve().as_uri()


def log_mlflow(settings: TrackingSettings, record: RunRecord) -> str:
    """Log ``record`` as one MLflow run; returns its run id."""
    uri = mlflow_uri(settings, record)
    if uri.startswith("file:"):
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless told:
        # a local store needs no server nor database, which is what a first run wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    name = settings.mlflow_experiment or str(record.run_config.get("task", "default"))
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    tags = {f"lab.{key}": str(record.run_config.get(key)) for key in TAGS}
    tags["lab.run-directory"] = str(record.path)
    if record.ledger is not None:
        holding = [e["threat-model"] for e in record.ledger.get("threat-models", [])
                   if e.get("holds") and e.get("epsilon") is not None]  # fmt: skip
        tags["lab.epsilon-holds-against"] = ", ".join(holding) or "nobody"
    run = client.create_run(experiment_id, run_name=record.path.name, tags=tags)
    run_id = run.info.run_id
    params = [Param(k, str(v)) for k, v in record.params().items()]
    for start in range(0, len(params), MLFLOW_BATCH):
        client.log_batch(run_id, params=params[start : start + MLFLOW_BATCH])
    stamp = int(record.path.stat().st_mtime * 1000)
    metrics = [Metric(k, v, stamp, step) for k, v, step in record.per_round()]
    metrics += [Metric(k, v, stamp, 0) for k, v in record.privacy_numbers().items()]
    for start in range(0, len(metrics), 10 * MLFLOW_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + 10 * MLFLOW_BATCH])
    for file in record.files():
        folder = file.parent.relative_to(record.path).as_posix()
        client.log_artifact(run_id, str(file), None if folder == "." else folder)
    failed = record.outcome is not None and record.outcome.get("status") == "failed"
    client.set_terminated(run_id, "FAILED" if failed else "FINISHED")
    return run_id


def wandb_dir(settings: TrackingSettings, record: RunRecord) -> Path:
    """The folder W&B writes its ``wandb/`` run folders under: the key's, else the
    output directory beside the run."""
    return Path(settings.wandb_dir).resolve() if settings.wandb_dir else record.path.parent


def log_wandb(settings: TrackingSettings, record: RunRecord) -> Path:
    """Log ``record`` as one W&B run, offline unless ``WANDB_MODE`` is set; returns the
    W&B run's folder."""
    import wandb

    root = wandb_dir(settings, record)
    root.mkdir(parents=True, exist_ok=True)
    mode = os.environ.get("WANDB_MODE") or "offline"  # nothing leaves the machine
    tags = [f"{key}={record.run_config.get(key)}" for key in TAGS]
    if record.ledger is not None:
        holding = [e["threat-model"] for e in record.ledger.get("threat-models", [])
                   if e.get("holds") and e.get("epsilon") is not None]  # fmt: skip
        tags.append("epsilon-holds-against=" + (", ".join(holding) or "nobody"))
    quiet = wandb.Settings(  # a finished run: no console capture, no system monitor
        mode=cast(Any, mode),  # WANDB_MODE as the user set it: wandb validates it
        silent=True,
        console="off",
        x_disable_stats=True,
        save_code=False,
    )
    run = wandb.init(
        dir=str(root),
        project=settings.wandb_project or str(record.run_config.get("task", "default")),
        name=record.path.name,
        config=record.params(),
        tags=[tag[:64] for tag in tags],  # W&B's limit on a tag's length
        settings=quiet,
    )
    failed = record.outcome is not None and record.outcome.get("status") == "failed"
    try:
        rounds: dict[int, dict[str, float]] = {}
        for key, value, step in record.per_round():
            rounds.setdefault(step, {})[key] = value
        for step in sorted(rounds):
            run.log(rounds[step], step=step)
        for key, value in record.privacy_numbers().items():
            run.summary[key] = value
        run.summary["run-directory"] = str(record.path)
        # "immutable": referenced in place, not copied to W&B's staging folder in $HOME
        artifact = wandb.Artifact(f"run-{record.path.name}", type="run-directory")
        for file in record.files():
            name = file.relative_to(record.path).as_posix()
            artifact.add_file(str(file), name=name, policy="immutable")
        run.log_artifact(artifact)
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish(exit_code=1 if failed else 0)
    return Path(run.dir).parent


def finish_run(run_dir: Path, run_config: Mapping[str, Any], log=None) -> str | None:
    """Hand the finished run to the trackers (hparams always; MLflow and W&B when the
    parsed options ``run_config`` say ``tracking.mlflow`` / ``tracking.wandb``); returns
    the MLflow run id, if logged. A tracker that fails is reported through
    ``log(level, fmt, *args)``; the run's files stand."""
    settings = TrackingSettings.from_options(run_config)
    record = RunRecord.read(Path(run_dir))
    say = log or (lambda *_: None)
    try:
        write_hparams(record)
    except Exception as err:  # a tracker never fails the run it records
        say(WARNING, "TensorBoard hparams not written: %s: %s", type(err).__name__, err)
    run_id = None
    if settings.mlflow:
        try:
            run_id = log_mlflow(settings, record)
        except Exception as err:  # e.g. mlflow not installed, server unreachable
            say(WARNING, "MLflow logging failed (%s: %s); install the `tracking` extra "
                "and check 'tracking.mlflow-uri'", type(err).__name__, err)  # fmt: skip
        else:
            say(INFO, "MLflow: run %s logged to %s", run_id, mlflow_uri(settings, record))
    if settings.wandb:
        try:
            folder = log_wandb(settings, record)
        except Exception as err:  # e.g. wandb not installed
            say(WARNING, "W&B logging failed (%s: %s); install the `wandb` extra",
                type(err).__name__, err)  # fmt: skip
        else:
            say(INFO, "W&B: run logged to %s (offline: `wandb sync %s` uploads it)",
                folder, folder)  # fmt: skip
    return run_id
