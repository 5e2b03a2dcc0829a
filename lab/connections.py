"""Register this app's SuperLink connections in the Flower configuration file.

Flower 1.42 reads SuperLink connections from ``$FLWR_HOME/config.toml`` (default
``~/.flwr/config.toml``); a ``[tool.flwr.federations]`` table in ``pyproject.toml``
would be migrated there by ``flwr run``, which rewrites the tracked pyproject in
place. So the app keeps no federations table and this module writes the
connections instead, through Flower's own config API, touching no other entry::

    python -m lab.connections                 # adds `local-simulation`
    python -m lab.connections lab --address 10.0.0.5:9093 \\
        --root-certificates certs/ca.crt               # a real SuperLink
    python -m lab.connections ray-lab --ray-address 10.0.0.5:6379 \\
        --num-supernodes 100                           # simulation on a Ray cluster
    python -m lab.connections --stop          # stop the local SuperLink (by PID)

Design notes: ``docs/notes.md``, ``lab.connections``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import click
import flwr.cli.local_superlink as flower_launcher
import psutil
import typer
from flwr.cli.flower_config import read_flower_config, write_superlink_connection
from flwr.cli.local_superlink import _is_local_superlink_started, _start_local_superlink
from flwr.cli.typing import SuperLinkConnection
from flwr.supercore.utils import get_flwr_home

from lab.launcher import stop_processes, superlink_processes

LOCAL_SIMULATION = "local-simulation"
RAY_LAB = "ray-lab"  # default name of a Ray-cluster connection
LOCAL_ADDRESS = ":local:"  # Flower's magic value: start a local SuperLink on demand
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # what ray.init() reads when given no address
RUNTIME_INSTALL_ENV = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"  # "1": run in this env
STARTUP_TIMEOUT = 120.0  # seconds the local SuperLink may take to answer (Flower: 15)
_HOST_PORT = re.compile(r"^[^\s:/]+:\d{1,5}$|^\[[0-9A-Fa-f:.]+\]:\d{1,5}$")


@dataclass(frozen=True)
class SimulationSize:
    """The simulation a local SuperLink runs: how many virtual SuperNodes, and each
    ClientApp's resources (``flwr federation simulation-config``'s fields)."""

    num_supernodes: int = 10
    num_cpus: int = 1
    num_gpus: float = 0.0

    def federation_config(self) -> str:
        """The same as ``flwr run --federation-config``'s argument."""
        text = f"num-supernodes={self.num_supernodes} client-resources-num-cpus={self.num_cpus}"
        return text + (f" client-resources-num-gpus={self.num_gpus:g}" if self.num_gpus else "")


def local_simulation(name: str = LOCAL_SIMULATION) -> SuperLinkConnection:
    """The ``local-simulation`` connection: Flower's local SuperLink (simulation
    runtime), started on demand. Its size is the SuperLink's (:func:`configure_simulation`),
    not the connection's: Flower deprecates per-connection ``options.*``."""
    return SuperLinkConnection(name=name, address=LOCAL_ADDRESS)


def ray_cluster(ray_address: str, name: str = RAY_LAB) -> SuperLinkConnection:
    """A local-SuperLink simulation connection for a Ray cluster at ``ray_address``.

    The address is checked, not stored (Flower has no place for it, see the module's
    docstring): Ray reads it from ``RAY_ADDRESS``. Each ClientApp's CPUs and GPUs go
    to the SuperLink's simulation (Ray places as many ClientApps at once as the
    cluster's CPUs and GPUs allow), never to ``init-args``.
    """
    check_ray_address(ray_address)
    return local_simulation(name)


def configure_simulation(connection: str, size: SimulationSize) -> str:
    """Set the running local SuperLink's simulation to ``size`` with Flower's own
    ``flwr federation simulation-config``; return what was done, to print.

    The SuperLink keeps it in memory (Flower's ``NoOpFederationManager``): a SuperLink
    started later gets Flower's default of 2 SuperNodes of 2 CPUs.
    """
    from flwr.cli.federation.simulation_config import simulation_config

    if not _is_local_superlink_started():
        return (
            "No local SuperLink is running, so its simulation size is not set: run this "
            "command without --no-start, or give every run "
            f'--federation-config "{size.federation_config()}"'
        )
    try:
        simulation_config(
            federation=None,
            superlink=connection,
            num_supernodes=size.num_supernodes,
            client_resources_num_cpus=size.num_cpus,
            client_resources_num_gpus=size.num_gpus,
            backend="ray",
        )
    except (click.ClickException, typer.Exit) as err:
        message = err.format_message() if isinstance(err, click.ClickException) else err
        raise SystemExit(f"Setting the local SuperLink's simulation failed: {message}") from err
    return (
        f"Local simulation: {size.num_supernodes} SuperNodes, {size.num_cpus} CPU(s)"
        f"{f' and {size.num_gpus:g} GPU' if size.num_gpus else ''} per ClientApp (kept by "
        "the running SuperLink; run this command again after it restarts)."
    )


def running_simulation_size() -> int | None:
    """The number of virtual SuperNodes of the running local SuperLink's simulation
    (None: no local SuperLink answers, or it does not say)."""
    if not _is_local_superlink_started():
        return None
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import ShowFederationRequest
    from flwr.supercore.constant import NOOP_FEDERATION_ID

    with contextlib.redirect_stdout(io.StringIO()):  # Flower prints "Using SuperLink: ..."
        client = init_http_client_from_connection(local_simulation())
    try:  # as `flwr federation ls --federation`: the details carry the config
        request = ShowFederationRequest(federation_name=NOOP_FEDERATION_ID)
        fed = client.ShowFederation(request).federation
    except Exception:  # an older or unreachable SuperLink: the size stays unknown
        return None
    finally:
        client.close()
    if not fed.simulation or not fed.HasField("config"):
        return None
    return int(fed.config.num_supernodes) or None


def check_ray_address(ray_address: str) -> None:
    """Refuse anything but the head's GCS address ``HOST:PORT`` (``ray start --head
    --port``): not Ray Client (``ray://``), which Flower's backend does not use, and not
    ``auto``, with which Ray may join any Ray it finds running on the machine."""
    if "://" in ray_address:
        raise SystemExit(
            f"--ray-address {ray_address}: give the head's GCS address HOST:PORT "
            "(`ray start --head --port 6379`). Ray Client (ray://) is not supported: "
            "run `flwr run` on a machine of the cluster (e.g. the head)."
        )
    if not _HOST_PORT.match(ray_address):
        raise SystemExit(f"--ray-address {ray_address}: expected the head's HOST:PORT")


def local_superlink_environments() -> dict[int, dict[str, str]]:
    """PID -> environment of each local SuperLink of this Flower home that is running
    now (found by its log file, under this home): the environment a simulation gets."""
    found: dict[int, dict[str, str]] = {}
    for proc in superlink_processes(get_flwr_home()):
        with contextlib.suppress(psutil.Error):
            found[proc.pid] = proc.environ()
    return found


def stop_local_superlink(timeout: float = 10.0) -> str:
    """Stop this Flower home's local SuperLink and its children by PID, as
    ``LocalSimulation`` does (``lab.launcher.stop_processes``: SIGTERM to its own process
    group, which Flower's launcher detaches, then SIGKILL after ``timeout`` s); return
    what was done, to print."""
    found = superlink_processes(get_flwr_home())
    if not found:
        return f"No local SuperLink of {get_flwr_home()} is running"
    pids = ", ".join(str(p.pid) for p in found)
    stop_processes(found, timeout=timeout)
    return f"Stopped the local SuperLink of {get_flwr_home()} (PID {pids})"


def local_superlink_ray_addresses() -> dict[int, str | None]:
    """PID -> ``RAY_ADDRESS`` (``None``: unset) of each local SuperLink of this Flower
    home that is running now."""
    return {pid: env.get(RAY_ADDRESS_ENV) for pid, env in local_superlink_environments().items()}


def start_local_superlink(ray_address: str | None = None) -> str:
    """Start this Flower home's local SuperLink as ``flwr run`` would (Flower's own
    launcher), with runtime dependency installation off and, for a Ray cluster,
    ``RAY_ADDRESS``; return what was done, to print.

    ``flwr run`` starts the local SuperLink with its shell's environment, and unless
    that environment sets ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` the
    SuperLink ``uv sync``s the app's dependencies into a fresh environment for every run
    (24 s of a newcomer's 75 s first run, and another PyTorch than the one installed).
    Flower 1.42 has no per-app or per-connection switch for it, so the install command
    starts the SuperLink itself. A SuperLink already running is left alone; if it
    installs dependencies per run, the message says how to replace it.
    """
    running = local_superlink_environments()
    if running:
        lines = []
        for pid, env in running.items():
            if env.get(RUNTIME_INSTALL_ENV) == "1":
                lines.append(
                    f"Local SuperLink already running (PID {pid}), runs use this environment."
                )
            else:
                lines.append(
                    f"Warning: the local SuperLink already running (PID {pid}) installs the "
                    "app's dependencies into a fresh environment for every run. To run in "
                    f"this environment instead: kill {pid}, then run this command again."
                )
        return "\n".join(lines)
    if _is_local_superlink_started():
        return (
            "Warning: a SuperLink of another Flower home answers on the local SuperLink's "
            "port; `flwr run` will use it (and its way of installing dependencies)."
        )
    os.environ[RUNTIME_INSTALL_ENV] = "1"  # _start_local_superlink passes os.environ on
    # Flower waits 15 s for the SuperLink to answer, then kills it: too short on a
    # loaded machine (a 2-core host at load 20 took longer); the wait ends as it answers.
    flower_launcher.LOCAL_SUPERLINK_STARTUP_TIMEOUT = max(
        flower_launcher.LOCAL_SUPERLINK_STARTUP_TIMEOUT, STARTUP_TIMEOUT
    )
    if ray_address is not None:
        os.environ[RAY_ADDRESS_ENV] = ray_address
    try:
        _start_local_superlink()
    except click.ClickException as err:  # e.g. flower-superlink not on PATH
        raise SystemExit(
            f"The connection is written, but the local SuperLink did not start: "
            f"{err.format_message()} Without it, `flwr run` starts one with its shell's "
            f"environment: export {RUNTIME_INSTALL_ENV}=1 before it."
        ) from err
    pids = ", ".join(str(pid) for pid in local_superlink_environments()) or "?"
    joined = f", joining the Ray cluster at {ray_address}" if ray_address else ""
    return (
        f"Local SuperLink started (PID {pids}) with runtime dependency installation off"
        f"{joined}: `flwr run` runs the app in this environment. It keeps running; after a "
        "reboot, run this command again before `flwr run`."
    )


def ray_instructions(conn: SuperLinkConnection, ray_address: str) -> str:
    """What to run so that ``flwr run . <conn>`` joins the cluster at ``ray_address``."""
    lines = [
        "Flower cannot store the Ray address in the connection; Ray reads it from the "
        "environment of the local SuperLink, which `flwr run` starts. On a machine of "
        "the cluster, run:",
        "",
        f"  export {RAY_ADDRESS_ENV}={ray_address}",
        f"  flwr run . {conn.name} --stream",
    ]
    for pid, running in local_superlink_ray_addresses().items():
        if running != ray_address:
            lines += [
                "",
                f"Warning: a local SuperLink is already running (PID {pid}) with "
                f"{RAY_ADDRESS_ENV}={running or '(unset: a Ray of its own)'}, and `flwr "
                f"run` sends runs to it. Stop it (kill {pid}); the next `flwr run` starts "
                "one with its shell's environment.",
            ]
    return "\n".join(lines)


def remote(
    name: str, address: str, root_certificates: str | None, insecure: bool
) -> SuperLinkConnection:
    """A connection to a SuperLink you run (e.g. ``lab``)."""
    if root_certificates is None and not insecure:
        raise SystemExit("give --root-certificates CA.crt (TLS) or --insecure")
    certs = str(Path(root_certificates).resolve()) if root_certificates else None
    return SuperLinkConnection(
        name=name, address=address, root_certificates=certs, insecure=insecure
    )


def main(argv: list[str] | None = None) -> None:
    """Write a connection (``local-simulation`` unless a name is given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "name",
        nargs="?",
        help=f"connection name (default: {LOCAL_SIMULATION}, {RAY_LAB} with --ray-address)",
    )
    parser.add_argument("--address", help="SuperLink Control API address, host:port")
    parser.add_argument("--root-certificates", help="CA certificate (PEM) for TLS")
    parser.add_argument("--insecure", action="store_true", help="no TLS (testing only)")
    parser.add_argument(
        "--ray-address",
        help="a local simulation whose Ray joins this cluster: the head's GCS address "
        "HOST:PORT (`ray start --head --port PORT`); used through RAY_ADDRESS",
    )
    parser.add_argument(
        "--no-start",
        action="store_true",
        help="only write the connection; the next `flwr run` starts the local SuperLink "
        "with its shell's environment",
    )
    parser.add_argument(
        "--stop",
        action="store_true",
        help="stop this Flower home's local SuperLink (by PID) and write nothing",
    )
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per ClientApp")
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=0.0,
        help="GPU fraction per ClientApp (0.25: 4 clients share a GPU)",
    )
    args = parser.parse_args(argv)
    if args.stop:
        print(stop_local_superlink())
        return
    if args.address is not None and args.ray_address is not None:
        parser.error("--address (a real SuperLink) and --ray-address exclude each other")
    size = SimulationSize(args.num_supernodes, args.num_cpus, args.num_gpus)
    if args.ray_address is not None:
        conn = ray_cluster(args.ray_address, args.name or RAY_LAB)
    elif args.address is None:
        conn = local_simulation(args.name or LOCAL_SIMULATION)
    else:
        conn = remote(
            args.name or LOCAL_SIMULATION, args.address, args.root_certificates, args.insecure
        )
    write_superlink_connection(conn)
    _, path = read_flower_config()
    print(f"SuperLink connection '{conn.name}' written to {path}")
    already = bool(local_superlink_environments())
    if args.address is None:
        if not args.no_start:
            print(start_local_superlink(args.ray_address))
        print(configure_simulation(conn.name, size))
    if args.ray_address is not None and (args.no_start or already):
        print(ray_instructions(conn, args.ray_address))


if __name__ == "__main__":
    main()
