"""The first runs' costs: a newcomer's first run, how soon a mistake is reported, and
the time, accuracy and epsilon of whole runs.

    python bench/first_run.py --repeats 3              # the newcomer's first run
    python bench/first_run.py mistakes --repeats 1     # how soon a mistake is reported
    python bench/first_run.py runs --repeats 3 [--config NAME=RUN_CONFIG ...]

The newcomer's run: in a fresh Flower home and on free ports, ``python -m
lab.connections`` then ``flwr run . local-simulation --stream`` (the default
experiment), timed. ``mistakes``: how long a run-config error takes to reach the user
through ``python -m lab check``, and each ``lab`` command's ``--help``; ``runs``: whole
``flwr run`` runs through one private local SuperLink. Design notes: ``docs/notes.md``,
``bench.first_run``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.launcher import (
    APP_DIR,
    BIN,
    LocalSimulation,
    free_port,
    stop_processes,
    superlink_processes,
)

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


def newcomer_main(argv: list[str] | None = None) -> None:
    """The README's install command's second half, then the default experiment, timed."""
    parser = argparse.ArgumentParser(
        prog="first_run.py",
        description=__doc__.split("\n\n")[0],
        epilog="other commands: mistakes, runs; each takes --help",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runtime-install", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for i in range(args.repeats):
        row = first_run(args.runtime_install)
        rows.append(row)
        print(f"run {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(
        "median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.2f}" for k in rows[0])
    )


# --- mistakes: how soon a newcomer learns of a mistake ------------------------------
# Each measurement is a fresh ``python`` process (what a user starts), timed from start
# to exit, with its exit status and first line of output; the median of ``--repeats``,
# as wall time and as CPU time (what it takes on an idle core).

# The first mistakes of a newcomer (the README's examples, mistyped), one run-config each.
MISTAKES = {
    "a preset file beside key=value pairs": "experiments/digits-dp-eps8.toml num-server-rounds=5",
    "a misspelled key": "fedprox.muu=0.1",
    "a misspelled preset": "preset='digits-dp-ep8'",
    "a misspelled strategy": "strategy='fedsgd'",
    "a negative noise multiplier": "privacy='dp-fedavg-fixed' dp.noise-multiplier=-1",
    "a DP cohort larger than the federation": "privacy='dp-fedavg-fixed' "
    "dp.target-epsilon=8 dp.num-sampled-clients=20",
    "a valid preset with an override (no error)": "preset='digits-dp-eps8' num-server-rounds=5",
}
MISTAKES_FEDERATION = "num-supernodes=10 client-resources-num-cpus=1"


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


def mistakes_main(argv: list[str] | None = None) -> None:
    """How soon ``python -m lab check`` reports a newcomer's mistake; ``--help`` times."""
    parser = argparse.ArgumentParser(
        prog="first_run.py mistakes",
        description="The first hour's waits: how long a run-config error takes to reach the "
        "user through `python -m lab check`, and how long each lab command's --help takes "
        "(fresh processes; medians of --repeats, wall and CPU time).",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    # A Flower home of our own: lab.check reads connections from it, and never writes one.
    env = {**os.environ, "FLWR_HOME": tempfile.mkdtemp(prefix="flwr-home-")}
    py = sys.executable
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| mistake | `python -m lab check` | exit | wall s | CPU s | the line |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for what, run_config in MISTAKES.items():
        argv = [py, "-m", "lab", "check", "--run-config", run_config]
        argv += ["--federation-config", MISTAKES_FEDERATION]
        wall, cpu, code, line = median_of(argv, env, args.repeats)
        print(f"| {what} | `{run_config}` | {code} | {wall:.1f} | {cpu:.1f} | {line[:140]} |")
    print("\n| command | `--help` wall s | CPU s | exit |")
    print("| --- | ---: | ---: | ---: |")
    for module in lab_commands():
        wall, cpu, code, _ = median_of([py, "-m", module, "--help"], env, args.repeats)
        print(f"| `python -m {module} --help` | {wall:.2f} | {cpu:.2f} | {code} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


# --- runs: wall time, accuracy and epsilon of whole runs ----------------------------
# Each configuration runs ``--repeats`` times through one private local SuperLink (the
# first run of the session also pays the SuperLink's start-up; it is reported apart).
# Run it from a clean checkout (``git worktree add /tmp/wt HEAD``, then
# ``PYTHONPATH=/tmp/wt python bench/first_run.py runs`` from ``/tmp/wt``): editing the
# app while it runs changes what is measured.


def final_value(metrics: pd.DataFrame, scope: str, column: str) -> float:
    """The last round's ``column`` in ``scope`` (NaN when absent)."""
    rows = metrics[metrics["scope"] == scope].sort_values("round")
    if column not in rows or rows[column].isna().all():
        return float("nan")
    return float(rows[column].dropna().iloc[-1])


def runs_main(argv: list[str] | None = None) -> None:
    """Median wall time, final accuracies and epsilon of whole ``flwr run`` runs."""
    parser = argparse.ArgumentParser(
        prog="first_run.py runs",
        description="Wall time, accuracy and epsilon of whole `flwr run . local-simulation` "
        "runs through a private local SuperLink (medians over --repeats).",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="NAME=RUN_CONFIG (default: the default experiment)",
    )
    args = parser.parse_args(argv)
    configs = dict(c.split("=", 1) for c in args.config) or {"default": ""}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop the SuperLink

    rows = []
    with tempfile.TemporaryDirectory() as out, LocalSimulation(args.num_supernodes) as sim:
        warmup = sim.run(f"num-server-rounds=1 output-dir='{out}/warmup'")
        print(f"first run incl. SuperLink start-up: {warmup.seconds:.1f} s", flush=True)
        for name, run_config in configs.items():
            seconds, central, federated, epsilon = [], [], [], []
            for i in range(args.repeats):
                result = sim.run(f"{run_config} output-dir='{out}/{name}-{i}'".strip())
                if result.returncode != 0 or result.run_dir is None:
                    raise SystemExit(result.output)
                metrics = pd.read_csv(result.run_dir / "metrics.csv")
                seconds.append(result.seconds)
                central.append(final_value(metrics, "central-eval", "eval-accuracy"))
                federated.append(final_value(metrics, "federated-eval", "eval-accuracy"))
                epsilon.append(final_value(metrics, "train", "dp-epsilon"))
                print(
                    f"{name} #{i}: {result.seconds:.1f} s, central {central[-1]:.4f}, "
                    f"federated {federated[-1]:.4f}, epsilon {epsilon[-1]:.4g}",
                    flush=True,
                )
            rows.append(
                (
                    name,
                    run_config or "(defaults)",
                    *(statistics.median(v) for v in (seconds, central, federated, epsilon)),
                )
            )

    print("\n| config | run-config | wall time (s) | central acc. | federated acc. | epsilon |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, run_config, sec, cen, fed, eps in rows:
        print(f"| {name} | `{run_config}` | {sec:.1f} | {cen:.4f} | {fed:.4f} | {eps:.4g} |")


COMMANDS = {"mistakes": mistakes_main, "runs": runs_main}


def main(argv: list[str] | None = None) -> None:
    """``mistakes`` or ``runs`` with their arguments, else the newcomer's run's."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        COMMANDS[args[0]](args[1:])
    else:
        newcomer_main(args)


if __name__ == "__main__":
    main()
