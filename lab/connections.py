"""Register this app's SuperLink connections in the Flower configuration file.

Flower 1.41 reads SuperLink connections from ``$FLWR_HOME/config.toml`` (default
``~/.flwr/config.toml``); a ``[tool.flwr.federations]`` table in ``pyproject.toml``
would be migrated there by ``flwr run``, which rewrites the tracked pyproject in
place. So the app keeps no federations table and this module writes the
connections instead, through Flower's own config API, touching no other entry::

    python -m lab.connections                 # adds `local-simulation`
    python -m lab.connections lab --address 10.0.0.5:9093 \\
        --root-certificates certs/ca.crt               # a real SuperLink

``local-simulation`` is a local SuperLink (started on demand by ``flwr run``) running
the simulation runtime with 10 virtual SuperNodes of 1 CPU each. Its simulation
options are per-connection ``options.*``, which Flower 1.41 still honours but flags
as deprecated; per run they can be overridden with
``flwr run . local-simulation --federation-config "num-supernodes=20"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flwr.cli.flower_config import read_flower_config, write_superlink_connection
from flwr.cli.typing import (
    SimulationBackendConfig,
    SimulationClientResources,
    SuperLinkConnection,
    SuperLinkSimulationOptions,
)

LOCAL_SIMULATION = "local-simulation"
LOCAL_ADDRESS = ":local:"  # Flower's magic value: start a local SuperLink on demand


def local_simulation(
    num_supernodes: int = 10, num_cpus: int = 1, num_gpus: float = 0.0
) -> SuperLinkConnection:
    """The ``local-simulation`` connection: local SuperLink, simulation runtime."""
    return SuperLinkConnection(
        name=LOCAL_SIMULATION,
        address=LOCAL_ADDRESS,
        options=SuperLinkSimulationOptions(
            num_supernodes=num_supernodes,
            backend=SimulationBackendConfig(
                name="ray",
                client_resources=SimulationClientResources(num_cpus=num_cpus, num_gpus=num_gpus),
            ),
        ),
    )


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
    parser.add_argument("name", nargs="?", default=LOCAL_SIMULATION)
    parser.add_argument("--address", help="SuperLink Control API address, host:port")
    parser.add_argument("--root-certificates", help="CA certificate (PEM) for TLS")
    parser.add_argument("--insecure", action="store_true", help="no TLS (testing only)")
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per ClientApp")
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=0.0,
        help="GPU fraction per ClientApp (0.25: 4 clients share a GPU)",
    )
    args = parser.parse_args(argv)
    if args.address is None:
        conn = local_simulation(args.num_supernodes, args.num_cpus, args.num_gpus)
    else:
        conn = remote(args.name, args.address, args.root_certificates, args.insecure)
    if args.address is None and args.name != LOCAL_SIMULATION:
        conn.name = args.name
    write_superlink_connection(conn)
    _, path = read_flower_config()
    print(f"SuperLink connection '{conn.name}' written to {path}")


if __name__ == "__main__":
    main()
