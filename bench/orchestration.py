"""What Flower adds to federated training on digits, per round and at start-up.

Design notes: ``docs/notes.md``, ``bench.orchestration``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.inprocess

import tasks
from lab.launcher import APP_DIR, LocalSimulation, stage_app, superlink_processes
from tasks.base import SEED, LocalTraining, local_seed
from tests.inprocess import run_config as full_config

FRACTION = 0.1
MIN_TRAIN = 2


def run_config_overrides(rounds: int) -> dict:
    """Train only: no federated or central evaluation (the plain loop has neither)."""
    return {
        "task": "digits",
        "num-server-rounds": rounds,
        "fraction-train": FRACTION,
        "min-train-nodes": MIN_TRAIN,
        "fraction-evaluate": 0.0,
        "central-eval": False,
    }


def sample_size(num_nodes: int) -> int:
    """Flower FedAvg's (and the app's) sample size: ``max(int(n·fraction), min)``."""
    return max(int(num_nodes * FRACTION), MIN_TRAIN)


def warm(values: list[float]) -> float:
    """Median of the rounds after the first."""
    return statistics.median(values[1:])


# --- plain loop ---------------------------------------------------------------------


def plain_loop(num_nodes: int, rounds: int, run_config: dict) -> dict[str, float]:
    """Seconds per warm round of the plain loop, and of its training alone."""
    task = tasks.build(run_config)
    seed = int(run_config.get(SEED.key, SEED.default))
    model = task.build_model(seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    round_s, train_s = [], []
    for server_round in range(1, rounds + 1):
        started, training = time.perf_counter(), 0.0
        sampled = rng.choice(num_nodes, size=sample_size(num_nodes), replace=False)
        updates, weights = [], []
        for pid in sorted(sampled):
            partition = task.load_partition(int(pid), num_nodes)
            model.load_state_dict(global_state)
            local = LocalTraining(server_round, local_seed(seed, server_round, int(pid)))
            t0 = time.perf_counter()
            metrics = task.train(model, partition, local)
            training += time.perf_counter() - t0
            updates.append(
                {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
            )
            weights.append(float(metrics["num-examples"]))
        total = sum(weights)
        global_state = {
            k: torch.from_numpy(
                sum(w * u[k] for w, u in zip(weights, updates, strict=True)) / total
            ).to(global_state[k].dtype)
            for k in global_state
        }
        round_s.append(time.perf_counter() - started)
        train_s.append(training)
    return {"round": warm(round_s), "train": warm(train_s)}


# --- the app in one process -----------------------------------------------------------


@dataclass
class Timers:
    """Seconds spent per label, per round."""

    totals: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    current: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextmanager
    def timing(self, label: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.current[label] += time.perf_counter() - t0

    def wrap(self, owner, name: str, label: str) -> Callable[[], None]:
        """Time every call of ``owner.name`` under ``label``; return the undo."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            with self.timing(label):
                return original(*args, **kwargs)

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def end_round(self, labels: list[str]) -> None:
        for label in labels:
            self.totals[label].append(self.current.pop(label, 0.0))
        self.current.clear()


def _wire(message, timers: Timers):
    """``message`` serialised to protobuf bytes and back, as it would cross the wire."""
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    with timers.timing("serialisation"):
        data = message_to_proto(message).SerializeToString()
        proto = ProtoMessage()
        proto.ParseFromString(data)
        return message_from_proto(proto)


CLIENT_LABELS = ["task set-up", "training", "reply (weights to ArrayRecord)", "client state"]
TIMED = [*CLIENT_LABELS, "serialisation", "server (results files)"]
REST = "server (sampling, aggregation, the rest)"


def in_process(num_nodes: int, rounds: int, run_config: dict, out: Path) -> dict[str, float]:
    """The real ServerApp and ClientApp in one process; seconds per warm round by part."""
    from flwr.supercore.task_identity import TaskIdentity

    from client_app import node, state
    from server_app import app as server_module
    from tests.inprocess import InProcessGrid, run_server

    # What Flower's runtime sets for a ServerApp (messages need a run id).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    config = {**run_config, "output-dir": str(out)}
    grid = InProcessGrid(config, list(range(1, num_nodes + 1)))
    timers = Timers()
    task = tasks.build(config)
    undo = [
        timers.wrap(node, "prepare", "task set-up"),
        timers.wrap(type(task), "train", "training"),
        timers.wrap(node, "reply", "reply (weights to ArrayRecord)"),
        timers.wrap(state, "save", "client state"),
    ]
    send = grid.send_and_receive

    def send_over_wire(messages, *, timeout=None):
        replies = send([_wire(m, timers) for m in messages], timeout=timeout)
        return [_wire(r, timers) for r in replies]

    grid.send_and_receive = send_over_wire
    original_run_rounds = server_module.run_rounds
    round_s: list[float] = []

    def run_rounds(strategy, grid, initial, **kwargs):
        on_round = kwargs.pop("on_round")

        def timed_on_round(result):
            with timers.timing("server (results files)"):
                on_round(result)
            if result.server_round > 0:
                round_s.append(time.perf_counter() - timers.round_started)
                timers.end_round(TIMED)
                timers.round_started = time.perf_counter()

        timers.round_started = time.perf_counter()
        return original_run_rounds(strategy, grid, initial, on_round=timed_on_round, **kwargs)

    server_module.run_rounds = run_rounds
    try:
        run_server(config, grid)
    finally:
        server_module.run_rounds = original_run_rounds
        for restore in undo:
            restore()
    result = {label: warm(timers.totals[label]) for label in TIMED}
    result["round"] = warm(round_s)
    result[REST] = result["round"] - sum(result[label] for label in TIMED)
    return result


# --- flwr run ---------------------------------------------------------------------------


class PeakRSS:
    """Peak resident memory of the local SuperLink's process, of the ServerApp's process
    and of each ClientApp process under it, sampled every ``interval`` seconds in a
    thread."""

    def __init__(self, home: Path, interval: float = 0.1) -> None:
        self.home, self.interval = home, interval
        self.peak: dict[tuple[int, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for link in superlink_processes(self.home):
                try:
                    children = link.children(recursive=True)
                    rss = link.memory_info().rss
                except psutil.Error:
                    continue
                key = (link.pid, "superlink")
                self.peak[key] = max(self.peak.get(key, 0), rss)
                for proc in children:
                    try:
                        cmd = " ".join(proc.cmdline())
                        rss = proc.memory_info().rss
                    except psutil.Error:
                        continue
                    kind = (
                        "clientapp"
                        if "ClientAppActor" in cmd
                        else "serverapp"
                        if "flwr-simulation" in cmd
                        else None
                    )
                    if kind:
                        key = (proc.pid, kind)
                        self.peak[key] = max(self.peak.get(key, 0), rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def max_mib(self, kind: str) -> float:
        values = [rss for (_, k), rss in self.peak.items() if k == kind]
        return max(values) / 2**20 if values else float("nan")


def flwr_runs(num_nodes: int, rounds: int, repeats: int, overrides: dict, out: Path) -> dict:
    """Medians over ``repeats`` ``flwr run``s (after one warm-up run that also starts
    the SuperLink)."""
    run_config = " ".join(
        f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}"
        for k, v in overrides.items()
    )
    parts: dict[str, list[float]] = defaultdict(list)
    with LocalSimulation(num_nodes) as sim:
        first = sim.run(f"num-server-rounds=1 output-dir='{out}/warmup'")
        if first.returncode != 0:
            raise SystemExit(first.output)
        parts["first run, SuperLink start-up too (s)"].append(first.seconds)
        for i in range(repeats):
            launched = time.time()
            with PeakRSS(sim.home) as memory:
                result = sim.run(f"{run_config} output-dir='{out}/n{num_nodes}-{i}'")
            if result.returncode != 0 or result.run_dir is None:
                raise SystemExit(result.output)
            doc = json.loads((result.run_dir / "config.json").read_text())
            started = datetime.fromisoformat(doc["started-at"]).timestamp()
            train = pd.read_csv(result.run_dir / "metrics.csv").query("scope == 'train'")
            elapsed = train["elapsed-s"].to_numpy()
            first_round = float(train["round-seconds"].iloc[0])
            round1_start = started + elapsed[0] - first_round
            warm_round = float(np.median(np.diff(elapsed)))
            parts["wall (s)"].append(result.seconds)
            parts["start-up to round 1 (s)"].append(round1_start - launched)
            parts["round 1 extra: ClientApp processes start (s)"].append(first_round - warm_round)
            parts["warm round"].append(warm_round)
            ended = launched + result.seconds
            parts["after the last round (s)"].append(ended - (started + elapsed[-1]))
            parts["peak RSS ServerApp process (MiB)"].append(memory.max_mib("serverapp"))
            parts["peak RSS one ClientApp process (MiB)"].append(memory.max_mib("clientapp"))
            print(
                f"  flwr run #{i}: {result.seconds:.1f} s, warm round {warm_round * 1e3:.0f} ms",
                flush=True,
            )
    return {k: statistics.median(v) for k, v in parts.items()}


def fab_build_seconds(repeats: int) -> tuple[float, float]:
    """Median seconds to build the FAB from this checkout: Flower's builder on the
    checkout itself, and staging (:func:`lab.launcher.stage_app`) plus the builder
    on the staged copy."""
    from flwr.cli.build import build_fab_from_disk

    direct, staged = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fab = build_fab_from_disk(APP_DIR)
        direct.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            stage_app(APP_DIR, Path(tmp))
            same = build_fab_from_disk(Path(tmp))
            staged.append(time.perf_counter() - t0)
        if len(fab) != len(same):
            raise SystemExit("the staged app builds another FAB")
    return statistics.median(direct), statistics.median(staged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100, 1000])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-flwr", action="store_true", help="plain and in-process only")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each ClientApp process under Ray (OMP_NUM_THREADS=1)
    overrides = run_config_overrides(args.rounds)
    print(f"{psutil.cpu_count()} CPUs, torch {torch.__version__}, {args.rounds} rounds")
    direct, staged = fab_build_seconds(args.repeats)
    venv = "with" if (APP_DIR / ".venv").is_dir() else "without"
    print(
        f"FAB build ({venv} .venv in the checkout): Flower {direct:.2f} s, staged {staged:.2f} s"
    )
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for n in args.clients:
            config = full_config(**overrides, **{"min-available-nodes": n, "round-timeout": 600.0})
            plain = [plain_loop(n, args.rounds, config) for _ in range(args.repeats)]
            inproc = [
                in_process(n, args.rounds, config, out / f"inproc-{n}-{i}")
                for i in range(args.repeats)
            ]
            row = {
                "N": n,
                "sampled": sample_size(n),
                **{f"plain {k}": statistics.median(p[k] for p in plain) for k in plain[0]},
                **{f"in-process {k}": statistics.median(p[k] for p in inproc) for k in inproc[0]},
            }
            print(f"N={n}: plain {row['plain round'] * 1e3:.1f} ms/round", flush=True)
            if not args.skip_flwr:
                row |= {
                    f"flwr {k}": v
                    for k, v in flwr_runs(n, args.rounds, args.repeats, overrides, out).items()
                }
            table.append(row)
    print_table(table)


def print_table(table: list[dict]) -> None:
    """One markdown column per N; seconds shown as ms, ratios to the plain loop added."""
    for row in table:
        for prefix in ("in-process", "flwr"):
            if f"{prefix} round" in row:
                row[f"{prefix} round / plain round"] = row[f"{prefix} round"] / row["plain round"]
    if "flwr warm round" in table[0]:
        for row in table:
            row["flwr warm round / plain round"] = row["flwr warm round"] / row["plain round"]
            row["flwr warm round / plain training"] = row["flwr warm round"] / row["plain train"]
    print("\n| | " + " | ".join(f"N = {row['N']}" for row in table) + " |")
    print("| --- |" + " ---: |" * len(table))
    for key in table[0]:
        if key == "N":
            continue
        cells = []
        for row in table:
            value = row[key]
            if "(s)" in key:
                cells.append(f"{value:.2f} s")
            elif "MiB" in key:
                cells.append(f"{value:.0f}")
            elif " / " in key or key == "sampled":
                cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
            else:
                cells.append(f"{value * 1e3:.1f} ms")
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
