"""Cost of a SecAgg+ round on the Message API against the same round without it, and
of distributed DP against central DP at the same ε.

    PYTHONPATH=. python bench/secagg.py                    # both sections, ~12 min
    PYTHONPATH=. python bench/secagg.py --quick            # a smoke check, < 1 min
    PYTHONPATH=. python bench/secagg.py --sections protocol --dims 1e5 1e6 --clients 10 50
    PYTHONPATH=. python bench/secagg.py --sections cifar --cifar-examples 500 --repeats 3
    PYTHONPATH=. python bench/secagg.py distributed-dp --seeds 0 1 2 3 \\
        --presets experiments/digits-dp-eps8.toml experiments/digits-secagg-dp-eps8.toml

``distributed-dp`` runs each preset whole, in process (accuracy, ε, z, seconds). The
BENCHMARKS.md tables ran the two sections separately, each started when the 1-min load
average was below 0.35. Design notes: ``docs/notes.md``, ``bench.secagg``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.config import flatten_dict, fuse_dicts
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity
from timing import machine_info  # bench/timing.py (scripts here run with bench/ on sys.path)

from client_app.secagg_mod import secagg_mod
from protocol import keys
from protocol.masking import mask
from strategies.runtime.messaging import send_and_receive
from strategies.secure.secagg_plus import SecAggSettings
from strategies.secure.secure_aggregation import SecureAggregation
from tasks.vision.models import build_model
from tasks.vision.steps import train_batch

STAGES = (
    ("setup", Stage.SETUP),
    ("share", Stage.SHARE_KEYS),
    ("collect", Stage.COLLECT_MASKED_VECTORS),
    ("unmask", Stage.UNMASK),
)
FIRST_NODE = 1001  # node ids 1001.. (1 is the SuperLink's)
DISTINCT_UPDATES, UPDATE_STD, NUM_EXAMPLES = 4, 0.05, 100
LR, MOMENTUM, BATCH = 0.05, 0.9, 32
GOAL_RATIO = 3.0


# -- helpers ----------------------------------------------------------------------
def markdown(rows: list[dict[str, object]]) -> str:
    """``rows`` as a markdown table (floats to 3 significant digits)."""
    keys_ = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(k, "")) for k in keys_] for r in rows]
    lines = ["| " + " | ".join(keys_) + " |", "|" + " ---: |" * len(keys_)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def _cell(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def graph(n: int, rule: str) -> tuple[SecAggSettings, str]:
    """The settings for n clients under ``--shares`` and a label "k/t (kind)"."""
    if rule == "complete" or (rule == "rule" and n < 50):
        settings = SecAggSettings()  # num_shares 1.0, threshold 0.67 (the app's defaults)
        kind = "SecAgg"
    else:
        k = min(2 * math.ceil(math.log2(n)) + 1, n if n % 2 else n - 1)
        settings = SecAggSettings(num_shares=k, reconstruction_threshold=(k + 1) // 2)
        kind = "SecAgg+"
    k, t = settings.shares_and_threshold(n)
    return settings, f"{k}/{t} ({kind})"


def upload_bytes(replies: list[Message]) -> int:
    """Wire size of the replies' contents (protobuf)."""
    return sum(recorddict_to_proto(r.content).ByteSize() for r in replies)


class InProcessGrid:
    """n nodes answering in this process, one after another: with ``secagg_mod`` around
    ``train`` (SecAgg stages) or ``train`` alone (plain train messages). Every call is
    timed by stage; the trainer's own time is kept apart."""

    def __init__(self, n: int, train: Callable[[Message], Message]) -> None:
        self.nodes = list(range(FIRST_NODE, FIRST_NODE + n))
        self.train = train
        self.reset()

    def reset(self) -> None:
        self.contexts = {
            node: Context(
                run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}
            )
            for node in self.nodes
        }
        self.client_s: dict[str, float] = defaultdict(float)
        self.train_s = 0.0
        self.replies: dict[str, list[Message]] = defaultdict(list)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        del timeout  # every node answers
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            records = message.content.config_records
            start = time.perf_counter()
            if RECORD_KEY_CONFIGS in records:
                stage = str(records[RECORD_KEY_CONFIGS][Key.STAGE])
                reply = secagg_mod(message, self.contexts[node], self._train)
            else:
                stage = "train"
                reply = self._train(message, self.contexts[node])
            self.client_s[stage] += time.perf_counter() - start
            if reply.has_error():
                raise RuntimeError(f"node {node}, {stage}: {reply.error.reason}")
            self.replies[stage].append(reply)
            replies.append(reply)
        return replies

    def _train(self, msg: Message, _ctxt: Context) -> Message:
        start = time.perf_counter()
        reply = self.train(msg)
        self.train_s += time.perf_counter() - start
        return reply


def train_reply(msg: Message, arrays: ArrayRecord, examples: int) -> Message:
    metrics = MetricRecord({keys.NUM_EXAMPLES: examples})
    return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


def fedavg(n: int) -> FedAvg:
    return FedAvg(fraction_train=1.0, min_train_nodes=n, min_available_nodes=n)


def plain_round(grid: InProcessGrid, reference: ArrayRecord) -> tuple[dict, ArrayRecord]:
    """One round without SecAgg (see the docstring)."""
    grid.reset()
    n = len(grid.nodes)
    start = time.perf_counter()
    strategy = fedavg(n)
    messages = list(strategy.configure_train(1, reference, ConfigRecord(), grid))
    replies = send_and_receive(grid, messages, timeout=None)
    aggregate_start = time.perf_counter()
    arrays, _ = strategy.aggregate_train(1, replies)
    end = time.perf_counter()
    assert arrays is not None and len(replies) == n
    return {
        "round": end - start,
        "aggregate": end - aggregate_start,
        "train": grid.train_s,
        "up": upload_bytes(grid.replies["train"]) / n,
    }, arrays


def secure_round(
    grid: InProcessGrid, reference: ArrayRecord, settings: SecAggSettings
) -> tuple[dict, ArrayRecord]:
    """One round of the app's SecAgg (see the docstring)."""
    grid.reset()
    n = len(grid.nodes)
    start = time.perf_counter()
    wrapper = SecureAggregation(fedavg(n), settings)
    messages = wrapper.configure_train(1, reference, ConfigRecord(), grid)
    replies = wrapper.exchange_train(grid, messages, timeout=None)
    result = wrapper._result  # aggregate_train consumes it
    arrays, _ = wrapper.aggregate_train(1, replies)
    end = time.perf_counter()
    assert result is not None and arrays is not None and len(result.survivors) == n
    client = sum(grid.client_s.values())
    row = {
        "round": end - start,
        "server": end - start - client,
        "server-unmask": result.seconds.get("server-unmask", 0.0),
        "train": grid.train_s,
        "up": sum(upload_bytes(grid.replies[stage]) for _, stage in STAGES) / n,
    }
    for name, stage in STAGES:
        row[name] = grid.client_s[stage] / n
    row["collect"] -= grid.train_s / n
    return row, arrays


def max_difference(a: ArrayRecord, b: ArrayRecord) -> float:
    return max(float(np.max(np.abs(a[k].numpy() - b[k].numpy()))) for k in a)


def timed_rounds(
    grid: InProcessGrid,
    reference: ArrayRecord,
    settings: SecAggSettings,
    repeats: int,
    once_above_s: float,
) -> tuple[dict, dict, float]:
    """Medians of plain and SecAgg rounds, alternating; the aggregates' difference."""
    plains, secures, check = [], [], 0.0
    for repeat in range(repeats):
        plain, plain_arrays = plain_round(grid, reference)
        plains.append(plain)
        secure, secure_arrays = secure_round(grid, reference, settings)
        secures.append(secure)
        check = max(check, max_difference(plain_arrays, secure_arrays))
        del plain_arrays, secure_arrays
        grid.reset()
        gc.collect()
        if repeat == 0 and secure["round"] > once_above_s:
            break
    return medians(plains), medians(secures), check


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


# -- section "protocol" ------------------------------------------------------------
def mask_seconds_per_value() -> float:
    """τ: seconds per value of one AES-CTR mask expansion (median of 3, 10⁶ values)."""
    times = []
    for i in range(4):
        start = time.perf_counter()
        mask(bytes([i]) * 32, 10**6, 2**32)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / 1e6


def estimate(n: int, d: int, settings: SecAggSettings, tau: float) -> tuple[float, float]:
    """(seconds, GB) estimated for one SecAgg round (see the docstring)."""
    k, _ = settings.shares_and_threshold(n)
    return n * (k + 4) * d * tau, d * (4 * n + 16 + 100) / 1e9


def protocol_cell(n: int, d: int, settings: SecAggSettings, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(d + n)
    updates = [
        rng.normal(0.0, UPDATE_STD, d).astype(np.float32) for _ in range(min(n, DISTINCT_UPDATES))
    ]
    reference = ArrayRecord({"w": Array(np.zeros(d, dtype=np.float32))})
    position = {}

    def train(msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        update = updates[position.setdefault(node, len(position)) % len(updates)]
        return train_reply(msg, ArrayRecord({"w": Array(update)}), NUM_EXAMPLES)

    grid = InProcessGrid(n, train)
    plain, secure, check = timed_rounds(grid, reference, settings, args.repeats, args.once_above_s)
    return {
        "plain s": plain["round"],
        "secagg s": secure["round"],
        "ratio": secure["round"] / plain["round"],
        **{f"{name} s/client": secure[name] for name, _ in STAGES},
        "server s": secure["server"],
        "unmask s": secure["server-unmask"],
        "plain agg s": plain["aggregate"],
        "up MB plain": plain["up"] / 1e6,
        "up MB secagg": secure["up"] / 1e6,
        "trips": "4 vs 1",
        "check": check,
    }


def section_protocol(args: argparse.Namespace) -> None:
    tau = mask_seconds_per_value()
    print(
        f"\n## Protocol cost (trivial trainer; mask expansion τ = {tau * 1e9:.1f} ns per value, "
        f"at most {args.repeats} rounds of each kind per cell)\n"
    )
    rows, fit = [], defaultdict(list)
    for n in (int(c) for c in args.clients):
        settings, label = graph(n, args.shares)
        for d in (int(x) for x in args.dims):
            row: dict[str, object] = {"n": n, "d": f"{d:.0e}", "k/t": label}
            seconds, gb = estimate(n, d, settings, tau)
            if seconds > args.max_round_s or gb > args.max_gb:
                reason = f"estimated {seconds:.0f} s, {gb:.1f} GB"
                limit = f"> {args.max_round_s:g} s" if seconds > args.max_round_s else ""
                limit += f" > {args.max_gb:g} GB" if gb > args.max_gb else ""
                rows.append(row | {"plain s": f"not run ({reason} {limit.strip()})"})
                print(f"  n={n} d={d:.0e}: not run ({reason})", file=sys.stderr, flush=True)
                continue
            start = time.perf_counter()
            row |= protocol_cell(n, d, settings, args)
            rows.append(row)
            fit[n].append((d, row["secagg s"]))
            print(
                f"  n={n} d={d:.0e}: secagg {row['secagg s']:.2f} s (estimated {seconds:.1f} s), "
                f"cell {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            gc.collect()
    print(markdown(rows))
    if fit:
        n = min(fit)
        print("\n" + slope_line(n, fit[n]))


def slope_line(n: int, points: list[tuple[int, float]]) -> str:
    """The log-log least-squares slope of SecAgg round time vs d (all d, and d >= 1e5)."""
    if len(points) < 2:
        return f"n = {n}: fewer than two d run, no slope"
    d, s = (np.log10(np.array(v, dtype=float)) for v in zip(*points, strict=True))
    text = f"n = {n}: log-log slope of the SecAgg round time vs d = {np.polyfit(d, s, 1)[0]:.2f}"
    text += f" (d = {10 ** d.min():.0e}..{10 ** d.max():.0e})"
    large = d >= 5 - 1e-9
    if large.sum() >= 2 and large.sum() < len(d):
        text += f", {np.polyfit(d[large], s[large], 1)[0]:.2f} over d >= 1e5"
    return text


# -- section "cifar" ---------------------------------------------------------------
def section_cifar(args: argparse.Namespace) -> None:
    n, examples = args.cifar_clients, args.cifar_examples
    settings, label = graph(n, args.shares)
    model = build_model("cnn", 3, 10, 32, seed=0)
    reference = ArrayRecord(model.state_dict())
    d = sum(v.numel() for v in model.state_dict().values())
    gen = torch.Generator().manual_seed(0)
    data = {
        FIRST_NODE + i: (
            torch.randn(examples, 3, 32, 32, generator=gen),
            torch.randint(0, 10, (examples,), generator=gen),
        )
        for i in range(n)
    }

    def train(msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        x, y = data[node]
        torch.manual_seed(node)  # the same batches (and dropout) in both kinds of round
        model.load_state_dict(msg.content[keys.ARRAYS].to_torch_state_dict(), strict=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        model.train()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(node))
        for start in range(0, len(x), BATCH):
            batch = order[start : start + BATCH]
            train_batch(model, x[batch], y[batch], optimizer, [], 0.0)
        return train_reply(msg, ArrayRecord(model.state_dict()), len(x))

    grid = InProcessGrid(n, train)
    train(
        Message(RecordDict({keys.ARRAYS: reference}), dst_node_id=FIRST_NODE, message_type="train")
    )
    plain, secure, check = timed_rounds(grid, reference, settings, args.repeats, args.once_above_s)
    ratio = secure["round"] / plain["round"]
    print(
        f"\n## CIFAR-10 CNN (d = {d:,}), {n} clients x {examples} random 3x32x32 examples, one "
        f"local epoch ({math.ceil(examples / BATCH)} SGD steps of {BATCH}); median of "
        f"{args.repeats} rounds of each kind\n"
    )
    row = {
        "n": n,
        "d": d,
        "k/t": label,
        "plain s": plain["round"],
        "plain train s": plain["train"],
        "secagg s": secure["round"],
        "secagg train s": secure["train"],
        "ratio": ratio,
        **{f"{name} s/client": secure[name] for name, _ in STAGES},
        "server s": secure["server"],
        "up MB plain": plain["up"] / 1e6,
        "up MB secagg": secure["up"] / 1e6,
        "check": check,
        f"goal <= {GOAL_RATIO:g}x": "yes" if ratio <= GOAL_RATIO else "NO",
    }
    print(markdown([row]))


def protocol_main(argv: list[str] | None = None) -> None:
    """A SecAgg+ round's cost against the same round without it (protocol, CIFAR-10)."""
    parser = argparse.ArgumentParser(
        prog="secagg.py",
        description=__doc__.splitlines()[0],
        epilog="other command: distributed-dp (central against distributed DP; --help)",
    )
    parser.add_argument("--dims", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument(
        "--shares",
        choices=("rule", "complete", "ring"),
        default="rule",
        help="rule: SecAgg (complete graph) for n < 50, SecAgg+ ring k = 2 ceil(log2 n) + 1 above",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each kind per cell")
    parser.add_argument(
        "--once-above-s", type=float, default=20.0, help="one round per kind above this many s"
    )
    parser.add_argument("--max-round-s", type=float, default=180.0, help="skip cells above")
    parser.add_argument("--max-gb", type=float, default=12.0, help="skip cells above")
    parser.add_argument("--cifar-clients", type=int, default=10)
    parser.add_argument("--cifar-examples", type=int, default=500, help="per client")
    parser.add_argument(
        "--sections", nargs="+", choices=("protocol", "cifar"), default=["protocol", "cifar"]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: d 1e4 1e5, n 10 50, 64 examples, 1 repeat",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.dims, args.clients, args.cifar_examples, args.repeats = [1e4, 1e5], [10, 50], 64, 1
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    logging.getLogger("flwr").setLevel(logging.WARNING)  # secure_sum's per-round INFO line
    print(
        "# SecAgg+ benchmark\n\n"
        + machine_info(
            "cryptography",
            "clients run one after another in this process",
            "load average (1, 5, 15 min) at start: "
            + ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        )
    )
    if "protocol" in args.sections:
        section_protocol(args)
    if "cifar" in args.sections:
        section_cifar(args)
    print(
        "\nload average (1, 5, 15 min) at the end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    )


# -- distributed-dp: central against distributed DP, whole runs --------------------

REPO = Path(__file__).resolve().parents[1]


def distributed_run(preset: Path, nodes: int, seed: int, out: Path, **extra) -> dict:
    """One run of ``preset``: its final central accuracy, ε, z and wall time."""
    defaults = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    config = fuse_dicts(defaults["config"], flatten_dict(tomllib.loads(preset.read_text())))
    config.update({"output-dir": str(out), "seed": seed, "min-available-nodes": nodes, **extra})
    from tests.inprocess import InProcessGrid as AppGrid  # the app's grid, not the one above
    from tests.inprocess import run_server

    grid = AppGrid(config, list(range(1000, 1000 + nodes)))
    started = time.monotonic()
    run_server(config, grid)
    seconds = time.monotonic() - started
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = pd.read_csv(run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    return {
        "preset": preset.name,
        "seed": seed,
        "accuracy": float(central["eval-accuracy"].iloc[-1]),
        "epsilon": ledger["summary"]["epsilon"],
        "z": (ledger.get("calibration") or {}).get("value"),
        "seconds": round(seconds, 1),
    }


def distributed_main(argv: list[str] | None = None) -> None:
    """Central against distributed DP at the same ε: accuracy, ε, z, seconds per run."""
    parser = argparse.ArgumentParser(
        prog="secagg.py distributed-dp",
        description="Central DP against distributed DP (SecAgg+ and Skellam) at the same ε, "
        "in process: each preset fused with pyproject.toml's defaults, run by the app's own "
        "ServerApp loop against the real ClientApp, --nodes of them.",
    )
    parser.add_argument("--presets", nargs="+", type=Path, required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=100)
    args = parser.parse_args(argv)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    rows = []
    for preset in args.presets:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as out:
                rows.append(distributed_run(preset, args.nodes, seed, Path(out)))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| preset | z | epsilon | accuracy per seed | mean |\n| --- | ---: | ---: | --- | ---: |"
    )
    for preset in args.presets:
        mine = [r for r in rows if r["preset"] == preset.name]
        accuracies = [r["accuracy"] for r in mine]
        print(
            f"| {preset.name} | {mine[0]['z'] or 0:.2f} | {max(r['epsilon'] for r in mine):.2f} "
            f"| {', '.join(f'{a:.3f}' for a in accuracies)} | {statistics.mean(accuracies):.3f} |"
        )


def main(argv: list[str] | None = None) -> None:
    """``distributed-dp`` with its arguments, else the protocol benchmark's."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "distributed-dp":
        distributed_main(args[1:])
    else:
        protocol_main(args)


if __name__ == "__main__":
    main()
