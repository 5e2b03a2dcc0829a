"""A newcomer's first run: the README's install command's second half, then the
default experiment, timed.

In a fresh Flower home (the user's ``~/.flwr`` is not touched) and on free ports, with
nothing of the benchmarks' own set-up (no ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION``
in the environment, no staging of the app):

1. ``python -m lab.connections`` (writes ``local-simulation`` and starts the local
   SuperLink with runtime dependency installation off);
2. ``flwr run . local-simulation --stream`` in the checkout: the default experiment
   (digits, FedAvg, 10 virtual SuperNodes, 10 rounds, central evaluation).

Design notes: ``docs/notes.md``, ``bench.first_run``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.launcher import APP_DIR, BIN, free_port, stop_processes, superlink_processes

_RUN_DIR = re.compile(r"Run directory: (\S+)")


def first_run(runtime_install: bool) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="flwr-newcomer-"))
    env = {
        k: v for k, v in os.environ.items() if k != "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"
    }
    env |= {
        "FLWR_HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    out = home / "runs"
    try:
        started = time.monotonic()
        extra = ["--no-start"] if runtime_install else []
        subprocess.run(
            [sys.executable, "-m", "lab.connections", *extra],
            cwd=APP_DIR, env=env, check=True, capture_output=True,
        )  # fmt: skip
        connections_s = time.monotonic() - started
        started = time.monotonic()
        proc = subprocess.run(
            [str(BIN / "flwr"), "run", ".", "local-simulation", "--stream",
             "--run-config", f"output-dir='{out}'"],
            cwd=APP_DIR, env=env, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        run_s = time.monotonic() - started
        output = proc.stdout + proc.stderr
        match = _RUN_DIR.search(output)
        if proc.returncode != 0 or match is None:
            raise SystemExit(f"flwr run failed:\n{output[-4000:]}")
        train = pd.read_csv(Path(match.group(1)) / "metrics.csv").query("scope == 'train'")
        elapsed = train["elapsed-s"]
        return {
            "lab.connections (s)": connections_s,
            "flwr run (s)": run_s,
            "both (s)": connections_s + run_s,
            "round 1 (s)": float(train["round-seconds"].iloc[0]),
            "warm round (s)": float(elapsed.diff().iloc[1:].median()),
        }
    finally:
        stop_processes(superlink_processes(home))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runtime-install", action="store_true")
    args = parser.parse_args()
    rows = []
    for i in range(args.repeats):
        row = first_run(args.runtime_install)
        rows.append(row)
        print(f"run {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(
        "median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.2f}" for k in rows[0])
    )


if __name__ == "__main__":
    main()
