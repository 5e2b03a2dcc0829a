"""Deployed digits rounds on loopback, four ways of running SuperNodes and ClientApps.

    python bench/deployed.py --rounds 4 --subprocess-rounds 2

Design notes: ``docs/notes.md``, ``bench.deployed``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.e2e.test_deployment

from lab.launcher import (  # noqa: E402
    _RUN_DIR_LINE,
    _RUN_ID_LINE,
    APP_DIR,
    BIN,
    LocalSimulation,
    stage_app,
    stop_processes,
)
from tests.e2e.test_deployment import NUM_NODES, Deployment, _status_of, free_port  # noqa: E402

WAYS = ("subprocess", "process", "warm", "warm-poll")
LABELS = {
    "simulation": ("`flwr run . local-simulation`", "Ray actor, kept between rounds"),
    "subprocess": ("`--isolation subprocess` (default)", "new `flwr-clientapp`"),
    "process": ("`--isolation process` + `flower-superexec`", "new `flwr-clientapp`"),
    "warm": ("`--isolation process` + `python -m deploy.superexec`", "fork of a warm zygote"),
    "warm-poll": (
        "`python -m deploy.supernode --isolation process` + `python -m deploy.superexec`",
        "fork of a warm zygote",
    ),
}
READY = "Warm executor ready"
TIMEOUT = 900  # s for one flwr run


def run_config(rounds: int, out: Path) -> str:
    return (
        f"num-server-rounds={rounds} fraction-train=1.0 fraction-evaluate=0.0 "
        f"central-eval=false min-available-nodes={NUM_NODES} min-train-nodes={NUM_NODES} "
        f"round-timeout=300 output-dir='{out}'"
    )


@dataclass
class Result:
    way: str
    rounds: list[float]  # round-seconds of rounds 1..R
    seconds: float  # the whole flwr run

    @property
    def warm(self) -> float:
        return statistics.median(self.rounds[1:]) if len(self.rounds) > 1 else float("nan")


def _round_seconds(run_dir: Path) -> list[float]:
    metrics = pd.read_csv(run_dir / "metrics.csv")
    train = metrics[metrics["scope"] == "train"].sort_values("round")
    return [float(s) for s in train["round-seconds"]]


def simulate(rounds: int, out: Path) -> Result:
    """The same run on 3 virtual SuperNodes."""
    with LocalSimulation(num_supernodes=NUM_NODES) as sim:
        outcome = sim.run(run_config(rounds, out), timeout=TIMEOUT)
    if outcome.returncode != 0 or outcome.run_dir is None:
        raise SystemExit(f"simulation failed:\n{outcome.output}")
    return Result("simulation", _round_seconds(outcome.run_dir), outcome.seconds)


def start_way(dep: Deployment, way: str) -> list[str]:
    """Start 3 SuperNodes (keys and partitions 0-2) and, for ``process``/``warm``,
    their executors; return the names of the processes started."""
    names = []
    for k in range(NUM_NODES):
        port = free_port()
        isolation = [] if way == "subprocess" else ["--isolation", "process"]
        polled = [sys.executable, "-m", "deploy.supernode"] if way == "warm-poll" else []
        dep.start_supernode(
            f"{way}-supernode-{k}", *isolation,
            "--root-certificates", str(dep.ca.public),
            "--auth-supernode-private-key", str(dep.keys[k].private),
            "--node-config", f"partition-id={k} num-partitions={NUM_NODES}",
            port=port, command=polled,
        )  # fmt: skip
        names.append(f"{way}-supernode-{k}")
        api = ["--runtime-api-address", f"127.0.0.1:{port}", "--insecure"]
        if way == "process":
            dep.start(f"{way}-superexec-{k}", str(BIN / "flower-superexec"), *api)
            names.append(f"{way}-superexec-{k}")
        elif way in ("warm", "warm-poll"):
            dep.start(f"{way}-superexec-{k}", sys.executable, "-m", "deploy.superexec", *api)
            names.append(f"{way}-superexec-{k}")
    return names


def wait_for(dep: Deployment, names: list[str], status: str, timeout: float = 120) -> None:
    """Until every registered node has ``status`` (and, for ``online``, every warm
    executor of ``names`` has logged that it is ready)."""
    deadline = time.monotonic() + timeout
    executors = [n for n in names if "superexec" in n and n.startswith("warm")]
    while True:
        nodes = dep.nodes()
        ready = status != "online" or all(READY in dep.log(n) for n in executors)
        if set(nodes.values()) == {status} and ready:
            return
        for name in names:
            if dep.processes[name].poll() is not None:
                raise SystemExit(f"{name} exited:\n{dep.log(name)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"nodes not {status} in {timeout} s: {nodes}")
        time.sleep(0.5)


def stop_way(dep: Deployment, names: list[str]) -> None:
    """Stop the way's processes by PID (SIGTERM, SIGKILL after 15 s); a SuperNode that
    is stopped tells the SuperLink, which lists it offline at once."""
    procs = []
    for name in names:
        try:
            procs.append(psutil.Process(dep.processes[name].pid))
        except psutil.NoSuchProcess:
            continue
    stop_processes(procs, timeout=15)
    for name in names:
        dep.processes[name].wait(timeout=10)


def deployed_run(dep: Deployment, way: str, stage: Path, rounds: int) -> Result:
    names = start_way(dep, way)
    try:
        wait_for(dep, names, "online")
        out = dep.root / f"runs-{way}"
        started = time.monotonic()
        flwr = dep.start(
            f"flwr-run-{way}", str(BIN / "flwr"), "run", str(stage), "lab", "--stream",
            "--run-config", run_config(rounds, out), cwd=APP_DIR,
        )  # fmt: skip
        flwr.wait(timeout=TIMEOUT)
        seconds = time.monotonic() - started
        output = dep.log(f"flwr-run-{way}")
        run_id, run_dir = _RUN_ID_LINE.search(output), _RUN_DIR_LINE.search(output)
        status = None
        if run_id and run_dir:
            listing = dep.flwr("list", "lab", "--format", "json").stdout
            status = _status_of(listing, run_id.group(1))
        if status != "finished:completed":
            raise SystemExit(f"{way}: the run did not complete ({status}):\n{output}")
        if way.startswith("warm"):  # every message went through a zygote
            done = re.compile(r"Warm executor: task \d+ done")
            forks = sum(len(done.findall(dep.log(name))) for name in names)
            print(f"warm: {forks} ClientApps forked", flush=True)
        return Result(way, _round_seconds(Path(run_dir.group(1))), seconds)
    finally:
        stop_way(dep, names)
        wait_for(dep, names, "offline", timeout=90)


def table(results: list[Result]) -> str:
    lines = [
        "| ClientApps run by | a message gets | rounds | round 1 (s) "
        "| warm round, median of rounds 2–R (s) | whole `flwr run` (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        way, per_message = LABELS[r.way]
        lines.append(
            f"| {way} | {per_message} | {len(r.rounds)} | {r.rounds[0]:.2f} "
            f"| {r.warm:.2f} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--subprocess-rounds", type=int, help="default: --rounds")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--no-simulation", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the logs and run folders")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of every process it starts"
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by all we start
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop what we started

    results = []
    root = Path(tempfile.mkdtemp(prefix="flwr-bench-deployed-"))
    try:
        if not args.no_simulation:
            results.append(simulate(args.rounds, root / "simulation"))
            print(table(results[-1:]), flush=True)
        dep = Deployment(root / "deployment")
        try:
            dep.start_superlink()
            dep.run_doc("register")
            stage = root / "app"
            stage_app(APP_DIR, stage)  # one FAB for every way
            for way in args.ways:
                rounds = args.rounds
                if way == "subprocess" and args.subprocess_rounds:
                    rounds = args.subprocess_rounds
                results.append(deployed_run(dep, way, stage, rounds))
                print(table(results[-1:]), flush=True)
        finally:
            left = dep.stop()
            if left:
                print(f"processes left running: {left}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"logs and runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
