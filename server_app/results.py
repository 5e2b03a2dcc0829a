"""The run directory: config, per-round metrics, checkpoint, final model, plots.

Design notes: ``docs/notes.md``, ``server_app.results``.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import numpy as np
import pandas as pd

from config.options import ConfigError
from config.renamed import current_keys
from protocol.keys import STATE_DIR
from protocol.records import to_state_dict
from server_app.failures import OUTCOME_FILE
from tasks.metric_keys import TRAIN_SECONDS

if TYPE_CHECKING:
    import torch
    from torch.utils.tensorboard import SummaryWriter

DIST_NAME = "flower-privacy-lab"
SCOPES = ("train", "federated-eval", "central-eval")
ROUND_SECONDS = "round-seconds"  # train row: the round's wall time, messages to aggregate
# Columns that differ between identical runs by design (wall-clock time).
TIMING_COLUMNS = ("elapsed-s", ROUND_SECONDS, TRAIN_SECONDS)
SERVER_CHECKPOINT = "server.pt"
CHECKPOINT_FORMAT = 3  # 3: each strategy layer's own state_dict(); 2: attribute lists
CURATOR_DIR = "curator"  # under a privacy mechanism: what no epsilon covers
CLIENTS_DIR = "clients"  # what the clients write (logs, their state): shared in simulation
STRATEGY_STATE = "strategy"  # the checkpoint's strategy layers' state (not a run-config read)
CHECKPOINT_KEYS = ("round", "arrays", STRATEGY_STATE, "rng", "result")
REJECTED = "rejected"  # a committed round that failed the divergence guard (not resumable)
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


def _open_private(path: Path):
    """``path`` opened for writing, owner-only (0600) from the moment it exists, whatever
    the umask (``fchmod``: an older file of that name keeps its mode otherwise)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


def private_dir(path: Path) -> Path:
    """Make (or keep) the directory ``path`` owner-only (0700) whatever the umask."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _atomic_write_bytes(path: Path, data: bytes, *, private: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    if private:
        with _open_private(tmp) as file:
            file.write(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str, *, private: bool = False) -> None:
    _atomic_write_bytes(path, text.encode("utf-8"), private=private)


def _atomic_torch_save(path: Path, obj: Any, *, private: bool = False) -> None:
    """``torch.save`` to a temporary name, then rename; ``private``: owner-only (0600)
    from the moment the file exists."""
    import torch  # on use: reading a run's tables (a notebook, lab.figures) needs no torch

    tmp = path.with_name(f".{path.name}.tmp")
    if private:
        with _open_private(tmp) as file:
            torch.save(obj, file)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


Released = Callable[[str], bool]  # train metric key -> covered by the run's epsilon


def _csv_cells(values: list[Any]) -> list[str] | None:
    """One column's cells as ``DataFrame.to_csv`` writes them, for the kinds of column
    whose dtype pandas infers plainly (every value a str, a bool, or a Python int; or
    floats, some missing; or none at all); None for any other column. A missing value
    is ``_MISSING``."""
    present = [v for v in values if v is not _MISSING]
    if not present:  # a column these rows do not have (an eval row's train columns)
        return [""] * len(values)
    kinds = {type(v) for v in present}
    if kinds <= {float}:  # float64: NaN and missing are empty; repr otherwise
        return ["" if v is _MISSING or v != v else repr(v) for v in values]
    if kinds == {str}:  # object: missing is empty
        return ["" if v is _MISSING else v for v in values]
    if len(present) == len(values) and kinds in ({int}, {bool}):  # int64, bool
        return [str(v) for v in values]
    return None


_MISSING = object()


def _csv_rows(rows: Sequence[Mapping[str, Any]], columns: list[str]) -> str:
    """``pd.DataFrame(rows, columns=columns).to_csv(index=False, header=False)``.

    Hand-written for the run directory's appends (a round's rows, once a round): pandas
    builds a frame and infers dtypes for them, 1.6 ms a table, more than the rest of a
    small model's round writes. Columns of other kinds go to pandas, whose text this is
    (tests/server_app/test_results.py holds the two equal)."""
    cells = [_csv_cells([row.get(c, _MISSING) for row in rows]) for c in columns]
    if any(column is None for column in cells):
        frame = pd.DataFrame(list(rows), columns=columns)
        return frame.to_csv(index=False, header=False)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(zip(*cells, strict=True))
    return out.getvalue()


class RunDirectory:
    """Creates the run directory and writes everything a run produces into it.

    ``released``: under a privacy mechanism, which train metric keys the ε covers
    (:meth:`strategies.mechanisms.base.PrivacyWrapper.releases_metric`); the rest goes to
    ``curator/`` (see the module docstring). None: no mechanism, one layout.
    """

    def __init__(self, path: Path, released: Released | None = None) -> None:
        self.path = path
        self.released = released
        self.rows: list[dict[str, Any]] = []
        self.curator_rows: list[dict[str, Any]] = []  # curator/metrics.csv
        self.participation: list[dict[str, Any]] = []
        self.previous_outcomes: list[dict[str, Any]] = []  # of the runs a resume continues
        # CSV file -> (its columns, how many rows it holds, the last of them)
        self._written: dict[str, tuple[list[str], int, Mapping[str, Any]]] = {}
        self._release_texts: list[tuple[Any, str]] = []  # ledger.json: _ledger_text
        self._writer: SummaryWriter | None = None  # TensorBoard's, opened with the first row
        self.started = time.monotonic()
        private_dir(path / "checkpoint")
        if released is not None:
            private_dir(path / CURATOR_DIR)

    @property
    def clients_dir(self) -> Path:
        """Where the clients keep their own files in a simulation (``artifacts-dir``):
        ``curator/clients`` under a privacy mechanism (they hold what the server may not
        publish: accountant histories, local layers, PPO snapshots), else ``clients``."""
        base = self.path if self.released is None else self.path / CURATOR_DIR
        return base / CLIENTS_DIR

    @staticmethod
    def private(name: str) -> bool:
        """Whether the file ``name`` (relative to the run directory) is owner-only."""
        return name.startswith((f"{CURATOR_DIR}/", "checkpoint/"))

    def table(self, name: str) -> str:
        """Where a per-client table (participation, clusters, selection, edges) goes:
        ``curator/<name>`` under a privacy mechanism, else ``<name>``."""
        return name if self.released is None else f"{CURATOR_DIR}/{name}"

    @classmethod
    def create(
        cls, root: Path, task: str, strategy: str, privacy: str, released: Released | None = None
    ) -> RunDirectory:
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
        (path / "plots").mkdir()
        return cls(path, released)

    def write_model(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Save a model's state dict as ``<name>`` (e.g. the warm-started model)."""
        _atomic_torch_save(self.path / name, dict(state_dict))

    def write_json(self, name: str, doc: Mapping[str, Any]) -> None:
        """Write ``doc`` as ``<name>`` (JSON) in the run directory (owner-only under
        ``curator/`` and ``checkpoint/``)."""
        text = json.dumps(dict(doc), indent=2) + "\n"
        _atomic_write_text(self.path / name, text, private=self.private(name))

    def write_config(self, run_config: Mapping[str, Any]) -> None:
        """Write the resolved run-config and the software environment."""
        import torch

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
        """Append one metrics row to ``metrics.csv`` (under a privacy mechanism: what the
        ε covers; the rest of the row to ``curator/metrics.csv``)."""
        if scope not in SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {SCOPES}")
        key = {"round": server_round, "scope": scope}
        values = {"elapsed-s": round(time.monotonic() - self.started, 3)}
        values.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        if self.released is None:
            row = {**key, **values}
            self.rows.append(row)
            self.write_rows("metrics.csv", self.rows)
            self._tensorboard(server_round, scope, row)
            return
        covered = {k: v for k, v in values.items() if self._covered(scope, k)}
        rest = {k: v for k, v in values.items() if k not in covered}
        if scope != "federated-eval":
            row = {**key, **covered}
            self.rows.append(row)
            self.write_rows("metrics.csv", self.rows)
            self._tensorboard(server_round, scope, row)
        if rest:
            self.curator_rows.append({**key, **rest})
            self.write_rows(f"{CURATOR_DIR}/metrics.csv", self.curator_rows)

    def _covered(self, scope: str, key: str) -> bool:
        """Under a privacy mechanism: central evaluation of the released model, and the
        train metrics the wrapper computes from released quantities; not wall-clock
        timing (it depends on the clients' data) nor anything the clients reported."""
        if key in TIMING_COLUMNS:
            return False
        if scope == "central-eval":
            return True
        return scope == "train" and self.released is not None and self.released(key)

    def _tensorboard(self, server_round: int, scope: str, row: Mapping[str, Any]) -> None:
        """The same numbers as TensorBoard scalars ``<scope>/<metric>`` at step = round."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.path / "tensorboard"))
        # Under a privacy mechanism each event's wall time is its round, not the clock:
        # the time a round took depends on the clients' data (timing is curator-only).
        walltime = None if self.released is None else float(server_round)
        for key, value in row.items():
            if key not in ("round", "scope") and isinstance(value, int | float):
                self._writer.add_scalar(f"{scope}/{key}", value, server_round, walltime)
        self._writer.flush()

    def commit(self, server_round: int, server_state: Mapping[str, Any]) -> None:
        """Commit round ``server_round``: ``checkpoint/server.pt`` (plain data: what
        ``resume-from`` restores, the secret DP generator state included), owner-only.
        Called after the round's aggregate, before anything of the round is written or
        sent (see the module docstring)."""
        payload = {"format": CHECKPOINT_FORMAT, "round": server_round, **server_state}
        _atomic_torch_save(self.path / "checkpoint" / SERVER_CHECKPOINT, payload, private=True)

    def reject(self, server_round: int, server_state: Mapping[str, Any], reason: str) -> None:
        """Mark committed round ``server_round`` as failed by the divergence guard: the
        same payload (its privacy charge stays committed), flagged so that
        ``resume-from`` refuses it rather than continue from the diverged model."""
        rejected = {"reason": reason, "last-round": server_round - 1}
        self.commit(server_round, {**server_state, REJECTED: rejected})

    def checkpoint(
        self,
        server_round: int,
        state_dict: Mapping[str, torch.Tensor],
        models: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        """Save the global model of ``server_round`` (the latest finished round) and any
        further named global models (e.g. ``cluster-0``: ``checkpoint/cluster-0.pt``)."""
        folder = self.path / "checkpoint"
        _atomic_torch_save(folder / "global.pt", dict(state_dict), private=True)
        for name, model in (models or {}).items():
            _atomic_torch_save(folder / f"{name}.pt", dict(model), private=True)
        state = {"round": server_round, "models": sorted(models or {})}
        _atomic_write_text(folder / "state.json", json.dumps(state) + "\n", private=True)

    def write_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
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
                        file.write(_csv_rows(new, columns))
                    self._written[name] = (columns, len(rows), rows[-1])
                return
        frame = pd.DataFrame(rows)
        _atomic_write_text(self.path / name, frame.to_csv(index=False), private=self.private(name))
        if rows:
            self._written[name] = (list(frame.columns), len(rows), rows[-1])

    def record_round(self, result, ledger=None, models=None) -> None:
        """Record one (committed) round's metrics by scope and its participation; save
        the model(s) and the ledger."""
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
            self.write_rows(self.table("participation.csv"), self.participation)
        if result.server_round > 0 and not getattr(result, "diverged", False):
            self.checkpoint(result.server_round, to_state_dict(result.arrays), models)
            if ledger is not None:
                self.write_ledger(ledger)

    @classmethod
    def resume(
        cls, path: Path, run_config: Mapping[str, Any], released: Released | None = None
    ) -> tuple[RunDirectory, dict]:
        """Reopen the run directory ``path`` to continue it; return it and the saved
        server state (``checkpoint/server.pt``, committed after round t's aggregate).

        Rows of round t and later rounds are dropped from ``metrics.csv`` and the
        participation table (the resumed run writes round t's again after evaluating
        it), and so are the clients' saved states of rounds after t (simulation: they
        share this directory), so no round is counted twice.

        Raises
        ------
        ConfigError
            If ``path`` holds no checkpoint, or its run-config differs from
            ``run_config`` in any key but ``resume-from`` and ``output-dir``.
        """
        state = _load_checkpoint(path, run_config)
        done = int(state["round"])
        run_dir = cls(path, released)
        run_dir.previous_outcomes = _previous_outcomes(path)
        run_dir.rows = _rows_before(path / "metrics.csv", done)
        run_dir.curator_rows = _rows_before(path / CURATOR_DIR / "metrics.csv", done)
        participation = run_dir.table("participation.csv")
        run_dir.participation = _rows_before(path / participation, done)
        timed = run_dir.rows if released is None else run_dir.curator_rows
        if timed:
            run_dir.started -= float(timed[-1]["elapsed-s"])
        for name, rows in (
            ("metrics.csv", run_dir.rows),
            (f"{CURATOR_DIR}/metrics.csv", run_dir.curator_rows),
            (participation, run_dir.participation),
        ):
            if rows or (path / name).is_file():
                run_dir.write_rows(name, rows)
        for stale in (run_dir.clients_dir / STATE_DIR).glob("partition-*/round-*.bin"):
            if int(stale.stem.removeprefix("round-")) > done:
                stale.unlink()
        return run_dir, state

    def layout(self) -> dict[str, list[str]]:
        """The files of the run directory by what covers them, for ``ledger.json``
        (``tests/server_app/test_published_files.py`` checks every published file and
        column against it)."""
        released = ["config.json", "metrics.csv", "model.pt", "checkpoint/global.pt",
                    "checkpoint/<model>.pt", "ledger.json", "certificates.json", "audit.json",
                    "plots/", "tensorboard/", "warm-start.*", "outcome.json",
                    # software, federation size and the run-config: no client's data
                    "environment.json", "rerun.sh"]  # fmt: skip
        private = self.released is not None
        return {
            "covered-by-epsilon": released if private else [],
            "not-covered": [
                *([f"{CURATOR_DIR}/"] if private else []),
                *(
                    []
                    if private
                    else [
                        "metrics.csv",
                        "participation.csv",
                        "<strategy tables>.csv",
                        "outcome.json",
                        f"{CLIENTS_DIR}/",
                    ]
                ),
                "modification times of the files (they are rewritten every round)",
            ],
            "secret": [f"checkpoint/{SERVER_CHECKPOINT} (DP generator state; owner-only)"],
        }

    def write_ledger(self, ledger, extra: Mapping[str, Any] | None = None) -> None:
        """``ledger.json``: the human summary, the full reloadable state, what in the
        run directory the ε covers, and ``extra`` (e.g. the threat models)."""
        doc = {"summary": ledger.summary(), "state": ledger.state_dict()}
        doc["run-directory"] = self.layout()
        doc.update(extra or {})
        _atomic_write_text(self.path / "ledger.json", self._ledger_text(doc) + "\n")

    def _ledger_text(self, doc: dict[str, Any]) -> str:
        """``json.dumps(doc, indent=2)``, each of the state's releases rendered once.

        The ledger lists every round's release and is rewritten every round: rendering
        them all each time made writing it quadratic in the rounds (10 ms a round by
        round 1 000). A release already rendered is reused while it still equals the
        one it was rendered from; the text is the same either way."""
        releases = doc.get("state", {}).get("releases")
        if not isinstance(releases, list):
            return json.dumps(doc, indent=2)
        marker = "\x00releases\x00"  # the list's place in the rest's text
        rest = json.dumps({**doc, "state": {**doc["state"], "releases": marker}}, indent=2)
        token = json.dumps(marker)
        if rest.count(token) != 1:
            return json.dumps(doc, indent=2)
        done = self._release_texts
        kept = 0
        while kept < min(len(done), len(releases)) and done[kept][0] == releases[kept]:
            kept += 1
        del done[kept:]
        for release in releases[kept:]:
            text = json.dumps(release, indent=2).replace("\n", "\n      ")
            done.append((copy.deepcopy(release), "      " + text))
        body = "[\n" + ",\n".join(text for _, text in done) + "\n    ]" if done else "[]"
        return rest.replace(token, body)

    def write_outcome(self, outcome) -> None:
        """``outcome.json``: how the run ended (:class:`server_app.failures.Outcome`),
        and how each run this one resumed had ended (``previous-outcomes``), so a
        resumed run never hides an earlier failure."""
        doc = outcome.to_json()
        if self.previous_outcomes:
            doc["previous-outcomes"] = self.previous_outcomes
        self.write_json(OUTCOME_FILE, doc)

    def finish(
        self, state_dict: Mapping[str, torch.Tensor] | None, title: str, caption: str = ""
    ) -> None:
        """Save the final model (``None``: a failed run, whose last good model is in
        ``checkpoint/``) and the learning-curve plot (``caption``: its ε line)."""
        import matplotlib

        matplotlib.use("Agg")  # the ServerApp draws to files only, display or not

        from server_app.plots import plot_learning_curve, save_figure

        if state_dict is not None:
            _atomic_torch_save(self.path / "model.pt", dict(state_dict))
        if self._writer is not None:
            self._writer.close()
        if self.rows:
            figure = plot_learning_curve(pd.DataFrame(self.rows), title=title, caption=caption)
            save_figure(figure, self.path / "plots" / "learning_curve.png")


def _load_checkpoint(path: Path, run_config: Mapping[str, Any]) -> dict:
    """``path``'s server checkpoint, if ``path`` is a run of ``run_config`` that this
    version of the app can continue (else ConfigError naming 'resume-from')."""
    key = "'resume-from'"
    file = path / "checkpoint" / SERVER_CHECKPOINT
    if not (path / "config.json").is_file() or not file.is_file():
        raise ConfigError(
            f"{key} = {str(path)!r} is not a run directory with a checkpoint "
            f"(config.json and checkpoint/{SERVER_CHECKPOINT}, written after every round)"
        )
    try:
        saved = current_keys(json.loads((path / "config.json").read_text())["run-config"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{key} = {str(path)!r}: {path / 'config.json'} cannot be read as a run's "
            f"config ({type(err).__name__}: {err})"
        ) from None
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
    import torch

    try:
        state = torch.load(file, weights_only=True)
    except Exception as err:  # torch raises several kinds for a damaged file
        raise ConfigError(
            f"{key} = {str(path)!r}: the checkpoint {file} cannot be read (truncated or "
            f"corrupted? {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"{key}: checkpoint {file} has format {found!r}, not {CHECKPOINT_FORMAT} "
            "(written by another version of this app)"
        )
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise ConfigError(f"{key}: checkpoint {file} lacks {missing} (truncated or corrupted)")
    rejected = state.get(REJECTED)
    if rejected:
        raise ConfigError(
            f"{key} = {str(path)!r}: that run failed after round {state['round']}: "
            f"{rejected['reason']}. Its committed round {state['round']} did not pass the "
            f"divergence guard; its last good round is 'last-round' = "
            f"{rejected['last-round']} (checkpoint/global.pt). Resuming would continue from "
            "the diverged model: start a new run (e.g. with a smaller 'vision.lr')"
        )
    return state


def _previous_outcomes(path: Path) -> list[dict[str, Any]]:
    """The outcomes of the runs that wrote ``path`` before (oldest first)."""
    file = path / OUTCOME_FILE
    if not file.is_file():
        return []
    try:
        doc = json.loads(file.read_text())
    except ValueError:
        return [{"status": "unknown", "reason": f"{file} could not be read"}]
    earlier = doc.pop("previous-outcomes", [])
    return [*earlier, doc]


def _rows_before(csv: Path, first_dropped: int) -> list[dict[str, Any]]:
    """The rows of ``csv`` of rounds before ``first_dropped`` (every column, in the
    file's order)."""
    if not csv.is_file():
        return []
    frame = pd.read_csv(csv)
    return frame[frame["round"] < first_dropped].to_dict("records")


def table_path(run_dir: str | Path, name: str) -> Path | None:
    """Where a run keeps the per-client table ``name`` (e.g. ``participation.csv``):
    at the top level, or under ``curator/`` in a privacy run; None if it has none."""
    for path in (Path(run_dir) / name, Path(run_dir) / CURATOR_DIR / name):
        if path.is_file():
            return path
    return None


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Read a run directory's ``metrics.csv``, tagged with the run's config columns.

    Under a privacy mechanism the rows and columns of ``curator/metrics.csv`` (what no
    ε covers: client reports, federated evaluation, timing) are merged in by (round,
    scope): analysis sees the whole run, publication takes the top level only."""
    run_dir = Path(run_dir)
    frame = pd.read_csv(run_dir / "metrics.csv")
    curator = run_dir / CURATOR_DIR / "metrics.csv"
    if curator.is_file():
        frame = frame.merge(pd.read_csv(curator), on=["round", "scope"], how="outer")
        order = frame["scope"].map({scope: i for i, scope in enumerate(SCOPES)})
        frame = frame.iloc[np.lexsort((order, frame["round"]))].reset_index(drop=True)
    config = json.loads((run_dir / "config.json").read_text())["run-config"]
    for key in ("task", "strategy", "privacy", "seed"):
        frame[key] = config[key]
    frame["run"] = run_dir.name
    return frame
