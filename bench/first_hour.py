"""The first hour's waits: how long a run-config error takes to reach the user through
``python -m lab check``, and how long each ``lab`` command's ``--help`` takes.

Each measurement is a fresh ``python`` process (what a user starts), timed from start
to exit, with its exit status and its first line of output; the median of
``--repeats``, as wall time and as CPU time (what it takes on an idle core). Prints
Markdown tables (bench/BENCHMARKS.md, "How soon does a user learn of a mistake?").

    python bench/first_hour.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import resource
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


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, exit status, first line of output) of one process.

    The CPU time (user + system) is what the wall time would be on an idle core: the
    process is single-threaded until it prints; on a shared machine the wall time is
    larger by the load."""
    cpu, started = _cpu(), time.perf_counter()
    proc = subprocess.run(argv, cwd=APP_DIR, env=env, capture_output=True, text=True, check=False)
    seconds, cpu = time.perf_counter() - started, _cpu() - cpu
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return seconds, cpu, proc.returncode, lines[0] if lines else ""


def median_of(argv: list[str], env: dict[str, str], repeats: int) -> tuple[float, float, int, str]:
    runs = [timed(argv, env) for _ in range(repeats)]
    wall, cpu = (statistics.median(r[i] for r in runs) for i in (0, 1))
    return wall, cpu, runs[-1][2], runs[-1][3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # A Flower home of our own: lab.check reads connections from it, and never writes one.
    env = {**os.environ, "FLWR_HOME": tempfile.mkdtemp(prefix="flwr-home-")}
    py = sys.executable
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| mistake | `python -m lab check` | exit | wall s | CPU s | the line |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for what, run_config in ERRORS.items():
        argv = [py, "-m", "lab", "check", "--run-config", run_config]
        argv += ["--federation-config", FEDERATION]
        wall, cpu, code, line = median_of(argv, env, args.repeats)
        print(f"| {what} | `{run_config}` | {code} | {wall:.1f} | {cpu:.1f} | {line[:140]} |")
    print("\n| command | `--help` wall s | CPU s | exit |")
    print("| --- | ---: | ---: | ---: |")
    for module in lab_commands():
        wall, cpu, code, _ = median_of([py, "-m", module, "--help"], env, args.repeats)
        print(f"| `python -m {module} --help` | {wall:.2f} | {cpu:.2f} | {code} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
