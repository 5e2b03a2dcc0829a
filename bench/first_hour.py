"""The first hour's waits: how long a run-config error takes to reach the user through
``python -m lab check``, and how long each ``lab`` command's ``--help`` takes.

Each measurement is a fresh ``python`` process (what a user starts), timed from start
to exit, with its exit status and its first line of output; the median of
``--repeats``. Prints a Markdown table (bench/BENCHMARKS.md, "The first hour").

    python bench/first_hour.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]

# The first mistakes of a newcomer (the README's examples, mistyped), one run-config each.
ERRORS = {
    "a preset file beside key=value pairs": "experiments/digits-dp-eps8.toml num-server-rounds=5",
    "a misspelled key": "fedprox.muu=0.1",
    "a misspelled preset": "preset='digits-dp-ep8'",
    "a misspelled strategy": "strategy='fedsgd'",
    "a negative noise multiplier": "privacy='dp-fedavg-fixed' dp.noise-multiplier=-1",
    "a DP cohort larger than the federation": "privacy='dp-fedavg-fixed' "
    "dp.target-epsilon=8 dp.num-sampled-clients=20",
    "a valid preset with an override (no error)": "preset='digits-dp-eps8' num-server-rounds=5",
}
FEDERATION = "num-supernodes=10 client-resources-num-cpus=1"


def lab_commands() -> list[str]:
    """The ``lab`` modules with a ``main`` (each is a command)."""
    return sorted(
        f"lab.{path.stem}" if path.stem != "__main__" else "lab"
        for path in (APP_DIR / "lab").glob("*.py")
        if "def main(" in path.read_text()
    )


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """(seconds, exit status, first line of output) of one process."""
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=APP_DIR, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return seconds, proc.returncode, lines[0] if lines else ""


def median_of(argv: list[str], env: dict[str, str], repeats: int) -> tuple[float, int, str]:
    runs = [timed(argv, env) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), runs[-1][1], runs[-1][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # A Flower home of our own: lab.check reads connections from it, and never writes one.
    env = {**os.environ, "FLWR_HOME": tempfile.mkdtemp(prefix="flwr-home-")}
    py = sys.executable
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| mistake | `python -m lab check` | exit | seconds (median) | the line |")
    print("| --- | --- | ---: | ---: | --- |")
    for what, run_config in ERRORS.items():
        argv = [py, "-m", "lab", "check", "--run-config", run_config]
        argv += ["--federation-config", FEDERATION]
        seconds, code, line = median_of(argv, env, args.repeats)
        print(f"| {what} | `{run_config}` | {code} | {seconds:.1f} | {line[:140]} |")
    print("\n| command | `--help` seconds (median) | exit |")
    print("| --- | ---: | ---: |")
    for module in lab_commands():
        seconds, code, _ = median_of([py, "-m", module, "--help"], env, args.repeats)
        print(f"| `python -m {module} --help` | {seconds:.2f} | {code} |")


if __name__ == "__main__":
    main()
