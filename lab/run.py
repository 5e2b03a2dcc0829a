"""Run one experiment with the engine of choice: ``flwr run``'s, or the in-process one.

    python -m lab.run --engine inprocess --run-config "privacy='dp-fedavg-adaptive' ..." \
        --federation-config "num-supernodes=100"
    python -m lab.run --engine flwr --run-config "..."      # flwr run . local-simulation --stream

The run-config is the one ``flwr run --run-config`` takes (``key=value`` pairs or one
TOML preset); ``--federation-config`` takes ``num-supernodes`` and
``client-resources-num-cpus`` (the torch threads of each ClientApp call in process).
The exit code is 0 for a completed run, 1 for a failed one, 2 for bad arguments. The
in-process engine is described in docs/engine.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import click

from lab.engine import APP_DIR, ENGINE_NAME, EngineConfigError, Federation, run

ENGINES = (ENGINE_NAME, "flwr")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lab.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=ENGINE_NAME,
        help="inprocess: this process, no Ray or SuperLink; flwr: `flwr run . local-simulation`",
    )
    parser.add_argument("--run-config", default="", help="as `flwr run --run-config`")
    parser.add_argument("--federation-config", default="", help="e.g. 'num-supernodes=100'")
    parser.add_argument(
        "--connection",
        default="local-simulation",
        help="--engine flwr: the SuperLink connection (default local-simulation)",
    )
    return parser


def flwr_command(args: argparse.Namespace) -> list[str]:
    """The ``flwr run`` command line the flwr engine runs."""
    flwr = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    cmd = [flwr, "run", str(APP_DIR), args.connection, "--stream"]
    if args.run_config:
        cmd += ["--run-config", args.run_config]
    if args.federation_config:
        cmd += ["--federation-config", args.federation_config]
    return cmd


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.engine == "flwr":
        return subprocess.run(flwr_command(args), check=False).returncode
    try:
        federation = Federation.parse(args.federation_config)
        result = run(args.run_config, federation)
    except EngineConfigError as err:
        parser.error(str(err))
    except ValueError as err:  # Flower's parser: a TOML file next to key=value pairs
        parser.error(f"--run-config: {err}")
    except click.ClickException as err:  # Flower's parser: a malformed key=value string
        parser.error(f"--run-config: {err.format_message()}")
    print(
        f"{result.status} in {result.seconds:.1f} s (engine {ENGINE_NAME}); "
        f"run directory: {result.run_dir}",
        flush=True,
    )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
