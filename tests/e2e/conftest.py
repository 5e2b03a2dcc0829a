"""End-to-end harness: `flwr run . local-simulation` exactly as the README says.

Each test session gets its own ``FLWR_HOME`` (so the user's ``~/.flwr`` is never
touched), registers the ``local-simulation`` connection with the app's own
``python -m server_app.connections``, and lets ``flwr run`` start the local SuperLink
as it does for users. At the end the SuperLink (found by its unique log-file path
under our ``FLWR_HOME``) and its process group are stopped by PID, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _superlink_processes(flwr_home: Path) -> list[psutil.Process]:
    marker = str(flwr_home / "local-superlink")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def _stop(processes: list[psutil.Process]) -> None:
    """SIGTERM each process's group and children, then SIGKILL what is left."""
    victims = []
    for proc in processes:
        try:
            victims += [proc, *proc.children(recursive=True)]
            os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    _, alive = psutil.wait_procs(victims, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


class FlowerEnv:
    """Runs `flwr` commands against a private FLWR_HOME."""

    def __init__(self, flwr_home: Path) -> None:
        self.home = flwr_home
        self.env = {
            **os.environ,
            "FLWR_HOME": str(flwr_home),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            # The app's dependencies are the ones installed per README; the local
            # SuperLink must not `uv sync` a second copy per run (see README).
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }

    def run(self, run_config: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`flwr run . local-simulation --run-config ... --stream`, from the repo."""
        cmd = [str(BIN / "flwr"), "run", ".", "local-simulation", "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        return subprocess.run(
            cmd,
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def runs(self) -> list[dict]:
        """`flwr list` as JSON: the runs this SuperLink knows, with their status."""
        out = subprocess.run(
            [str(BIN / "flwr"), "list", "local-simulation", "--format", "json"],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return json.loads(out[out.index("{") :])["runs"]


@pytest.fixture(scope="session")
def flower(tmp_path_factory) -> FlowerEnv:
    home = tmp_path_factory.mktemp("flwr-home")
    env = FlowerEnv(home)
    subprocess.run(
        [sys.executable, "-m", "server_app.connections", "--num-supernodes", "4"],
        cwd=REPO,
        env=env.env,
        check=True,
        capture_output=True,
    )
    try:
        yield env
    finally:
        _stop(_superlink_processes(home))
        deadline = time.monotonic() + 10
        while _superlink_processes(home) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _superlink_processes(home), "local SuperLink still running"
