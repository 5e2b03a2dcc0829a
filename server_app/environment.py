"""What a run ran on, and the one command that reruns it.

``environment.json`` beside ``config.json`` records the federation as far as the
ServerApp can know it (the connected nodes; the runtime: Flower's simulation runs the
ServerApp on an ``InMemoryGrid``; the simulation's client resources are not visible to
the ServerApp), the versions of the packages the results depend on, and the app's git
commit where the app was installed from a checkout (a FAB unpacked on a SuperLink has no
git: "unknown"). ``rerun.sh`` holds the ``flwr run`` command that makes the same
resolved run-config on a federation of the same size (also printed at the end).
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from protocol import presets
from server_app import config
from server_app.results import RunDirectory, app_source_dir

ENVIRONMENT_FILE = "environment.json"
RERUN_FILE = "rerun.sh"
PACKAGES = ("flwr", "torch", "opacus", "dp-accounting", "numpy", "ray")
UNKNOWN = "unknown"
# What lab.connections registers: one CPU per ClientApp (Flower's own default is 2).
CLIENT_RESOURCES = "client-resources-num-cpus=1"
DEPLOYED_CONNECTION = "lab"  # the docs' name of a connection to a real SuperLink


def versions() -> dict[str, str]:
    """Python's and each of ``PACKAGES``' version ("not installed" where absent)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def git_state(directory: Path | None) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the checkout at ``directory`` ("unknown"
    for both where there is no checkout or no git)."""
    state: dict[str, Any] = {"commit": UNKNOWN, "dirty": UNKNOWN}
    if directory is None:
        return state
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return state
    return {"commit": head, "dirty": bool(changed)}


def federation(grid: Any) -> dict[str, Any]:
    """The federation as the ServerApp sees it."""
    simulation = type(grid).__name__ == "InMemoryGrid"
    found: dict[str, Any] = {
        "runtime": "simulation" if simulation else "deployment",
        "num-nodes": len(list(grid.get_node_ids())),
        "backend": UNKNOWN,
        "client-resources": UNKNOWN + " to the ServerApp (they change speed, not results)",
    }
    ray = sys.modules.get("ray")
    if simulation and ray is not None and ray.is_initialized():
        found["backend"] = "ray"
        found["ray-cluster-cpus"] = ray.cluster_resources().get("CPU")
    return found


def rerun_command(cfg: config.RunConfig, fed: dict[str, Any]) -> str:
    """The ``flwr run`` command that makes ``cfg`` again on a federation like ``fed``."""
    parts = ["flwr run ."]
    if fed["runtime"] == "simulation":
        parts.append("local-simulation --stream")
        size = f"num-supernodes={fed['num-nodes']} {CLIENT_RESOURCES}"
        parts.append(f'--federation-config "{size}"')
    else:  # SuperNodes are started by hand: as many, with the same node configs
        parts.append(f"{DEPLOYED_CONNECTION} --stream")
    pairs = config.run_config_arg(config.command_line(cfg))
    if pairs:
        parts.append(f"--run-config {_quoted(pairs)}")
    return " ".join(parts)


def _quoted(text: str) -> str:
    """Double quotes (as the docs write it) unless the shell would expand something."""
    if any(c in text for c in '"$`\\!'):
        return shlex.quote(text)
    return f'"{text}"'


def record(run_dir: RunDirectory, cfg: config.RunConfig, grid: Any) -> str:
    """Write ``environment.json`` and ``rerun.sh``; return the rerun command."""
    fed = federation(grid)
    command = rerun_command(cfg, fed)
    # The code that runs, where it is a checkout (not a FAB unpacked on a SuperLink);
    # else the checkout the app was pip-installed from.
    source = presets.APP_DIR if (presets.APP_DIR / ".git").exists() else app_source_dir()
    doc: dict[str, Any] = {
        "federation": fed,
        "versions": versions(),
        "app": {"source-dir": str(source) if source else UNKNOWN, **git_state(source)},
        "preset": cfg.preset,
        "rerun": command,
    }
    run_dir.write_json(ENVIRONMENT_FILE, doc)
    script = (
        "#!/bin/sh\n# Reruns this run's resolved run-config (from the app's directory; "
        f"git commit {doc['app']['commit']}).\n{command}\n"
    )
    (run_dir.path / RERUN_FILE).write_text(script)
    return command
