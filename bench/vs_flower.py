"""This app against bare Flower on the peer workload, on one SuperLink, interleaved.

The peer is ``bench/peers/flower_digits`` (Flower 1.41's FedAvg, Message API, no
extras). Both apps run the shared peer workload: digits, the MLP
64-64-10, IID ``array_split`` partitions, local SGD lr 0.1 / batch 16 / one epoch, 30
rounds, no federated or central evaluation; N = 100 with 10 clients per round and
N = 1000 with 50. Our app keeps its default per-round outputs on (checkpoint,
``metrics.csv`` and participation rows, TensorBoard).

Design notes: ``docs/notes.md``, ``bench.vs_flower``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
from orchestration import PeakRSS
from peer_digits import COHORT
from peer_digits import WORKLOAD as PEER_WORKLOAD

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.launcher import LocalSimulation, RunOutcome

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
