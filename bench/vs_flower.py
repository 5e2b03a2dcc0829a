"""This app against bare Flower on the peer workload, on one SuperLink, interleaved.

The peer is ``bench/peers/flower_digits`` (Flower 1.41's FedAvg, Message API, no
extras). Both apps run the shared peer workload: digits, the MLP
64-64-10, IID ``array_split`` partitions, local SGD lr 0.1 / batch 16 / one epoch, 30
rounds, no federated or central evaluation; N = 100 with 10 clients per round and
N = 1000 with 50. Our app keeps its default per-round outputs on (checkpoint,
``metrics.csv`` and participation rows, TensorBoard).

    python bench/vs_flower.py --clients 100 1000 --pairs 3 --rounds 30
    python bench/vs_flower.py orchestration --clients 10 50 100 1000 --rounds 6 --repeats 5

``orchestration``: what Flower adds per round and at start-up, against the same training
in a plain loop and the app in one process. Design notes: ``docs/notes.md``,
``bench.vs_flower`` and ``bench.vs_flower orchestration``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
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
from peer_digits import COHORT
from peer_digits import WORKLOAD as PEER_WORKLOAD

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.inprocess

import tasks
from lab.launcher import (
    APP_DIR,
    LocalSimulation,
    RunOutcome,
    stage_app,
    superlink_processes,
)
from tasks.base import SEED, LocalTraining, local_seed
from tests.inprocess import run_config as full_config

PEER = Path(__file__).resolve().parent / "peers" / "flower_digits"
_PEER_RESULT = re.compile(r"BENCH_RESULT (\{.*\})")
# The peer workload as bench/peer_digits.py runs it, without central evaluation (the
# peer evaluates only after the last round, outside its round timing).
WORKLOAD = {
    **{k: v for k, v in PEER_WORKLOAD.items() if k not in ("num-server-rounds", "round-timeout")},
    "central-eval": False,
}


# Ours on the finance task (``--task finance``): every client holds this many rows.
FINANCE_ROWS_PER_CLIENT = 25
FINANCE_CENTRAL_TEST_FRACTION = 0.2  # the task's default share held out for the server
TASKS = ("digits", "finance")


def finance_workload(num_nodes: int) -> dict:
    """The finance task sized for ``num_nodes`` clients of FINANCE_ROWS_PER_CLIENT rows."""
    pool = FINANCE_ROWS_PER_CLIENT * num_nodes
    rows = math.ceil(pool / (1 - FINANCE_CENTRAL_TEST_FRACTION))
    return {
        "task": "finance",
        "finance.partitioning": "iid",
        "finance.synthetic-rows": max(20_000, rows),
        "finance.central-test-fraction": FINANCE_CENTRAL_TEST_FRACTION,
        "finance.local-epochs": 1,
        "fraction-evaluate": 0.0,
        "central-eval": False,
    }


def cohort(num_nodes: int) -> int:
    """Clients per round: the peer README's 10 of 100 and 50 of 1000, else 10 %."""
    return COHORT.get(num_nodes, max(2, num_nodes // 10))


def _flat(config: dict) -> str:
    return " ".join(
        f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}" for k, v in config.items()
    )


def ours_config(num_nodes: int, rounds: int, out: Path, task: str = "digits") -> str:
    m = cohort(num_nodes)
    return _flat(
        {
            **(WORKLOAD if task == "digits" else finance_workload(num_nodes)),
            "num-server-rounds": rounds,
            "fraction-train": m / num_nodes,
            "min-train-nodes": m,
            "min-available-nodes": num_nodes,
            "output-dir": str(out),
        }
    )


def peer_config(num_nodes: int, rounds: int) -> str:
    return _flat(
        {
            "num-supernodes": num_nodes,
            "fraction-train": cohort(num_nodes) / num_nodes,
            "num-server-rounds": rounds,
        }
    )


def _check(result: RunOutcome, what: str) -> None:
    if result.returncode != 0:
        raise SystemExit(f"{what} failed:\n{result.output[-4000:]}")


def federation(num_nodes: int, cpus: float) -> str:
    """The ``--federation-config`` of a run: the size and the CPUs per ClientApp (which a
    run that names only the size would lose: see the module docstring)."""
    return f"num-supernodes={num_nodes} client-resources-num-cpus={cpus:g}"


def run_peer(
    sim: LocalSimulation,
    peer: Path,
    num_nodes: int,
    rounds: int,
    timeout: float = 3600,
    cpus: float = 1,
) -> dict:
    with PeakRSS(sim.home) as memory:
        result = sim.run(
            peer_config(num_nodes, rounds),
            federation_config=federation(num_nodes, cpus),
            app=peer,
            timeout=timeout,
        )
    _check(result, "bare Flower")
    found = _PEER_RESULT.findall(result.output)
    if not found:
        raise SystemExit(f"bare Flower printed no BENCH_RESULT:\n{result.output[-4000:]}")
    summary = json.loads(found[-1])
    return {
        "warm round (s)": summary["warm_round_median_s"],
        "warm round, mean (s)": float(pd.Series(summary["round_s"][1:]).mean()),
        "round 1 (s)": summary["round1_s"],
        "whole run (s)": result.seconds,
        "peak RSS ServerApp (MiB)": memory.max_mib("serverapp"),
        "peak RSS ClientApp (MiB)": memory.max_mib("clientapp"),
        "peak RSS SuperLink (MiB)": memory.max_mib("superlink"),
        "accuracy": summary.get("accuracy"),
    }


def run_ours(
    sim: LocalSimulation,
    num_nodes: int,
    rounds: int,
    out: Path,
    timeout: float = 3600,
    cpus: float = 1,
    task: str = "digits",
) -> dict:
    launched = time.time()
    with PeakRSS(sim.home) as memory:
        result = sim.run(
            ours_config(num_nodes, rounds, out, task),
            federation_config=federation(num_nodes, cpus),
            timeout=timeout,
        )
    _check(result, "this app")
    if result.run_dir is None:
        raise SystemExit(f"this app printed no run directory:\n{result.output[-4000:]}")
    train = pd.read_csv(result.run_dir / "metrics.csv").query("scope == 'train'")
    elapsed = train["elapsed-s"].to_numpy()
    doc = json.loads((result.run_dir / "config.json").read_text())
    started = datetime.fromisoformat(doc["started-at"]).timestamp()  # the run directory
    round1_start = started + elapsed[0] - float(train["round-seconds"].iloc[0])
    return {
        "start-up to round 1 (s)": round1_start - launched,
        "warm round (s)": float(pd.Series(elapsed).diff().iloc[1:].median()),
        "warm round, mean (s)": float(pd.Series(elapsed).diff().iloc[1:].mean()),
        "round 1 (s)": float(train["round-seconds"].iloc[0]),
        "whole run (s)": result.seconds,
        "peak RSS ServerApp (MiB)": memory.max_mib("serverapp"),
        "peak RSS ClientApp (MiB)": memory.max_mib("clientapp"),
        "peak RSS SuperLink (MiB)": memory.max_mib("superlink"),
        "accuracy": None,
    }


def compare(
    num_nodes: int,
    pairs: int,
    rounds: int,
    out: Path,
    peer: Path | None,
    timeout: float,
    cpus: float = 1,
    task: str = "digits",
) -> list[dict]:
    """``pairs`` interleaved pairs at ``num_nodes``: one row per run (``peer`` None:
    this app only; ``task``: our app's workload, the peer's is always digits)."""
    rows = []
    with LocalSimulation(num_nodes) as sim:
        # warm-up, not counted (10 nodes): the SuperLink starts, the FABs are installed
        small = federation(10, cpus)
        warmup = ours_config(10, 1, out / "warmup", task)
        _check(sim.run(warmup, federation_config=small), "warm-up")
        if peer is not None:
            _check(sim.run(peer_config(10, 1), federation_config=small, app=peer), "warm-up")
        for pair in range(pairs):
            order = ["peer", "ours"] if pair % 2 == 0 else ["ours", "peer"]
            for who in order if peer is not None else ["ours"]:
                started = time.monotonic()
                try:
                    if who == "peer":
                        row = run_peer(sim, peer, num_nodes, rounds, timeout, cpus)
                    else:
                        path = out / f"n{num_nodes}-{pair}"
                        row = run_ours(sim, num_nodes, rounds, path, timeout, cpus, task)
                except subprocess.TimeoutExpired:
                    print(
                        f"N={num_nodes} pair {pair} {who}: no result in {timeout:g} s", flush=True
                    )
                    rows.append({"N": num_nodes, "pair": pair, "app": who, "timed out": True})
                    continue
                workload = "digits" if who == "peer" else task
                rows.append({"N": num_nodes, "pair": pair, "app": who, "task": workload, **row})
                print(
                    f"N={num_nodes} pair {pair} {who:4s}: warm round "
                    f"{row['warm round (s)'] * 1e3:.0f} ms, "
                    f"whole run {row['whole run (s)']:.1f} s "
                    f"({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    return rows


def table(rows: pd.DataFrame) -> str:
    """Markdown: per N, each metric's per-run values for both apps and the ratios."""
    ours_task = rows.loc[rows.app == "ours", "task"].iloc[0] if "task" in rows else "digits"
    lines = [
        f"| N / per round | metric | bare Flower (digits) | this app ({ours_task}) "
        "| ours / Flower |",
        "|---|---|---|---|---|",
    ]
    skip = ("N", "pair", "app", "task", "accuracy", "timed out")
    metrics = [c for c in rows.columns if c not in skip]
    for n, group in rows.groupby("N"):
        ours = group[group.app == "ours"].set_index("pair")
        peer = group[group.app == "peer"].set_index("pair")
        for metric in metrics:
            o = ours[metric]
            p = peer[metric] if not peer.empty else None
            fmt = (lambda v: f"{v:.3f}") if "round" in metric else (lambda v: f"{v:.1f}")
            cells = [" / ".join(fmt(v) for v in p) if p is not None else "–"]
            cells.append(" / ".join(fmt(v) for v in o))
            if p is not None:
                ratio = (o / p).dropna()
                cells.append(
                    f"{statistics.median(ratio):.2f} ({ratio.min():.2f}–{ratio.max():.2f})"
                    if len(ratio)
                    else "–"
                )
            else:
                cells.append("–")
            lines.append(f"| {n} / {cohort(n)} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pairs_main(argv: list[str] | None = None) -> None:
    """This app and bare Flower on one SuperLink, interleaved, per N."""
    parser = argparse.ArgumentParser(
        prog="vs_flower.py",
        description=__doc__.split("\n\n")[0],
        epilog="other command: orchestration (Flower against a plain loop; --help)",
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="digits",
        help="our app's workload: the peer's digits, or finance (IID, "
        f"{FINANCE_ROWS_PER_CLIENT} rows per client) to scale past digits' 1 437 examples; "
        "the peer always runs digits",
    )
    parser.add_argument(
        "--peer-up-to",
        type=int,
        default=10_000,
        help="run bare Flower only at N up to this (it is the slower part of a sweep)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/vs-flower"))
    parser.add_argument(
        "--run-timeout", type=float, default=3600, help="seconds one flwr run may take"
    )
    parser.add_argument(
        "--peer", type=Path, default=PEER, help="the bare-Flower app (bench/peers/flower_digits)"
    )
    parser.add_argument(
        "--num-cpus",
        type=float,
        default=1,
        help="CPUs per ClientApp for both apps (1: two ClientApps at once on 2 cores)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    rows = []
    for n in args.clients:
        peer = args.peer if n <= args.peer_up_to else None
        rows += compare(
            n, args.pairs, args.rounds, out, peer, args.run_timeout, args.num_cpus, args.task
        )
        frame = pd.DataFrame(rows)
        frame.to_csv(out / "results.csv", index=False)
    text = table(frame)
    (out / "results.md").write_text(text + "\n")
    print(text)


# === orchestration: Flower against the same training in a plain loop ================

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


def orchestration_main(argv: list[str] | None = None) -> None:
    """Flower's per-round and start-up cost against a plain loop and one process."""
    parser = argparse.ArgumentParser(
        prog="vs_flower.py orchestration",
        description="What Flower adds to federated training on digits, per round and at "
        "start-up: a plain loop, the app in one process, and flwr run.",
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100, 1000])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-flwr", action="store_true", help="plain and in-process only")
    args = parser.parse_args(argv)
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


def main(argv: list[str] | None = None) -> None:
    """``orchestration`` with its arguments, else the pairs against bare Flower."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "orchestration":
        orchestration_main(args[1:])
    else:
        pairs_main(args)


if __name__ == "__main__":
    main()
