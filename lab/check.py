"""Check a ``flwr run`` command's run-config and federation before submitting it.

    python -m lab check --run-config "preset='digits-dp-eps8' num-server-rounds=5" \\
        --federation-config "num-supernodes=100 client-resources-num-cpus=1"

Parses ``--run-config`` as Flower's CLI does, fuses it over the app's defaults as the
SuperLink does, and validates the result with the ServerApp's own code, in seconds and
without a SuperLink. Values are checked first against ``lab/run_config_options.json``
(generated from the declarations), so a bad value answers before PyTorch loads. It also
catches what Flower drops silently: a ``.toml`` path in one string with ``key=value``
pairs. Prints one line: ``OK: ...`` (exit 0) or ``error: ...`` (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

# Flower's pattern for one key=value pair (flwr.common.config.parse_config_args).
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")
LOCAL_SIMULATION = "local-simulation"
# Each key's checks (type, range, choices), generated: docs/gen_tables.py writes it.
OPTIONS_FILE = Path(__file__).resolve().with_name("run_config_options.json")
_OPTION_FIELDS = ("key", "default", "choices", "low", "high", "low_open", "high_open")


class CheckError(ValueError):
    """What would make the run fail, or run something else than asked."""


def refuse_what_flower_drops(arg: str) -> None:
    """Refuse what Flower's parser would silently drop from one ``--run-config``."""
    words = arg.split()
    if len(words) > 1 and any(w.endswith(".toml") for w in words):
        toml = next(w for w in words if w.endswith(".toml"))
        name = Path(toml).stem
        raise CheckError(
            f"--run-config {arg!r}: Flower drops {toml!r} when it shares the string with "
            f"key=value pairs (the run would not use it); write preset='{name}' instead"
        )
    leftover = _PAIR.sub(" ", arg).split()
    if leftover and not (len(words) == 1 and arg.strip().endswith(".toml")):
        raise CheckError(
            f"--run-config: Flower ignores {' '.join(leftover)!r} (not key=value); "
            "quote string values, e.g. privacy='dp-fedavg-fixed'"
        )


def parse_run_config(args: Sequence[str]) -> dict:
    """The overrides Flower's CLI sends for ``--run-config`` ``args``."""
    from flwr.common.config import parse_config_args

    for arg in args:
        refuse_what_flower_drops(arg)
    try:
        return parse_config_args(list(args)) if args else {}
    except Exception as err:  # Flower raises ValueError, click's exceptions, TOML errors
        text = getattr(err, "message", None) or str(err)
        raise CheckError(f"--run-config: {text}") from None


def num_supernodes(federation_config: Sequence[str], connection: str) -> tuple[int | None, str]:
    """The simulation's size: ``--federation-config``'s, else the connection's."""
    from flwr.common.config import parse_config_args

    if federation_config:
        try:
            values = parse_config_args(list(federation_config))
        except Exception as err:
            raise CheckError(f"--federation-config: {err}") from None
        valid = federation_keys()
        unknown = sorted(set(values) - valid)
        if unknown:
            raise CheckError(
                f"--federation-config: unknown field(s) {', '.join(unknown)}; valid: "
                + ", ".join(sorted(valid))
            )
        if "num-supernodes" in values:
            return int(values["num-supernodes"]), "--federation-config"
        return None, "--federation-config names no num-supernodes"
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.supercore.utils import get_flwr_home

    if not (get_flwr_home() / "config.toml").is_file():  # Flower would create one
        return None, f"no Flower configuration, so no connection {connection!r}"
    try:
        conn = read_superlink_connection(connection)
    except Exception:  # no such connection, or a configuration Flower cannot read
        return None, f"connection {connection!r} not found"
    if conn.options is not None:  # Flower's deprecated per-connection options.*
        return int(conn.options.num_supernodes), f"connection {connection!r}"
    if conn.address != ":local:":
        return None, f"connection {connection!r} is not a local simulation"
    from lab.connections import running_simulation_size

    size = running_simulation_size()  # the size lives in the running SuperLink only
    if size is None:
        return None, "no local SuperLink running (`python -m lab.connections` starts one)"
    return size, "the running local SuperLink"


def federation_keys() -> frozenset[str]:
    """The fields ``flwr run --federation-config`` accepts: Flower's SimulationConfig's."""
    from flwr.proto.federation_config_pb2 import SimulationConfig

    return frozenset(f.name.replace("_", "-") for f in SimulationConfig.DESCRIPTOR.fields)


def _check_keys(overrides: dict, defaults: dict) -> None:
    """Unknown keys (which Flower's SuperLink refuses with only "[code: 15] Invalid run
    configuration.") and the preset, from ``pyproject.toml`` alone: no PyTorch import."""
    from config.options import unknown_keys_message
    from protocol import presets

    message = unknown_keys_message(overrides, defaults)
    if message:
        raise CheckError(message)
    try:
        fused = {**defaults, **overrides}
        presets.refuse_ambiguous(fused, set(overrides), defaults)
        unknown = sorted(set(presets.resolve(fused, defaults)) - set(defaults))
    except presets.PresetError as err:
        raise CheckError(str(err)) from None
    if unknown:
        raise CheckError(f"preset {overrides['preset']!r} sets unknown key(s): {unknown}")


def options_json() -> str:
    """``OPTIONS_FILE``'s text: every declared option's checks, from the code."""
    from server_app import config

    rows = [{f: getattr(opt, f) for f in _OPTION_FIELDS} for opt in config.all_options()]
    return "[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n"  # a key a line


def _check_values(fused: dict) -> None:
    """Each value's type, range and choices, from ``OPTIONS_FILE`` (no PyTorch import);
    without the file, the ServerApp's code checks them later."""
    from config.options import ConfigError, Option, parse_options
    from protocol import presets

    try:
        rows = json.loads(OPTIONS_FILE.read_text())
    except (OSError, ValueError):
        return
    options = [
        Option(help="", **{**row, "choices": row["choices"] and tuple(row["choices"])})
        for row in rows
    ]
    try:
        parse_options(presets.resolve(fused, presets.app_defaults()), options)
    except ConfigError as err:
        raise CheckError(str(err)) from None


def check(
    run_config: Sequence[str],
    federation_config: Sequence[str] = (),
    connection: str = LOCAL_SIMULATION,
) -> str:
    """Validate as the ServerApp would; return the one line to print on success.

    Raises
    ------
    CheckError
        Naming the key, the value and the valid values (or the fix).
    """
    from protocol import presets

    overrides = parse_run_config(run_config)
    fused = {**presets.app_defaults(), **overrides}
    _check_keys(overrides, presets.app_defaults())  # before the slow imports below
    _check_values(fused)
    import strategies
    import tasks
    from server_app import config, setup
    from server_app.audit import AuditSettings
    from strategies import StopTraining

    try:
        cfg = config.load(fused, explicit=set(overrides))
        task = tasks.get(cfg.task)(cfg.to_dict())
        strategy = strategies.build(cfg.privacy, cfg.strategy_settings())
    except ValueError as err:  # ConfigError and the parts' own range checks
        raise CheckError(str(err)) from None
    size, source = num_supernodes(federation_config, connection)
    where = f"{size} SuperNodes ({source})" if size is not None else f"size unknown: {source}"
    if size is not None:
        need = setup.needs(cfg, strategy)
        short = {k: v for k, v in need.items() if v > size}
        if short:
            keys = ", ".join(f"'{k}' = {v}" for k, v in short.items())
            raise CheckError(
                f"{keys} needs at least {max(short.values())} nodes, but the simulation "
                f'has {size} ({source}); use --federation-config "num-supernodes='
                f'{max(short.values())} client-resources-num-cpus=1" or lower the key'
            )
        try:
            setup.check_size(size, cfg.part(AuditSettings).canaries, cfg.task, task)
        except StopTraining as err:
            raise CheckError(str(err)) from None
    return f"OK: {setup.privacy_line(cfg)}; federation: {where}"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, print one line, return the exit status (0 valid, 2 not)."""
    parser = argparse.ArgumentParser(
        prog="python -m lab check",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--run-config", action="append", default=[], help="as given to flwr run (repeatable)"
    )
    parser.add_argument(
        "--federation-config", action="append", default=[], help="as given to flwr run"
    )
    parser.add_argument(
        "--connection",
        default=LOCAL_SIMULATION,
        help="the SuperLink connection whose simulation size applies without "
        f"--federation-config (default: {LOCAL_SIMULATION})",
    )
    args = parser.parse_args(argv)
    try:
        print(check(args.run_config, args.federation_config, args.connection))
    except CheckError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
