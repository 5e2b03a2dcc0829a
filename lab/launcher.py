"""Run this app through `flwr run . local-simulation` from Python, and clean up after.

Used by the end-to-end tests, the benchmarks and experiment suites: each
:class:`LocalSimulation` gets its own ``FLWR_HOME`` (the user's ``~/.flwr`` is never
touched), registers ``local-simulation`` with :mod:`lab.connections`, lets
``flwr run`` start the local SuperLink as it does for users, and on exit stops that
SuperLink and its process group by PID (found by its log-file path, which lies under
our ``FLWR_HOME`` and so is unique to us).

Dependencies are not re-installed per run: ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION
=1`` is set for the SuperLink (see the README's "Where the app's dependencies come from").

Design notes: ``docs/notes.md``, ``lab.launcher``.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from lab import check

APP_DIR = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
_RUN_DIR_LINE = re.compile(r"Run directory: (\S+)")
_RUN_ID_LINE = re.compile(r"Successfully started run (\d+)")


@dataclass(frozen=True)
class RunOutcome:
    """One `flwr run`: exit code, output, the run directory (if one was made), time.

    ``flwr run --stream`` exits 0 even when the ServerApp raised; ``returncode`` is 1
    then, from the run's status on the SuperLink (``status``, e.g. ``finished:failed``).
    """

    returncode: int
    output: str
    run_dir: Path | None
    seconds: float
    status: str = ""


def stage_app(source: Path, dest: Path) -> int:
    """Copy the files ``flwr run`` would package from ``source`` to ``dest``; return
    how many.

    Flower 1.42's FAB builder (``flwr.cli.utils.collect_files``) resolves every file
    under the app directory and only then filters by ``.gitignore``: with a ``.venv``
    inside the checkout (~65 000 files) that is ~4 s of every ``flwr run .`` on 2 cores.
    Here git-ignored and always-excluded directories are pruned before they are walked,
    and the files kept are Flower's own selection (``filter_paths_for_publish``, the
    first filter of its build), so the FAB built from ``dest`` has the same content.
    """
    # Imported here: Flower's CLI costs ~1 s, and the study commands' --help imports this.
    from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns
    from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS

    ignored = build_pathspec(load_gitignore_patterns(source / ".gitignore"))
    always_out = build_pathspec(APP_PUBLISH_EXCLUDE_PATTERNS)  # Flower's own exclusions
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
        rel = Path(dirpath).relative_to(source)
        dirnames[:] = [
            d
            for d in dirnames
            if not any(
                spec.match_file(f"{(rel / d).as_posix()}/") for spec in (ignored, always_out)
            )
            and not (Path(dirpath) / d).is_symlink()
        ]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                files[(rel / name).as_posix()] = path
    kept = filter_paths_for_publish(files)
    for rel_path, path in kept.items():
        target = dest / rel_path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return len(kept)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections, port 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; macOS picks from 49152-65535


def free_port() -> int:
    """A TCP port free on loopback now, for a process we start to listen on later.

    Not the OS's choice for port 0: that comes from the ephemeral range, from which the
    kernel also hands out the local ports of outgoing connections, so in the seconds a
    SuperNode or SuperLink takes to import and bind, another process's connection can
    take it (a CI run failed on "address already in use" this way). We draw at random
    below the ephemeral range, where only an explicit bind can collide.
    """
    low, _ = ephemeral_range()
    first = 10_000  # above the well-known and most registered service ports
    if low - first >= 1_000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(first, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    with socket.socket() as sock:  # no room below the range, or none bound: the OS's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def superlink_processes(flwr_home: Path) -> list[psutil.Process]:
    """The local SuperLink processes whose command line names ``flwr_home``."""
    marker = str(flwr_home / "local-superlink")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def stop_processes(processes: list[psutil.Process], timeout: float = 10) -> None:
    """SIGTERM each process's group and children, then SIGKILL what is left."""
    victims: list[psutil.Process] = []
    for proc in processes:
        try:
            victims += [proc, *proc.children(recursive=True)]
            os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    _, alive = psutil.wait_procs(victims, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


class LocalSimulation:
    """A private Flower home with a ``local-simulation`` connection and a local SuperLink
    on its own free port; a context manager.

    Parameters
    ----------
    num_supernodes : int
        Virtual SuperNodes of the connection.
    flwr_home : Path, optional
        Flower home to use; a temporary one (removed on exit) by default.
    ray_address : str, optional
        A Ray cluster (the head's GCS address ``HOST:PORT``) for the ClientApps to run
        on instead of a Ray of the simulation's own: the connection is registered with
        ``lab.connections --ray-address`` and ``RAY_ADDRESS`` is set for the local
        SuperLink it starts (Flower cannot carry it otherwise).
    env : dict, optional
        Extra environment variables for the local SuperLink, and so for its
        simulations and their Ray (e.g. Ray's ``RAY_*`` settings).
    """

    def __init__(
        self,
        num_supernodes: int = 10,
        flwr_home: Path | None = None,
        ray_address: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self._own_home = flwr_home is None
        self.home = Path(tempfile.mkdtemp(prefix="flwr-home-")) if flwr_home is None else flwr_home
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            # Its own local SuperLink: not one already on the machine-wide default port
            # 39091 (another user's, or one started with another environment), and
            # several of these can run at once (the e2e tests on two workers).
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            **(env or {}),
        }
        ray_args = []
        if ray_address is not None:  # the connection keeps its name `local-simulation`
            self.env["RAY_ADDRESS"] = ray_address
            ray_args = ["local-simulation", "--ray-address", ray_address]
        # As the README's install command: it starts the local SuperLink (with self.env)
        # and sets its simulation's size, which Flower keeps in the SuperLink only.
        try:
            subprocess.run(
                [sys.executable, "-m", "lab.connections", *ray_args,
                 "--num-supernodes", str(num_supernodes)],
                cwd=APP_DIR,
                env=self.env,
                check=True,
                capture_output=True,
            )  # fmt: skip
        except BaseException as err:
            self.stop()
            if isinstance(err, subprocess.CalledProcessError):  # say why, not only the code
                out = (err.stdout or b"").decode() + (err.stderr or b"").decode()
                raise RuntimeError(f"python -m lab.connections failed:\n{out}") from err
            raise

    def run(
        self,
        run_config: str = "",
        timeout: float = 900,
        federation_config: str = "",
        app: Path = APP_DIR,
    ) -> RunOutcome:
        """``flwr run . local-simulation --stream [--run-config run_config]
        [--federation-config federation_config]`` (e.g. ``"num-supernodes=9"``), on a
        copy of the app staged now (:func:`stage_app`); ``app``: another Flower app's
        directory (a benchmark's peer) instead of this one. A ``run_config`` that names a
        ``.toml`` file beside ``key=value`` pairs, which Flower would drop without a word,
        is refused before anything starts (return code 2)."""
        started = time.monotonic()
        try:  # what Flower's parser would drop silently never reaches it
            check.refuse_what_flower_drops(run_config)
        except check.CheckError as err:
            return RunOutcome(2, f"error: {err}\n", None, time.monotonic() - started)
        stage = Path(tempfile.mkdtemp(prefix="app-", dir=self.home))
        try:
            stage_app(app, stage)
            cmd = [str(BIN / "flwr"), "run", str(stage), "local-simulation", "--stream"]
            if run_config:
                cmd += ["--run-config", run_config]
            if federation_config:
                cmd += ["--federation-config", federation_config]
            proc = subprocess.run(
                cmd,
                cwd=APP_DIR,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        seconds = time.monotonic() - started  # not the status query below
        output = proc.stdout + proc.stderr
        match = _RUN_DIR_LINE.search(output)
        run_dir = Path(match.group(1)) if match else None
        status = self._status(output)
        output += self._refusal(output)
        returncode = proc.returncode
        if returncode == 0 and status.endswith(("failed", "stopped")):
            returncode = 1
            output += f"\nflwr run exited 0, but the run ended {status!r} on the SuperLink\n"
        return RunOutcome(returncode, output, run_dir, seconds, status)

    def _refusal(self, output: str) -> str:
        """Why the SuperLink refused to start the run, from its log: ``flwr run`` prints
        only Flower's public message (an unknown run-config key: "[code: 15] Invalid
        run configuration."), the SuperLink logs the key."""
        if "[code: 15]" not in output:
            return ""
        log_file = self.home / "local-superlink" / "superlink.log"
        try:
            lines = log_file.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        reasons = [line for line in lines if "Could not start run:" in line]
        return f"\nThe SuperLink's reason ({log_file}):\n{reasons[-1]}\n" if reasons else ""

    def _status(self, output: str) -> str:
        """The SuperLink's status of the run ``output`` started ("" if none started)."""
        match = _RUN_ID_LINE.search(output)
        if not match:
            return ""
        try:
            runs = {run["run-id"]: run for run in self.list_runs()}
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):  # no status to add
            return ""
        return str(runs.get(match.group(1), {}).get("status", ""))

    def control_client(self):  # -> flwr.supercore.control.ControlHttpClient
        """A client of the local SuperLink's Control API, from this process (close it).

        Flower's CLI would probe the SuperLink with a 0.4 s timeout and, on a loaded
        machine, start a second one; this home's SuperLink is addressed directly."""
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors.http.runtime_version import (
            RuntimeVersionHttpInterceptor,
        )

        return ControlHttpClient.from_server_address(
            server_address=f"127.0.0.1:{self.env['FLWR_LOCAL_SUPERLINK_HTTP_API_PORT']}",
            insecure=True,
            root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")],
        )

    def list_runs(self) -> list[dict]:
        """The runs and their status, as ``flwr list local-simulation --format json``
        gives them (``run-id``, ``status``), asked from this process: a `flwr list`
        process costs ~1.5 s of CPU on Flower's CLI imports, after every run."""
        import httpx
        from flwr.cli.run_utils import format_runs
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest

        client = self.control_client()
        try:
            res = client.ListRuns(ListRunsRequest())
        except httpx.HTTPError as err:  # as `flwr list` failing: no listing
            raise OSError(f"ListRuns on the local SuperLink failed: {err}") from err
        finally:
            client.close()
        runs = format_runs([run_from_proto(proto) for proto in res.run_dict.values()], res.now)
        return [{"run-id": str(row.run_id), "status": row.status_text} for row in runs]

    def configure_simulation(self, **fields) -> None:
        """Merge ``fields`` (``flwr.proto`` ``SimulationConfig``'s, e.g.
        ``init_args_num_cpus=1``) into the local SuperLink's simulation config, as
        ``flwr federation simulation-config`` does; runs merge theirs on top."""
        from flwr.proto.control_pb2 import ConfigureSimulationFederationRequest
        from flwr.proto.federation_config_pb2 import SimulationConfig
        from flwr.supercore.constant import NOOP_FEDERATION_ID

        request = ConfigureSimulationFederationRequest(
            federation_name=NOOP_FEDERATION_ID, config=SimulationConfig(**fields)
        )
        client = self.control_client()
        try:
            client.ConfigureSimulationFederation(request)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the local SuperLink this home started, and wait until it is gone."""
        stop_processes(superlink_processes(self.home))
        deadline = time.monotonic() + 10
        while superlink_processes(self.home) and time.monotonic() < deadline:
            time.sleep(0.2)
        if superlink_processes(self.home):
            raise RuntimeError(f"local SuperLink of {self.home} is still running")

    def __enter__(self) -> LocalSimulation:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._own_home:
                shutil.rmtree(self.home, ignore_errors=True)
