"""A deployed federation on loopback: TLS SuperLink, SuperNode authentication, `flwr run`.

The guide's blocks marked ``<!-- test_deployment: NAME ... -->`` in docs/deploy.md run
as written (bash, ``HOME`` the test's folder, only addresses and ports replaced:
:func:`doc_block`), so the guide cannot drift from what works. Then, on the warm
executor (``python -m deploy.superexec`` beside ``python -m deploy.supernode``): a
crashed SuperNode restarted at once is refused (2004) and rejoins; one SecAgg+ run
across the three real SuperNodes loses one after key sharing in round 2 and finishes
on the two survivors; the unregistered key, plaintext SuperNodes and a plaintext CLI
are refused; SIGTERM stops each executor with its processes. The phases and their
waits: docs/deploy.md, "What the integration test checks".

Every process this module starts (and any child, found with psutil and by our
``FLWR_HOME``) is stopped by PID in the fixture's finaliser, which asserts none is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import httpx
import pandas as pd
import psutil
import pytest

from deploy import supernode as node_launcher  # the app's SuperNode launcher
from lab import connections, deploy, launcher
from lab.launcher import _RUN_DIR_LINE, _RUN_ID_LINE, APP_DIR, BIN, stop_processes

pytestmark = pytest.mark.e2e

# Ports other Flower processes use by default (local-simulation SuperLink: 39091-39093;
# gRPC-era defaults 9091-9095; HTTP APIs 8000, 9094): never given to our processes.
RESERVED_PORTS = {8000, *range(9090, 9100), *range(39090, 39100)}
NUM_NODES = 3  # SuperNodes started with registered keys; key 3 stays unregistered
KILLED = 2  # the SuperNode killed in round 2, after it shared its SecAgg+ keys
CRASHED = 0  # the warm SuperNode SIGKILLed right after it joined, restarted at once
ROUNDS = 2  # round 1 on all three, round 2 the dropout after key sharing
ROUND_TIMEOUT = 45  # s: each message is a fork of a warm executor, but on a machine
# loaded 10-fold (load average 20 on 2 cores) round 1's collect stage, all three
# training at once, took 30 s. A dead node costs an exchange until it is offline.
HEARTBEAT = 10  # s: the warm block's --heartbeat-interval: offline 2 x this after the
# last heartbeat (Flower's 30 s: 60 s)
SECAGG_STAGES = 4  # messages per SecAgg+ round: setup, share keys, collect, unmask
WARM_DONE = re.compile(r"Warm executor: task \d+ done")
KEYS_SHARED = "SecAgg+ round 2: keys shared among 3 of 3 clients"
RUN_CONFIG = (
    f"num-server-rounds={ROUNDS} fraction-train=1.0 fraction-evaluate=0.0 "
    f"vision.local-epochs=1 min-available-nodes=2 min-train-nodes=2 "
    f"round-timeout={ROUND_TIMEOUT} secagg.enabled=true"
)


def free_port() -> int:
    """A free loopback TCP port (:func:`lab.launcher.free_port`), outside
    ``RESERVED_PORTS``."""
    while (port := launcher.free_port()) in RESERVED_PORTS:
        pass
    return port


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return port not in RESERVED_PORTS


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (the guide numbers SuperNode ports
    ``base + K``)."""
    below_ephemeral, _ = launcher.ephemeral_range()
    while True:
        base = free_port()
        if base + count <= below_ephemeral and all(_is_free(base + k) for k in range(1, count)):
            return base


DEPLOY_MD = APP_DIR / "docs" / "deploy.md"


def doc_block(name: str, replacements: dict[str, str]) -> str:
    """The bash block marked ``<!-- test_deployment: name ...-->`` in docs/deploy.md,
    with each ``replacements`` key (which must be there) replaced."""
    text = DEPLOY_MD.read_text()
    match = re.search(
        rf"<!-- test_deployment: {re.escape(name)} .*?-->\n```bash\n(.*?)```", text, re.S
    )
    assert match, f"docs/deploy.md has no block marked test_deployment: {name}"
    block = match.group(1)
    for old, new in replacements.items():
        if old in block:
            block = block.replace(old, new)
    assert not re.search(r"\b909[3-6]\b|lab\.example", block), block  # all replaced
    return block


def git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain"], cwd=APP_DIR, capture_output=True, text=True, check=True
    ).stdout


@dataclass
class Deployment:
    """Processes on loopback sharing one private ``FLWR_HOME`` under ``root``."""

    root: Path
    port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    node_base: int = field(default_factory=lambda: free_ports(NUM_NODES))
    warm_base: int = 0  # the warm block's ports: its SuperNodes start beside the guide's
    node_ids: dict[int, int] = field(default_factory=dict)  # key index -> node id
    orphans: list[psutil.Process] = field(default_factory=list)  # children of killed ones

    def __post_init__(self) -> None:
        self.home, self.certs, self.logs = (self.root / d for d in ("home", "certs", "logs"))
        # The warm block runs with HOME there (as on the SuperNodes' own machine): its
        # ~/flwr-lab files do not replace the guide's SuperNodes' while those still run.
        self.warm_home = self.root / "warm"
        self.warm_lab = self.warm_home / "flwr-lab"
        for folder in (self.home, self.logs, self.warm_lab):
            folder.mkdir(parents=True, exist_ok=True)
        taken = {self.port, *range(self.node_base, self.node_base + NUM_NODES)}
        while not self.warm_base or taken & set(range(self.warm_base, self.warm_base + NUM_NODES)):
            self.warm_base = free_ports(NUM_NODES)
        self.ca, _, self.keys = deploy.write_all(self.certs, ["127.0.0.1", "localhost"], 4)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
        self.lab = self.root / "flwr-lab"  # the guide's ~/flwr-lab (HOME is the root)
        self.env = env | {
            "HOME": str(self.root),
            "FLWR_HOME": str(self.home),
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",  # complete logs even from processes we kill
            # `python -m deploy.supernode` and the like run this checkout's code, also
            # where the environment's editable install is another checkout's
            "PYTHONPATH": os.pathsep.join(filter(None, [str(APP_DIR), env.get("PYTHONPATH")])),
        }

    # -- processes ---------------------------------------------------------------------
    def start(
        self, name: str, *args: str, cwd: Path | None = None, env: dict | None = None
    ) -> subprocess.Popen:
        """Start ``args`` in its own session (environment ``env`` or ours), output to
        ``logs/<name>.log``."""
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                args, cwd=cwd or self.root, env=env or self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.processes[name] = proc
        return proc

    def log(self, name: str) -> str:
        """A process's log: ours (``logs/``), else the warm block's, else the guide's
        other blocks' (``~/flwr-lab``)."""
        for folder in (self.logs, self.warm_lab, self.lab):
            if (folder / f"{name}.log").exists():
                return (folder / f"{name}.log").read_text(errors="replace")
        return f"(no log of {name})"

    def run_doc(self, name: str, *, warm: bool = False) -> str:
        """Run the guide's block ``name`` (:func:`doc_block`) in the test's folder, the
        way a reader pastes it into bash (``warm``: with HOME and the SuperNode ports of
        the warm block); return its output."""
        address = f"127.0.0.1:{self.port}"
        block = doc_block(name, {
            "superlink.lab.example:9093": address,
            "127.0.0.1:9093": address,
            "--port 9093": f"--port {self.port}",
            "$((9094 + K))": f"$(({self.warm_base if warm else self.node_base} + K))",
        })  # fmt: skip
        env = self.env | {"HOME": str(self.warm_home)} if warm else self.env
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], cwd=self.root, env=env,
            capture_output=True, text=True, timeout=120, start_new_session=True,
        )  # fmt: skip
        assert result.returncode == 0, f"{name}:\n{block}\n{result.stdout}{result.stderr}"
        return result.stdout + result.stderr

    def pid(self, name: str, *, warm: bool = False) -> int:
        """The PID a guide's block wrote to ``~/flwr-lab/<name>.pid`` (``warm``: the
        warm block's)."""
        return int(((self.warm_lab if warm else self.lab) / f"{name}.pid").read_text())

    def flwr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``flwr ARGS`` in the app directory, with our Flower home."""
        return subprocess.run(
            [str(BIN / "flwr"), *args], cwd=APP_DIR, env=self.env, capture_output=True,
            text=True, timeout=120, check=check,
        )  # fmt: skip

    def start_superlink(self) -> None:
        self.run_doc("superlink")
        superlink = psutil.Process(self.pid("superlink"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert _alive(superlink), self.log("superlink")
            try:
                url = f"https://127.0.0.1:{self.port}/health"
                if httpx.get(url, verify=str(self.ca.public), timeout=1).is_success:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("SuperLink not healthy in 60 s\n" + self.log("superlink"))

    def start_supernode(
        self, name: str, *args: str, port: int | None = None, command: Sequence[str] = ()
    ) -> subprocess.Popen:
        """``flower-supernode`` (or ``command``, e.g. ``python -m deploy.supernode``)
        dialling our SuperLink, on its own Runtime API port (``port``, or a free one)."""
        port = free_port() if port is None else port
        superlink = ["--superlink", f"127.0.0.1:{self.port}", "--port", str(port)]
        command = command or [str(BIN / "flower-supernode")]
        return self.start(name, *command, *superlink, *args)

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout} s") from None

    def kill_tree(self, name: str) -> None:
        """SIGKILL a process the warm block started and its descendants, by PID (a
        machine that dies)."""
        proc = psutil.Process(self.pid(name, warm=True))
        victims = [proc, *proc.children(recursive=True)]
        self.orphans += victims[1:]
        for victim in victims:
            victim.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)

    # -- state on the SuperLink --------------------------------------------------------
    def wait_activated(self, timeout: float) -> None:
        """Wait until each SuperNode's log names its node id (Flower logs it once the
        SuperLink activated the node)."""
        deadline = time.monotonic() + timeout
        for k, node in self.node_ids.items():
            while f"SuperNode ID: {node}" not in (log := self.log(f"supernode-{k}")):
                assert time.monotonic() < deadline, f"supernode-{k} not activated:\n{log}"
                time.sleep(0.2)

    def wait_listed_online(self, timeout: float) -> dict[int, str]:
        """Wait until ``flwr supernode list`` lists every SuperNode online: one CLI call
        (about 1.5 s of CPU) once they should be (:meth:`wait_activated`), not one a
        second."""
        deadline = time.monotonic() + timeout
        while set((nodes := self.nodes()).values()) != {"online"} or len(nodes) < NUM_NODES:
            assert time.monotonic() < deadline, f"SuperNodes not online: {nodes}"
            time.sleep(0.5)
        return nodes

    def superlink_log_has(self, lines: Sequence[str], timeout: float) -> None:
        """Wait until the SuperLink's log has each of ``lines``."""
        deadline = time.monotonic() + timeout
        while missing := [line for line in lines if line not in self.log("superlink")]:
            assert time.monotonic() < deadline, f"SuperLink never logged {missing}"
            time.sleep(0.1)

    def cli(self, *args: str) -> subprocess.Popen:
        """``flwr ARGS`` started in the app directory (output in a pipe) to run beside
        other work; :func:`_output` waits for it."""
        return subprocess.Popen(
            [str(BIN / "flwr"), *args], cwd=APP_DIR, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip

    def nodes(self) -> dict[int, str]:
        """``flwr supernode list lab``: node id -> status."""
        return _nodes_of(self.flwr("supernode", "list", "lab", "--format", "json").stdout)

    # -- cleanup -----------------------------------------------------------------------
    def ours(self) -> list[psutil.Process]:
        """Live processes we started, their descendants, and any process whose
        environment names our ``FLWR_HOME`` (zombies count as gone)."""
        found: dict[int, psutil.Process] = {}
        for popen in self.processes.values():
            if popen.poll() is not None:  # reaped: its pid may be another process's now
                continue
            try:
                proc = psutil.Process(popen.pid)
                found |= {p.pid: p for p in [proc, *proc.children(recursive=True)]}
            except psutil.NoSuchProcess:
                continue
        found |= {p.pid: p for p in self.orphans}
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("FLWR_HOME") == str(self.home):
                    found[proc.pid] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return [p for p in found.values() if _alive(p)]

    def stop(self) -> list[str]:
        """Stop everything by PID (SIGTERM, then SIGKILL); return what is left."""
        stop_processes(self.ours(), timeout=10)
        for popen in self.processes.values():
            if popen.poll() is None:
                popen.kill()
            popen.wait(timeout=10)
        return [_describe(p) for p in self.ours()]


def _nodes_of(out: str) -> dict[int, str]:
    """``flwr supernode list --format json``'s output: node id -> status."""
    return {int(n["node-id"]): n["status"] for n in json.loads(out)["nodes"]}


def _status_of(out: str, run_id: str) -> str:
    """The status of ``run_id`` in ``flwr list --format json``'s output."""
    runs = {run["run-id"]: run for run in json.loads(out[out.index("{") :])["runs"]}
    return str(runs[run_id]["status"])


def _output(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The stdout of a :meth:`Deployment.cli` call, which must succeed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{proc.args} still running after {timeout} s") from None
    assert proc.returncode == 0, f"{proc.args}: {out}{err}"
    return out


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} " + " ".join(proc.cmdline()[:3])
    except psutil.Error:
        return f"{proc.pid} (gone)"


@pytest.fixture(scope="module")
def deployment():
    """SuperLink + the guide's 3 authenticated SuperNodes, activated (:func:`warm_nodes`
    lists them online); everything stopped and checked after.

    Its folder is our own (not pytest's ``tmp_path``, which another pytest session of
    the same user may prune while the processes still use it) and removed at the end.
    """
    dep = Deployment(Path(tempfile.mkdtemp(prefix="flwr-deployment-")))
    try:
        dep.start_superlink()
        registered = re.findall(r"SuperNode (\d+) registered", dep.run_doc("register"))
        assert len(registered) == NUM_NODES, registered  # keys 0..2, in order
        dep.node_ids = {k: int(node) for k, node in enumerate(registered)}
        dep.run_doc("supernodes-on-one-host")
        dep.wait_activated(timeout=90)
        yield dep
    finally:
        left = dep.stop()
        shutil.rmtree(dep.root, ignore_errors=True)
    assert not left, f"processes left running: {left}"


def _start_refused(deployment: Deployment) -> None:
    """Start the SuperNodes the SuperLink must refuse, at once (their start-ups and
    retries overlap), and write the plaintext ``lab-plaintext`` connection. They run
    with ``--isolation process``: a node that is never activated runs no ClientApp, so
    no ``flower-superexec`` is started for it."""
    deployment.start_supernode(
        "unregistered", "--isolation", "process",
        "--root-certificates", str(deployment.ca.public),
        "--auth-supernode-private-key", str(deployment.keys[3].private),
        "--node-config", f"partition-id=0 num-partitions={NUM_NODES}",
    )  # fmt: skip
    # A SuperNode without TLS: the TLS port drops the plaintext HTTP request.
    deployment.start_supernode(
        "plaintext", "--isolation", "process", "--insecure", "--max-retries", "2"
    )
    # A SuperNode key without TLS is refused before it dials (auth requires TLS).
    deployment.start_supernode(
        "plaintext-auth", "--insecure", "--auth-supernode-private-key",
        str(deployment.keys[0].private),
    )  # fmt: skip
    # Meanwhile (and before any `flwr` call reads the connections file again) the
    # plaintext connection for the flwr CLI, and the CLI through it. Written here, as
    # `python -m lab.connections lab-plaintext --insecure` writes it (the guide's
    # register block runs that command): a process of its own cost ~0.9 s of CPU.
    plaintext = connections.remote("lab-plaintext", f"127.0.0.1:{deployment.port}", None, True)
    with mock.patch.dict(os.environ, {"FLWR_HOME": str(deployment.home)}):
        connections.write_superlink_connection(plaintext)
    deployment.start(
        "flwr-plaintext", str(BIN / "flwr"), "supernode", "list", "lab-plaintext", cwd=APP_DIR
    )


REFUSED = ("unregistered", "plaintext", "plaintext-auth", "flwr-plaintext")


@dataclass
class Refused:
    returncodes: dict[str, int]  # refused SuperNode (or flwr call) -> its exit status
    nodes: dict[int, str]  # `flwr supernode list` once all of them exited


@pytest.fixture(scope="module")
def refused(deployment, killed_run) -> Refused:
    """The refused SuperNodes and the plaintext `flwr` call (started during the run,
    :func:`killed_run`, which waits for their exits), and the SuperLink's nodes then:
    the run's one node list serves both tests."""
    returncodes = {name: deployment.wait_exit(name, timeout=60) for name in REFUSED}
    return Refused(returncodes, killed_run.nodes)


def test_unregistered_key_is_refused(refused, deployment):
    proc = deployment.processes["unregistered"]
    returncode = refused.returncodes["unregistered"]
    log = deployment.log("unregistered")
    # Flower 1.41: ActivateNode answers HTTP 412 with ApiError 2004, the SuperNode exits.
    assert returncode == 1 and proc.returncode == 1, log
    assert "Exit Code: 305" in log and "[code: 2004] Failed to activate SuperNode." in log, log
    assert "No SuperNode found with the given public key" in deployment.log("superlink")
    assert set(refused.nodes) == set(deployment.node_ids.values())


def test_plaintext_connection_to_the_tls_superlink_fails(refused, deployment):
    # A SuperNode without TLS: the TLS port drops the plaintext HTTP request.
    returncode = refused.returncodes["plaintext"]
    log = deployment.log("plaintext")
    assert returncode == 1, log
    assert "Exit Code: 305" in log, log
    # The TLS port drops the request; which error the client sees depends on timing.
    dropped = ("Server disconnected without sending a response", "Connection reset by peer")
    assert any(reason in log for reason in dropped), log
    # A SuperNode key without TLS is refused before it dials (auth requires TLS).
    assert refused.returncodes["plaintext-auth"] == 1
    assert "Exit Code: 303" in deployment.log("plaintext-auth")
    # The flwr CLI through a plaintext connection.
    assert refused.returncodes["flwr-plaintext"] == 1
    assert "Connection to the SuperLink is unavailable" in deployment.log("flwr-plaintext")
    assert set(refused.nodes) == set(deployment.node_ids.values())  # no one joined


def _guide_process(
    deployment: Deployment, name: str, *, warm: bool = False
) -> psutil.Process | None:
    """The live process of a guide block's ``~/flwr-lab/<name>.pid`` (``warm``: the warm
    block's), if it is still ours (a killed one's PID may be another process's by now)."""
    try:
        proc = psutil.Process(deployment.pid(name, warm=warm))
        if _alive(proc) and proc.environ().get("FLWR_HOME") == str(deployment.home):
            return proc
    except (psutil.Error, FileNotFoundError):
        pass
    return None


def _logs(deployment: Deployment, name: str) -> list[str]:
    return [deployment.log(f"{name}-{k}") for k in range(NUM_NODES)]


def _tree(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and their live descendants."""
    found = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            found += [proc, *proc.children(recursive=True)]
    return found


@dataclass
class WarmNodes:
    crashed: int  # node id of the SuperNode SIGKILLed right after it joined
    rejoined_after_s: float  # kill -> the restarted SuperNode logs its (same) node id
    ready_after_s: float  # the warm block started -> all warm SuperNodes joined, ready


@pytest.fixture(scope="module")
def warm_nodes(deployment) -> WarmNodes:
    """docs/deploy.md's warm executor (``python -m deploy.superexec``), and a crash.

    The warm block starts the three SuperNodes again as ``python -m deploy.supernode
    --isolation process`` (Flower's SuperNode with a 0.5 s wait after an empty pull and
    activation retries on 2004) with one executor each, beside the guide's (its own
    HOME and ports, as on another machine): they are refused while the guide's are
    online and retry. Then ``flwr supernode list`` shows the guide's SuperNodes online,
    and they are stopped (a stopped SuperNode deactivates: ``offline`` at once, the
    SuperLink logs it), so the warm ones join. Right after SuperNode ``CRASHED`` joined
    it and its executor are SIGKILLed (a machine that dies: the SuperLink keeps its node
    ``online`` for 2 x 10 s) and restarted at once with the same commands: the
    SuperNode is refused while its node is still online, retries, and rejoins under
    the same id; the executors import during that wait. After it the guide's
    SuperNodes and their SuperExecs are gone."""
    crashed = deployment.node_ids[CRASHED]
    guide = [p for k in range(NUM_NODES) if (p := _guide_process(deployment, f"supernode-{k}"))]
    assert len(guide) == NUM_NODES, "a guide SuperNode exited\n" + "\n".join(
        _logs(deployment, "supernode")
    )
    superexecs = [c for p in guide for c in p.children(recursive=True)]
    started = time.monotonic()
    deployment.run_doc("warm-executors-on-one-host", warm=True)
    # The executors (PyTorch's imports: seconds of CPU each) pause until the crashed
    # SuperNode's restart has asked the SuperLink: first SuperNode CRASHED must join, then
    # its restart must ask within the ~20 s its dead node stays online, and on a loaded
    # machine they would take the CPU both start on. They import during that wait.
    executors = [
        psutil.Process(deployment.pid(f"superexec-{k}", warm=True)) for k in range(NUM_NODES)
    ]
    paused = _tree(executors)
    for proc in paused:
        proc.suspend()
    try:
        # §5: `flwr supernode list lab` then shows the guide's SuperNodes online (the
        # warm ones, with the same keys, are refused while they are).
        deployment.wait_listed_online(timeout=60)
        # One SIGTERM each, by PID. They share the block's process group, and a SIGTERM
        # to the group per SuperNode (lab.launcher.stop_processes) signals each one 3
        # times: then they were still listed online 30 s later.
        for proc in guide:
            proc.terminate()
        stopped_at = time.monotonic()
        deployment.superlink_log_has(
            [f"Deactivated node_id={node}" for node in deployment.node_ids.values()],
            timeout=60,
        )
        # CRASHED joins (its node id in the warm block's log), and dies at once with its
        # executor.
        joined = f"SuperNode ID: {crashed}"
        deadline = time.monotonic() + 90
        while joined not in deployment.log(f"supernode-{CRASHED}"):
            assert time.monotonic() < deadline, deployment.log(f"supernode-{CRASHED}")
            time.sleep(0.1)
        node = psutil.Process(deployment.pid(f"supernode-{CRASHED}", warm=True))
        executor = executors[CRASHED]
        node_command, executor_command = node.cmdline(), executor.cmdline()
        node_env, executor_env = node.environ(), executor.environ()
        deployment.kill_tree(f"supernode-{CRASHED}")
        executor.kill()
        killed_at = time.monotonic()
        deployment.orphans.append(executor)
        psutil.wait_procs([executor], timeout=10)
        # Restarted at once, as the warm block started them (their logs now in logs/).
        restarted = deployment.start(f"supernode-{CRASHED}", *node_command, env=node_env)
        (deployment.warm_lab / f"supernode-{CRASHED}.pid").write_text(f"{restarted.pid}\n")
        executor_command[executor_command.index("--parent-pid") + 1] = str(restarted.pid)
        restarted_executor = deployment.start(
            f"superexec-{CRASHED}", *executor_command, env=executor_env
        )
        (deployment.warm_lab / f"superexec-{CRASHED}.pid").write_text(
            f"{restarted_executor.pid}\n"
        )
        deadline = killed_at + 60
        asked = ("refused to activate this node (2004)", joined)  # or, too late, joined
        while not any(s in (log := deployment.log(f"supernode-{CRASHED}")) for s in asked):
            assert restarted.poll() is None, log
            assert time.monotonic() < deadline, log
            time.sleep(0.1)
    finally:
        for proc in _tree(paused):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()
    # Rejoined: the restarted SuperNode was activated and logs its node id, the same.
    deadline = killed_at + node_launcher.DEFAULT_ACTIVATION_WAIT + 60
    while joined not in deployment.log(f"supernode-{CRASHED}"):
        assert restarted.poll() is None, deployment.log(f"supernode-{CRASHED}")
        assert time.monotonic() < deadline, deployment.log(f"supernode-{CRASHED}")
        time.sleep(0.2)
    rejoined_after = time.monotonic() - killed_at
    deployment.wait_activated(timeout=90)  # every warm SuperNode logs its node id
    # The run starts once every executor has imported what it preloads: on CI, with the
    # other core running other tests, that took longer than 'round-timeout', the partition
    # queries that waited for it timed out, and the run stopped before round 1.
    deadline = time.monotonic() + 180
    while not all("Warm executor ready" in log for log in _logs(deployment, "superexec")):
        assert time.monotonic() < deadline, _logs(deployment, "superexec")
        time.sleep(0.2)
    ready_after = time.monotonic() - started
    # An upper bound: a SuperExec still importing when its SuperNode stopped (a loaded
    # machine) notices the stop only once its parent monitor runs.
    _, alive = psutil.wait_procs(
        [*guide, *superexecs], timeout=max(1, stopped_at + 60 - time.monotonic())
    )
    assert not alive, f"the guide's SuperNodes or SuperExecs outlived SIGTERM: {alive}"
    return WarmNodes(crashed, rejoined_after, ready_after)


@dataclass
class Run:
    out: Path  # the run's output-dir
    output: str
    status: str
    path: Path
    metrics: pd.DataFrame
    participation: pd.DataFrame
    killed_after: int  # the last round checkpointed when the SuperNode was killed
    offline_after_s: float | None  # kill -> the SuperLink lists the node offline
    nodes: dict[int, str]  # `flwr supernode list` then: node id -> status
    git: tuple[str, str]  # git status before and after
    executor_logs: list[str]  # once the survivors answered the last message, before SIGTERM
    supernode_logs: list[str]
    stopped: bool  # SIGTERM stopped every surviving executor and its processes


def _checkpointed_round(out: Path) -> int:
    states = list(out.glob("*/checkpoint/state.json"))
    try:
        return int(json.loads(states[0].read_text())["round"]) if states else 0
    except (ValueError, KeyError):  # mid-write
        return 0


def _freeze_after_key_sharing(deployment: Deployment, flwr: subprocess.Popen) -> None:
    """SIGSTOP SuperNode ``KILLED``'s executor and its processes once it has answered
    round 2's share-keys message: it forks no ClientApp for the collect stage, while its
    SuperNode still forwards the keys it shared."""
    executor = psutil.Process(deployment.pid(f"superexec-{KILLED}", warm=True))
    answered = 1 + SECAGG_STAGES + 2  # query.partition, round 1, round 2's setup, keys
    deadline = time.monotonic() + 120 + 4 * ROUND_TIMEOUT
    while len(WARM_DONE.findall(deployment.log(f"superexec-{KILLED}"))) < answered:
        assert flwr.poll() is None, deployment.log("flwr-run")
        assert time.monotonic() < deadline, deployment.log(f"superexec-{KILLED}")
        time.sleep(0.02)
    executor.suspend()  # first the zygote (no fork after this), then what it forked
    for child in executor.children(recursive=True):
        child.suspend()


@pytest.fixture(scope="module")
def killed_run(deployment, warm_nodes) -> Run:
    """`flwr run . lab` on the warm SuperNodes, 2 SecAgg+ rounds; SuperNode ``KILLED``
    dies in round 2 after it shared its keys; SIGTERM stops the other executors once
    they answered the run's last message."""
    out = deployment.root / "runs"
    before = git_status()
    flwr = deployment.start(
        "flwr-run", str(BIN / "flwr"), "run", ".", "lab", "--stream",
        "--run-config", f"{RUN_CONFIG} output-dir='{out}'", cwd=APP_DIR,
    )  # fmt: skip
    # A generous limit, reached only by a run that hangs: every message is a fork, and a
    # dead node costs an exchange the round timeout.
    deadline = time.monotonic() + 120 + 4 * ROUND_TIMEOUT
    _freeze_after_key_sharing(deployment, flwr)
    # Killed in round 2 once its SuperNode has pushed its share-keys reply to the
    # SuperLink (Flower logs each reply it sent): its masked vector never arrives, and
    # the server gets every SuperNode's keys (KEYS_SHARED, asserted on the run's log).
    # No later than that: the SuperLink lists it offline 2 x 10 s after its last
    # heartbeat, which ends round 2's collect stage.
    sent = 1 + SECAGG_STAGES + 2  # query.partition, round 1, round 2's setup and keys
    while deployment.log(f"supernode-{KILLED}").count("Sent successfully") < sent:
        assert flwr.poll() is None, deployment.log("flwr-run")
        assert time.monotonic() < deadline, "round 2 not reached\n" + deployment.log("flwr-run")
        time.sleep(0.05)
    done = _checkpointed_round(out)
    executor = psutil.Process(deployment.pid(f"superexec-{KILLED}", warm=True))
    victims = [executor, *executor.children(recursive=True)]
    deployment.kill_tree(f"supernode-{KILLED}")
    for victim in victims:
        victim.kill()
    killed_at = time.monotonic()
    deployment.orphans += victims
    psutil.wait_procs(victims, timeout=10)
    # Once the survivors answered round 2's collect stage, the run only waits for the
    # dead node to be listed offline: the SuperNodes the SuperLink must refuse start
    # then (a refusal must not disturb a run), using that idle time.
    survivors = [k for k in range(NUM_NODES) if k != KILLED]
    collected = 1 + SECAGG_STAGES + 3  # query.partition, round 1, round 2 to collect
    while flwr.poll() is None and any(
        len(WARM_DONE.findall(deployment.log(f"superexec-{k}"))) < collected for k in survivors
    ):
        assert time.monotonic() < deadline, "round 2 not collected\n" + deployment.log("flwr-run")
        time.sleep(0.2)
    _start_refused(deployment)
    # The survivors' executors: each message was a fork, each replied (the executor logs
    # it when it reaps the fork, within 0.1 s of its exit). Once both answered round 2's
    # unmask message, the last of the run's messages, SIGTERM stops each while the
    # server finishes the run.
    executors = [_guide_process(deployment, f"superexec-{k}", warm=True) for k in survivors]
    assert all(executors), "an executor exited during the run"
    answered = 1 + SECAGG_STAGES * ROUNDS  # query.partition, 4 messages a round
    run_ended = None
    while any(
        len(WARM_DONE.findall(deployment.log(f"superexec-{k}"))) < answered for k in survivors
    ):
        if run_ended is None and flwr.poll() is not None:
            run_ended = time.monotonic()
        assert run_ended is None or time.monotonic() < run_ended + 10, _logs(
            deployment, "superexec"
        )
        assert time.monotonic() < deadline, _logs(deployment, "superexec")
        time.sleep(0.2)
    executor_logs = _logs(deployment, "superexec")
    descendants = [c for e in executors for c in e.children(recursive=True)]  # the pollers
    for survivor in executors:
        survivor.terminate()
    try:
        deployment.wait_exit("flwr-run", timeout=max(30, deadline - time.monotonic()))
    except AssertionError as err:
        raise AssertionError(f"{err}\n{deployment.log('flwr-run')}") from None
    after = git_status()
    output = deployment.log("flwr-run")
    run_id, run_dir = _RUN_ID_LINE.search(output), _RUN_DIR_LINE.search(output)
    assert run_id and run_dir, output
    # The refused SuperNodes and the plaintext flwr call exit within seconds of their
    # start; then one node list serves their tests and the dead node's status, taken
    # (with the run's status) while the executors stop.
    for name in REFUSED:
        deployment.wait_exit(name, timeout=60)
    listing = deployment.cli("supernode", "list", "lab", "--format", "json")
    runs = deployment.cli("list", "lab", "--format", "json")
    _, alive = psutil.wait_procs([*executors, *descendants], timeout=60)  # an upper bound
    stopped = not alive and all(
        "Warm executor stopped after" in deployment.log(f"superexec-{k}") for k in survivors
    )
    nodes = _nodes_of(_output(listing))
    status = _status_of(_output(runs), run_id.group(1))
    # Round 2's collect stage ended when the SuperLink answered the dead node's message
    # with an error, so it is offline by now; look again (up to 90 s after the kill) if not.
    look_until = killed_at + 90
    while nodes[deployment.node_ids[KILLED]] != "offline" and time.monotonic() < look_until:
        time.sleep(0.5)
        nodes = deployment.nodes()
    offline = nodes[deployment.node_ids[KILLED]] == "offline"
    offline_after = time.monotonic() - killed_at if offline else None
    path = Path(run_dir.group(1))
    return Run(
        out=out,
        output=output,
        status=status,
        path=path,
        metrics=pd.read_csv(path / "metrics.csv"),
        participation=pd.read_csv(path / "participation.csv"),
        killed_after=done,
        offline_after_s=offline_after,
        nodes=nodes,
        git=(before, after),
        executor_logs=executor_logs,
        supernode_logs=_logs(deployment, "supernode"),
        stopped=stopped,
    )


def test_run_completes_on_authenticated_supernodes(killed_run, deployment):
    run = killed_run
    assert run.status == "finished:completed", run.output
    assert run.path.parent == run.out and (run.path / "model.pt").is_file()
    train = run.metrics[run.metrics["scope"] == "train"]
    central = run.metrics[run.metrics["scope"] == "central-eval"]
    assert list(train["round"]) == list(range(1, ROUNDS + 1)), run.metrics
    assert list(central["round"]) == list(range(0, ROUNDS + 1)), run.metrics
    first = run.participation[run.participation["round"] == 1]
    assert set(first["node-id"]) == set(deployment.node_ids.values())
    assert first["replied"].all(), first.to_string()
    assert run.git[0] == run.git[1]  # `flwr run` wrote nothing into the repository
    # Every round was a SecAgg+ round: the server unmasked only the sum.
    unmasked = re.findall(r"SecAgg\+ round (\d+): sum of (\d+) of (\d+)", run.output)
    assert [int(r) for r, _, _ in unmasked] == list(range(1, ROUNDS + 1)), run.output
    assert unmasked[0][1:] == ("3", "3")


def test_killed_supernode_is_dropped_and_the_run_finishes(killed_run, deployment):
    run = killed_run
    dead = deployment.node_ids[KILLED]
    survivors = {deployment.node_ids[k] for k in range(NUM_NODES) if k != KILLED}
    assert run.killed_after == 1  # killed before round 2 was recorded
    for server_round in range(2, ROUNDS + 1):
        rows = run.participation[run.participation["round"] == server_round]
        # Still "online" for up to 2 x 10 s, the dead node is sampled but never replies.
        assert not rows[rows["node-id"] == dead]["replied"].any(), rows.to_string()
        # Once it was offline, the SuperLink answered its message with an error.
        errors = rows[rows["node-id"] == dead]["error"]
        assert len(errors) == 1 and errors.str.contains("Node Unavailable").all(), rows.to_string()
        replied = set(rows[rows["replied"]]["node-id"])
        assert replied == survivors, rows.to_string()
    assert KEYS_SHARED in run.output, run.output  # the server had its keys
    # Round 2: it died after sharing its keys; the survivors' sum was unmasked (its
    # pairwise masks removed with its key's shares), the model after it evaluated.
    assert "SecAgg+ round 2: sum of 2 of 3 clients' vectors unmasked (1 dropped after " in (
        run.output
    )
    central = run.metrics[run.metrics["scope"] == "central-eval"].set_index("round")
    assert central.loc[ROUNDS, "eval-loss"] < central.loc[0, "eval-loss"], central
    assert run.status == "finished:completed"
    # The SuperLink marks it offline after 2 missed 10 s heartbeat intervals (measured
    # here from the kill to the first look after the run, so only an upper bound), and
    # then answers its collect message with an error: the stage ends before the timeout.
    stages = re.search(r"SecAgg\+ round 2: .* collect_masked_vectors ([\d.]+)", run.output)
    assert stages and float(stages.group(1)) < ROUND_TIMEOUT, run.output
    assert run.offline_after_s is not None, "killed SuperNode never listed offline"
    print(f"killed SuperNode listed offline {run.offline_after_s:.0f} s after SIGKILL")
    print("\n".join(line for line in run.output.splitlines() if "round " in line))
    print(run.participation[["round", "node-id", "replied", "error"]].to_string())


def test_a_supernode_restarted_right_after_a_crash_rejoins(warm_nodes, killed_run, deployment):
    """docs/deploy.md: ``python -m deploy.supernode`` restarted at once after a crash is
    refused (2004) while the SuperLink still lists the crashed node online, retries, and
    rejoins under the same node id; the next run trains on it in every round."""
    restarted = killed_run.supernode_logs[CRASHED]
    assert "refused to activate this node (2004)" in restarted, restarted
    assert "activation still refused" not in restarted, restarted
    assert f"SuperNode ID: {warm_nodes.crashed}" in restarted, restarted
    # Offline at most 2 x 10 s after its last heartbeat, then one retry interval (2 s),
    # with 20 s for the restarted SuperNode to log its id on a busy machine.
    retry = node_launcher.DEFAULT_ACTIVATION_RETRY_INTERVAL
    assert warm_nodes.rejoined_after_s < 2 * HEARTBEAT + retry + 20, warm_nodes.rejoined_after_s
    assert set(deployment.node_ids.values()) == set(killed_run.nodes)
    assert killed_run.status == "finished:completed", killed_run.output
    participation = killed_run.participation
    for server_round in range(1, ROUNDS + 1):
        rows = participation[participation["round"] == server_round]
        assert warm_nodes.crashed in set(rows[rows["replied"]]["node-id"]), rows.to_string()
    print(f"crashed SuperNode rejoined {warm_nodes.rejoined_after_s:.0f} s after SIGKILL")


def test_a_run_completes_on_the_warm_executor(warm_nodes, killed_run, deployment):
    """docs/deploy.md's warm executor: the run completes with every message answered by
    a fork of an executor, and SIGTERM stops each executor with its processes."""
    run = killed_run
    assert all("deploy.supernode: pulling again 0.50 s" in log for log in run.supernode_logs), (
        run.supernode_logs
    )
    assert all(f"heartbeat every {HEARTBEAT} s" in log for log in run.supernode_logs)
    assert run.status == "finished:completed", run.output
    train = run.metrics[run.metrics["scope"] == "train"]
    assert list(train["round"]) == list(range(1, ROUNDS + 1)), run.metrics
    # Every message to a live SuperNode was answered: only the killed one missed round 2.
    missed = run.participation[~run.participation["replied"]]
    assert set(missed["node-id"]) == {deployment.node_ids[KILLED]}, missed.to_string()
    assert set(missed["round"]) == {2}, missed.to_string()
    for k, log in enumerate(run.executor_logs):
        # query.partition, then SecAgg+'s 4 messages a round; the killed one's executor
        # was stopped after round 2's setup and share-keys messages
        expected = 1 + (SECAGG_STAGES + 2 if k == KILLED else SECAGG_STAGES * ROUNDS)
        assert len(WARM_DONE.findall(log)) == expected, log
        assert "exited with status" not in log and "killed by" not in log, log
    assert run.stopped, run.executor_logs
    print(f"warm SuperNodes ready after {warm_nodes.ready_after_s:.0f} s")
    print(f"round-seconds {list(train['round-seconds'])}")
