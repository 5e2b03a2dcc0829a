"""The run directory: config, per-round metrics, checkpoint, final model, plots.

Layout (DESIGN.md)::

    <output-dir>/<YYYYmmdd-HHMMSS>-<task>-<strategy>-<privacy>/
        config.json      resolved run-config + environment
        metrics.csv      one row per (round, scope); scope in train, federated-eval,
                         central-eval
        participation.csv one row per (round, client sent a train message): node-id,
                         replied, error, and the metrics the client reported
        tensorboard/     the metrics.csv numbers as TensorBoard scalars
                         (``tensorboard --logdir <run dir>``)
        checkpoint/      the last finished round: global.pt (and cluster-<k>.pt),
                         state.json, and server.pt, everything ``resume-from`` needs
                         (global arrays, strategy state, ledger, generators)
        model.pt         final global model (torch state dict)
        plots/learning_curve.png

Every file is written to a temporary name and renamed, so a run killed mid-write
leaves the previous version intact. ``server.pt`` is written last in a round, and is
what a resumed run believes: rows of later rounds (written before it, by a run killed
in between) are dropped when the run resumes.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pandas as pd
import torch

from client_app.state import STATE_DIR
from tasks.options import ConfigError

DIST_NAME = "flower-privacy-lab"
SCOPES = ("train", "federated-eval", "central-eval")
ROUND_SECONDS = "round-seconds"  # train row: the round's wall time, messages to aggregate
# Columns that differ between identical runs by design (wall-clock time).
TIMING_COLUMNS = ("elapsed-s", ROUND_SECONDS)
SERVER_CHECKPOINT = "server.pt"
CHECKPOINT_FORMAT = 1
CLIENTS_DIR = "clients"  # what the clients write (logs, their state): shared in simulation
# Keys a resumed run may set differently from the run it continues.
RESUME_FREE_KEYS = ("resume-from", "output-dir")


def app_source_dir() -> Path | None:
    """The directory this app was pip-installed from, if it was installed from one.

    ``flwr run .`` ships the app to the SuperLink as a FAB, and the ServerApp runs in
    a process the SuperLink started, in whatever directory the SuperLink was first
    launched from, with its code unpacked under ``$FLWR_HOME/apps``: neither is where
    the user ran ``flwr run``. The one record of the user's checkout is the install's
    PEP 610 ``direct_url.json`` (``pip install -e .`` in the app directory).
    """
    # Several entries may match (an in-tree ``*.egg-info`` next to the installed
    # ``*.dist-info``); only the installed one records where it came from.
    for dist in metadata.distributions(name=DIST_NAME):
        raw = dist.read_text("direct_url.json")
        url = json.loads(raw).get("url", "") if raw else ""
        if url.startswith("file://"):
            path = Path(unquote(urlparse(url).path))
            if (path / "pyproject.toml").is_file():
                return path
    return None


def resolve_output_dir(output_dir: str) -> Path:
    """Absolute paths stay; relative ones resolve against the app's source directory
    (falling back to the current directory when the app was not installed from one).
    """
    path = Path(output_dir).expanduser()
    if path.is_absolute():
        return path
    return (app_source_dir() or Path.cwd()) / path


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode("utf-8"))


def _atomic_torch_save(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class RunDirectory:
    """Creates the run directory and writes everything a run produces into it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.participation: list[dict[str, Any]] = []
        # CSV file -> (its columns, how many rows it holds, the last of them)
        self._written: dict[str, tuple[list[str], int, Mapping[str, Any]]] = {}
        self._writer = None  # TensorBoard SummaryWriter, opened with the first row
        self.started = time.monotonic()

    @classmethod
    def create(cls, root: Path, task: str, strategy: str, privacy: str) -> RunDirectory:
        """Make ``<root>/<timestamp>-<task>-<strategy>-<privacy>`` (suffixed if taken)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = root / f"{stamp}-{task}-{strategy}-{privacy}"
        path, n = base, 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}-{n}")
        (path / "checkpoint").mkdir()
        (path / "plots").mkdir()
        return cls(path)

    def write_model(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Save a model's state dict as ``<name>`` (e.g. the warm-started model)."""
        _atomic_torch_save(self.path / name, dict(state_dict))

    def write_json(self, name: str, doc: Mapping[str, Any]) -> None:
        """Write ``doc`` as ``<name>`` (JSON) in the run directory."""
        (self.path / name).write_text(json.dumps(dict(doc), indent=2) + "\n")

    def write_config(self, run_config: Mapping[str, Any]) -> None:
        """Write the resolved run-config and the software environment."""
        doc = {
            "run-config": dict(run_config),
            # Wall-clock time at which the run directory was created (``elapsed-s`` in
            # metrics.csv counts from here).
            "started-at": datetime.now(UTC).isoformat(),
            "environment": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "flwr": metadata.version("flwr"),
                "torch": torch.__version__,
                "cuda": torch.cuda.is_available(),
                "serverapp-cwd": str(Path.cwd()),
                "app-source-dir": str(app_source_dir()),
            },
        }
        _atomic_write_text(self.path / "config.json", json.dumps(doc, indent=2) + "\n")

    def record(self, server_round: int, scope: str, metrics: Mapping[str, Any]) -> None:
        """Append one metrics row to ``metrics.csv``."""
        if scope not in SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {SCOPES}")
        row = {
            "round": server_round,
            "scope": scope,
            "elapsed-s": round(time.monotonic() - self.started, 3),
        }
        row.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        self.rows.append(row)
        self.write_rows("metrics.csv", self.rows)
        self._tensorboard(server_round, scope, row)

    def _tensorboard(self, server_round: int, scope: str, row: Mapping[str, Any]) -> None:
        """The same numbers as TensorBoard scalars ``<scope>/<metric>`` at step = round."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.path / "tensorboard"))
        for key, value in row.items():
            if key not in ("round", "scope") and isinstance(value, int | float):
                self._writer.add_scalar(f"{scope}/{key}", value, server_round)
        self._writer.flush()

    def checkpoint(
        self,
        server_round: int,
        state_dict: Mapping[str, torch.Tensor],
        models: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
        server_state: Mapping[str, Any] | None = None,
    ) -> None:
        """Save the global model of ``server_round`` (the latest finished round), any
        further named global models (e.g. ``cluster-0``: ``checkpoint/cluster-0.pt``),
        and, last, ``server_state`` (plain data: what ``resume-from`` restores)."""
        folder = self.path / "checkpoint"
        _atomic_torch_save(folder / "global.pt", dict(state_dict))
        for name, model in (models or {}).items():
            _atomic_torch_save(folder / f"{name}.pt", dict(model))
        state = {"round": server_round, "models": sorted(models or {})}
        _atomic_write_text(folder / "state.json", json.dumps(state) + "\n")
        if server_state is not None:
            payload = {"format": CHECKPOINT_FORMAT, "round": server_round, **server_state}
            _atomic_torch_save(folder / SERVER_CHECKPOINT, payload)

    def write_rows(self, name: str, rows: list[Mapping[str, Any]]) -> None:
        """Bring the CSV file ``name`` up to ``rows`` (metrics, participation, the
        strategies' per-client tables).

        Tables grow by rows added at the end, and rows once written do not change. When
        ``rows`` still holds, in place, the last row written to ``name`` and the rows
        after it bring no new column, only those rows are appended, so a round costs
        the same at round 1 000 as at round 1 (rewriting every table every round made
        writing results quadratic in the rounds). Otherwise (a table built afresh, a
        new column) the file is rewritten. The values read back are the same either way.
        """
        written = self._written.get(name)
        if written is not None:
            columns, count, last = written
            new = rows[count:]
            same_table = 0 < count <= len(rows) and rows[count - 1] is last
            if same_table and all(key in columns for row in new for key in row):
                if new:
                    with (self.path / name).open("a", encoding="utf-8") as file:
                        frame = pd.DataFrame(list(new), columns=columns)
                        file.write(frame.to_csv(index=False, header=False))
                    self._written[name] = (columns, len(rows), rows[-1])
                return
        frame = pd.DataFrame(rows)
        _atomic_write_text(self.path / name, frame.to_csv(index=False))
        if rows:
            self._written[name] = (list(frame.columns), len(rows), rows[-1])

    def record_round(self, result, ledger=None, models=None, server_state=None) -> None:
        """Record one round's metrics by scope; checkpoint the model(s), the server's
        state and the ledger."""
        train = result.train
        if train is not None and result.seconds is not None:  # no row for aborted rounds
            train = {**dict(train), ROUND_SECONDS: round(result.seconds, 4)}
        for scope, record in (
            ("train", train),
            ("federated-eval", result.federated_eval),
            ("central-eval", result.central_eval),
        ):
            if record is not None:
                self.record(result.server_round, scope, dict(record))
        if result.clients:
            self.participation.extend(result.clients)
            self.write_rows("participation.csv", self.participation)
        if result.server_round > 0:
            self.checkpoint(
                result.server_round, result.arrays.to_torch_state_dict(), models, server_state
            )
            if ledger is not None:
                self.write_ledger(ledger)

    @classmethod
    def resume(cls, path: Path, run_config: Mapping[str, Any]) -> tuple[RunDirectory, dict]:
        """Reopen the run directory ``path`` to continue it; return it and the saved
        server state (``checkpoint/server.pt``).

        Rows of rounds after the checkpoint (a run killed between writing its metrics
        and its checkpoint) are dropped from ``metrics.csv`` and ``participation.csv``,
        and so are the clients' saved states of those rounds (simulation: they share
        this directory), so no round is counted twice.

        Raises
        ------
        ConfigError
            If ``path`` holds no checkpoint, or its run-config differs from
            ``run_config`` in any key but ``resume-from`` and ``output-dir``.
        """
        key = "'resume-from'"
        file = path / "checkpoint" / SERVER_CHECKPOINT
        if not (path / "config.json").is_file() or not file.is_file():
            raise ConfigError(
                f"{key} = {str(path)!r} is not a run directory with a checkpoint "
                f"(config.json and checkpoint/{SERVER_CHECKPOINT}, written after every round)"
            )
        saved = json.loads((path / "config.json").read_text())["run-config"]
        differ = sorted(
            k
            for k in set(saved) | set(run_config)
            if k not in RESUME_FREE_KEYS and saved.get(k) != run_config.get(k)
        )
        if differ:
            shown = "; ".join(
                f"{k!r}: {saved.get(k)!r} then, {run_config.get(k)!r} now" for k in differ
            )
            raise ConfigError(f"{key} = {str(path)!r} ran with another run-config ({shown})")
        state = torch.load(file, weights_only=True)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(
                f"{key}: checkpoint format {state.get('format')!r} is not {CHECKPOINT_FORMAT}"
            )
        done = int(state["round"])
        run_dir = cls(path)
        run_dir.rows = _rows_through(path / "metrics.csv", done)
        run_dir.participation = _rows_through(path / "participation.csv", done)
        if run_dir.rows:
            run_dir.started -= float(run_dir.rows[-1]["elapsed-s"])
            run_dir.write_rows("metrics.csv", run_dir.rows)
        if run_dir.participation:
            run_dir.write_rows("participation.csv", run_dir.participation)
        for stale in (path / CLIENTS_DIR / STATE_DIR).glob("partition-*/round-*.bin"):
            if int(stale.stem.removeprefix("round-")) > done:
                stale.unlink()
        return run_dir, state

    def write_ledger(self, ledger) -> None:
        """``ledger.json``: the human summary and the full, reloadable state."""
        doc = {"summary": ledger.summary(), "state": ledger.state_dict()}
        _atomic_write_text(self.path / "ledger.json", json.dumps(doc, indent=2) + "\n")

    def finish(self, state_dict: Mapping[str, torch.Tensor], title: str) -> None:
        """Save the final model and the learning-curve plot."""
        import matplotlib

        matplotlib.use("Agg")  # the ServerApp draws to files only, display or not
        import matplotlib.pyplot as plt

        from server_app.plots import plot_learning_curve

        _atomic_torch_save(self.path / "model.pt", dict(state_dict))
        if self._writer is not None:
            self._writer.close()
        if self.rows:
            figure = plot_learning_curve(pd.DataFrame(self.rows), title=title)
            figure.savefig(self.path / "plots" / "learning_curve.png", dpi=120)
            plt.close(figure)


def _rows_through(csv: Path, last_round: int) -> list[dict[str, Any]]:
    """The rows of ``csv`` up to ``last_round`` (every column, in the file's order)."""
    if not csv.is_file():
        return []
    frame = pd.read_csv(csv)
    return frame[frame["round"] <= last_round].to_dict("records")


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Read a run directory's ``metrics.csv``, tagged with the run's config columns."""
    run_dir = Path(run_dir)
    frame = pd.read_csv(run_dir / "metrics.csv")
    config = json.loads((run_dir / "config.json").read_text())["run-config"]
    for key in ("task", "strategy", "privacy", "seed"):
        frame[key] = config[key]
    frame["run"] = run_dir.name
    return frame
