"""The in-process engine: a whole run of this app in one process, without Ray or a SuperLink.

The same ServerApp (``server_app.app:app``, called as Flower calls it) drives the same
ClientApp (``client_app.app:app``, mods included) through :class:`InProcessGrid`: a
grid whose ``send_and_receive`` hands each message to the destination node's ClientApp
in this process, one client after another, and returns the replies. Each virtual
SuperNode has the ``Context`` Flower's simulation gives it (node config
``partition-id`` / ``num-partitions``, a ``state`` kept across messages); the run-config
is the pyproject defaults with the overrides fused as ``flwr run --run-config`` fuses
them. Messages are not serialised: the ClientApp reads the server's records, the server
the ClientApp's (neither side writes into a record it received). The ClientApp's
per-process caches (task, partitions, model object) then serve every client of the run.

Design notes: ``docs/notes.md``, ``lab.engine``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import time
import tomllib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flwr.app import Context, Message

APP_DIR = Path(__file__).resolve().parents[1]
PYPROJECT = APP_DIR / "pyproject.toml"
ENGINE_NAME = "inprocess"
ENGINE_KEY = "engine"  # outcome.json and config.json's "environment": which engine ran it
FEDERATION_KEYS = ("num-supernodes", "client-resources-num-cpus", "client-resources-num-gpus")
DEFAULT_SUPERNODES = 10  # the local-simulation connection's default (lab.connections)
_RUN_DIR_LINE = re.compile(r"Run directory: (\S+)")


class EngineConfigError(ValueError):
    """A run-config or federation-config the engine cannot run (the message says why)."""


def pyproject_defaults() -> dict[str, Any]:
    """The app's run-config defaults (``[tool.flwr.app.config]``)."""
    return tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def fused_run_config(run_config: str | dict | None) -> dict[str, Any]:
    """The pyproject defaults with ``run_config`` on top, as ``flwr run`` fuses them: a
    string is parsed as Flower parses ``--run-config`` (``key=value`` pairs or one TOML
    file); a key the app does not declare is refused, as the SuperLink refuses it."""
    from flwr.common.config import fuse_dicts, parse_config_args

    overrides = (
        parse_config_args([run_config]) if isinstance(run_config, str) else dict(run_config or {})
    )
    defaults = pyproject_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise EngineConfigError(
            f"run-config key(s) {', '.join(map(repr, unknown))} are not declared by the app; "
            "valid keys are listed in docs/reference/run-config.md"
        )
    return fuse_dicts(defaults, overrides)


@dataclass(frozen=True)
class Federation:
    """The in-process federation: how many virtual SuperNodes, and the torch threads each
    ClientApp call gets (``client-resources-num-cpus``, as Ray gives each ClientApp)."""

    num_supernodes: int = DEFAULT_SUPERNODES
    num_cpus: int = 1

    @classmethod
    def parse(cls, federation_config: str | None) -> Federation:
        """From a ``--federation-config`` string (``"num-supernodes=100 ..."``)."""
        from flwr.common.config import parse_config_args

        given = parse_config_args([federation_config]) if federation_config else {}
        unknown = sorted(set(given) - set(FEDERATION_KEYS))
        if unknown:
            raise EngineConfigError(
                f"federation-config key(s) {', '.join(map(repr, unknown))} are not known to "
                f"the in-process engine; valid keys: {', '.join(FEDERATION_KEYS)}"
            )
        num, cpus = (
            given.get("num-supernodes", cls.num_supernodes),
            given.get("client-resources-num-cpus", cls.num_cpus),
        )
        for key, value in (("num-supernodes", num), ("client-resources-num-cpus", cpus)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{key!r} must be an integer >= 1, got {value!r}")
        if float(given.get("client-resources-num-gpus", 0) or 0) > 0:
            # Not refused silently: the ClientApp picks its device from vision.device.
            logging.getLogger("flwr").warning(
                "client-resources-num-gpus is ignored in process: vision.device decides"
            )
        return cls(num_supernodes=int(num), num_cpus=int(cpus))


class InProcessGrid:
    """A Flower grid (the calls the ServerApp makes of ``flwr.serverapp.Grid``) whose
    nodes ``node_ids`` (partition i = the i-th id) are the ClientApp in this process.

    It has no ``push_messages``/``pull_messages``: every reply is computed within
    ``send_and_receive``, so there is nothing to poll for (the app's poller asks such a
    grid with ``send_and_receive``, :func:`strategies.runtime.messaging.send_and_receive`)."""

    def __init__(self, config: dict, node_ids: list[int], client_app=None) -> None:
        from flwr.app import Context, RecordDict

        if client_app is None:
            from client_app.app import app as client_app
        self.client_app = client_app
        self.run_config = config
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": pid, "num-partitions": len(node_ids)},
                state=RecordDict(),
                run_config=config,
            )
            for pid, node in enumerate(node_ids)
        }
        self._message_ids = itertools.count(1)
        self.errors_as_replies = True
        """A ClientApp that raises answers with an error reply, as Flower's runtime makes
        it (False: the exception propagates, for tests)."""
        self.client_threads: int | None = None
        """torch threads while a ClientApp runs (None: leave torch's setting alone)."""

    def get_node_ids(self) -> list[int]:
        """The nodes that answer."""
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        """Each message handed to its node's ClientApp, in order; the replies."""
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in self.contexts:
                continue  # no such node: no reply, as from a node that is gone
            # Flower's grid gives each pushed message an id; its reply names it.
            message.metadata.__dict__["_message_id"] = f"inprocess-{next(self._message_ids)}"
            replies.append(self._answer(message, self.contexts[node]))
        return replies

    def _answer(self, message: Message, context: Context) -> Message:
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        try:
            if self.client_threads is None:
                return self.client_app(message, context)
            with _torch_threads(self.client_threads):
                return self.client_app(message, context)
        except Exception as ex:
            if not self.errors_as_replies:
                raise
            reason = str(type(ex)) + ":<'" + str(ex) + "'>"  # Flower's format (vce_api.py)
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
            return Message(error, reply_to=message)


class _torch_threads:
    """torch's intra-op threads set to ``n`` inside, restored after (a no-op when equal)."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, None

    def __enter__(self):
        import torch

        self.before = torch.get_num_threads()
        if self.before != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        import torch

        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


@dataclass(frozen=True)
class EngineRun:
    """One in-process run: exit code, the run directory (if one was made), wall time,
    status (``finished:completed``/``finished:failed``, as Flower names it), and the
    traceback when the ServerApp raised."""

    returncode: int
    run_dir: Path | None
    seconds: float
    status: str
    error: str = ""


def node_ids(num_supernodes: int) -> list[int]:
    """The virtual SuperNodes' ids. Fixed, not drawn as Flower draws them: the app orders
    nodes by the partition id each reports, so results do not depend on them."""
    return [1000 + i for i in range(num_supernodes)]


def run(
    run_config: str | dict | None = None,
    federation: Federation | None = None,
    *,
    grid_factory=None,
) -> EngineRun:
    """Run the ServerApp on ``federation`` in this process; see the module docstring.

    The ServerApp's log goes to Flower's logger (the console, as ``flwr run --stream``
    shows it). ``grid_factory(config, node_ids)`` builds the grid (default
    :class:`InProcessGrid`). A ServerApp that raises gives return code 1; its traceback
    is in ``error`` and logged."""
    federation = federation or Federation()
    config = fused_run_config(run_config)  # an undeclared key fails before the imports

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER
    from flwr.supercore.task_identity import TaskIdentity

    from server_app.app import app as server_app

    factory = grid_factory or InProcessGrid
    grid = factory(config, node_ids(federation.num_supernodes))
    grid.client_threads = federation.num_cpus
    # What Flower's runtime sets in a ServerApp's process: messages read it.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    seen = _RunDirectory()
    FLOWER_LOGGER.addHandler(seen)
    started, returncode, error = time.monotonic(), 0, ""
    try:
        # The server's torch (central evaluation, the aggregate) gets the clients' threads
        # too: two OpenMP threads on a small model under load cost ~30x one (measured:
        # a 16 x 64 linear at 4.4 ms vs 0.13 ms at a load of 7 on 2 cores).
        with _torch_threads(federation.num_cpus):
            server_app(grid, context)
    except Exception:  # the run failed: its outcome.json (if any) says why
        returncode, error = 1, traceback.format_exc()
        FLOWER_LOGGER.error("The ServerApp raised:\n%s", error)
    finally:
        FLOWER_LOGGER.removeHandler(seen)
    seconds = time.monotonic() - started
    if seen.path is not None:
        mark_engine(seen.path, federation)
    status = "finished:failed" if returncode else "finished:completed"
    return EngineRun(returncode, seen.path, seconds, status, error)


class _RunDirectory(logging.Handler):
    """Catches the ServerApp's "Run directory: ..." log line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.path: Path | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.path is None:
            match = _RUN_DIR_LINE.search(record.getMessage())
            if match:
                self.path = Path(match.group(1))


def engine_record(federation: Federation) -> dict[str, Any]:
    """What the run directory says of the engine that ran it."""
    return {
        "name": ENGINE_NAME,
        "num-supernodes": federation.num_supernodes,
        "client-threads": federation.num_cpus,
    }


def mark_engine(run_dir: Path, federation: Federation) -> None:
    """Add ``"engine"`` to ``outcome.json`` and to ``config.json``'s ``environment``
    (each rewritten atomically; a file the run did not write is left absent)."""
    record = engine_record(federation)
    for name, place in (("outcome.json", None), ("config.json", "environment")):
        path = run_dir / name
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        (doc.setdefault(place, {}) if place else doc)[ENGINE_KEY] = record
        tmp = path.with_name(f".{name}.engine")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)


def engine_of(run_dir: Path) -> str:
    """Which engine ran ``run_dir``: ``"inprocess"``, or ``"flwr"`` for a run directory
    the in-process engine did not mark (``flwr run``, a simulation or a deployment)."""
    try:
        doc = json.loads((Path(run_dir) / "outcome.json").read_text())
    except (OSError, ValueError):
        doc = {}
    return str((doc.get(ENGINE_KEY) or {}).get("name", "flwr"))


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.engine``: the same as ``python -m lab.run --engine inprocess``."""
    from lab.run import main as run_main

    return run_main(["--engine", ENGINE_NAME, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
