"""A Ray cluster of two nodes on this host, as a user starts one on two machines: `ray
start --head` with 1 CPU, then `ray start --address 127.0.0.1:PORT` with 1 CPU.

Each node has a temp dir of its own and free ports of its own, so it meets no other Ray
that tests start at the same time, nor do they meet it: their `ray.init()` joins an
existing cluster only through `RAY_ADDRESS` or the `ray_current_cluster` file in Ray's
default temp dir, which these nodes do not write. The nodes' processes are stopped by
PID at the end, never with `ray stop`, which stops every Ray on the machine (other
tests' simulations included). Used by ``tests/e2e/conftest.py`` (:func:`two_node_cluster`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from lab.launcher import BIN, free_port

OBJECT_STORE_BYTES = 100 * 1024**2  # Ray's minimum is 75 MiB; digits needs little


@dataclass
class RayNode:
    temp_dir: Path
    pgid: int  # `ray start` ran in a session of its own; its daemons stay in its group


@dataclass
class RayCluster:
    gcs_port: int
    nodes: list[RayNode]  # head first; a node is listed before its `ray start` ends

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def processes(self) -> list[psutil.Process]:
        """Every process of the nodes: those in the process groups of their `ray
        start`s, those whose command line names a node's temp dir or the GCS port (the
        GCS, raylets, monitors, the Ray Client server), and all their children (agents,
        workers, ClientApp actors)."""
        groups = {node.pgid for node in self.nodes}
        markers = [str(node.temp_dir) for node in self.nodes]
        gcs_arg = re.compile(rf"^--(gcs-)?address=\S*:{self.gcs_port}$")
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                args = proc.info["cmdline"] or []
                if (
                    os.getpgid(proc.pid) in groups
                    or any(m in arg for arg in args for m in markers)
                    or any(gcs_arg.match(arg) for arg in args)
                ):
                    found[proc.pid] = proc
                    found.update((c.pid, c) for c in proc.children(recursive=True))
        found.pop(os.getpid(), None)
        return [proc for proc in found.values() if not _gone(proc)]


def _free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return list(ports)


def _ray_start(cluster: RayCluster, args: list[str], temp_dir: Path, env: dict) -> None:
    """`ray start ARGS` for one node of 1 CPU, with its own temp dir and ports."""
    node_manager, object_manager, env_agent, agent_http, agent_grpc, metrics = _free_ports(6)
    cmd = [
        str(BIN / "ray"),
        "start",
        *args,
        "--num-cpus=1",
        f"--temp-dir={temp_dir}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        "--min-worker-port=0",  # workers bind ports the OS picks
        "--max-worker-port=0",
        f"--runtime-env-agent-port={env_agent}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        "--disable-usage-stats",
        "--include-log-monitor=false",  # workers' output stays in the node's log files
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,  # its process group is the node's: proc.pid
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    cluster.nodes.append(RayNode(temp_dir, proc.pid))
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{out}")


def _gone(proc: psutil.Process) -> bool:
    """Exited (a zombie too: the daemons' parent is init, which reaps when it will)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``processes`` to exit; return those that run."""
    deadline = time.monotonic() + timeout
    alive = [p for p in processes if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if not _gone(p)]
    return alive


def _stop(processes: list[psutil.Process]) -> list[psutil.Process]:
    """SIGTERM each by PID, SIGKILL what is left after 1 s; return what still runs.

    The GCS, the raylets and the runtime-env agents outlast SIGTERM by seconds (`ray
    stop` waits 16 s for them); nothing of these nodes needs to be kept.
    """
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    alive = wait_gone(processes, 1)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return wait_gone(alive, 5)


@contextlib.contextmanager
def two_node_cluster(env: dict[str, str] | None = None) -> Iterator[RayCluster]:
    """A head and a worker node on this host, stopped by PID afterwards."""
    # Short: Ray's socket paths (temp dir + session + sockets/plasma_store) must fit
    # the 107 characters of a Unix socket path, which pytest's tmp_path may exceed.
    root = Path(tempfile.mkdtemp(prefix="ray-e2e-"))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})}
    gcs_port, client_port, dashboard_port = _free_ports(3)
    cluster = RayCluster(gcs_port, [])
    head_args = [
        "--head",
        f"--port={gcs_port}",
        "--include-dashboard=false",  # Ray still starts a minimal one: give it a port
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={client_port}",
        "--no-monitor",  # the autoscaler's: a fixed cluster has nothing to scale
    ]
    try:
        _ray_start(cluster, head_args, root / "head", env)
        _ray_start(cluster, [f"--address={cluster.address}"], root / "worker", env)
        yield cluster
    finally:
        _stop(cluster.processes())
        # again: a worker process a raylet started while it was being stopped
        left = _stop(cluster.processes())
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"


def ray_nodes(gcs_address: str) -> dict[str, str]:
    """Temp dir -> node id (hex) of each node the GCS knows."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10)
    return {node.temp_dir: node.node_id.hex() for node in reply.node_info_list}


def clientapp_calls(gcs_address: str) -> Counter[str]:
    """Node id (hex) -> finished `ClientAppActor.run` tasks on it, from the task events
    the GCS keeps (what `ray list tasks` shows; read directly, as the state API needs
    the dashboard, which this install does not have)."""
    import grpc
    from ray.core.generated import common_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    finished = common_pb2.TaskStatus.Value("FINISHED")
    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(channel)
        reply = stub.GetTaskEvents(gcs_service_pb2.GetTaskEventsRequest(), timeout=10)
    return Counter(
        event.state_updates.node_id.hex()
        for event in reply.events_by_task
        if event.task_info.name == "ClientAppActor.run"
        and finished in event.state_updates.state_ts_ns
    )
