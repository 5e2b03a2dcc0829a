"""The shared peer workload in this app, beside pfl-research's numbers on this machine.

Workload, as the peers run it: scikit-learn digits, X / 16, ``array_split`` partitions
(``vision.partitioner = "array-split"``), the MLP 64-64-10, local SGD lr 0.1, no momentum,
batch 16, one epoch; 30 rounds; central test accuracy after round 30. N = 100 with 10
clients per round and N = 1000 with 50; DP at epsilon 2 and 8, delta 1e-5, client-level.

    python bench/peer_digits.py --out DIR                      # accuracy, this app
    python bench/peer_digits.py pfl --python PFL_PYTHON --out DIR   # pfl-research's
    python bench/peer_digits.py engine                         # in-process engine time
    python bench/peer_digits.py engine-vs-pfl --python PFL_PYTHON   # both, back to back
    python bench/peer_digits.py engine-vs-pfl --python PFL_PYTHON --dp adaptive \
        --sizes 1000 --rounds 1000                             # whole processes, long DP run
    python bench/peer_digits.py engine-vs-pfl --python PFL_PYTHON --clock cpu  # CPU laps
    python bench/peer_digits.py engine-vs-pfl --python PFL_PYTHON --clock cpu --repeat 3

Design notes (the split, pfl's settings): ``docs/notes.md``, ``bench.peer_digits``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.inprocess

from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from lab import comparison  # noqa: E402
from tests.inprocess import InProcessGrid, run_config, run_server  # noqa: E402

COHORT = {100: 10, 1000: 50}
# pfl-research 0.6 on this workload: adaptive clipping; its
# noise calibrated for Poisson sampling although its cohorts are fixed-size.
PFL = {
    (100, None): 0.71,
    (100, 8.0): 0.52,
    (100, 2.0): 0.41,
    (1000, None): 0.56,
    (1000, 8.0): 0.58,
    (1000, 2.0): 0.59,
}
WORKLOAD = {
    "task": "digits",
    "vision.model": "mlp",
    "vision.partitioner": "array-split",
    "vision.normalize": False,
    "vision.test-fraction": 0.0,
    "vision.batch-size": 16,
    "vision.lr": 0.1,
    "vision.momentum": 0.0,
    "vision.local-epochs": 1,
    "num-server-rounds": 30,
    "fraction-evaluate": 0.0,
    "central-eval": True,
    "round-timeout": 60.0,
}
CURVE = (1.0, 2.0, 4.0, 8.0, 16.0)


def preset(epsilon: float) -> dict:
    """The DP preset's run-config for ``epsilon`` (eps8 for epsilon >= 4, else eps2),
    with the target epsilon set to ``epsilon``."""
    name = "digits-dp-eps8.toml" if epsilon >= 4 else "digits-dp-eps2.toml"
    flat = {}
    for key, value in tomllib.loads((REPO / "experiments" / name).read_text()).items():
        if isinstance(value, dict):  # dotted keys: [dp] tables
            flat |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            flat[key] = value
    return flat | {"dp.target-epsilon": float(epsilon)}


def server_optimizer() -> dict:
    """The DP presets' server optimizer (for the non-DP row that uses it too)."""
    return {k: v for k, v in preset(8.0).items() if k.startswith("server.")}


def run_one(
    num_clients: int, epsilon: float | None, seed: int, root: Path, optimizer: bool = True
) -> dict:
    """One run of the workload; its final accuracy, printed epsilon and timing. Without
    DP, ``optimizer``: with the presets' server optimizer, else plain FedAvg."""
    cohort = COHORT.get(num_clients, max(2, num_clients // 10))
    overrides = {**WORKLOAD, "seed": seed, "output-dir": str(root)}
    overrides |= {"min-available-nodes": num_clients, "min-train-nodes": cohort}
    overrides["fraction-train"] = cohort / num_clients
    if epsilon is not None:
        overrides |= preset(epsilon) | {"dp.num-sampled-clients": cohort}
    elif optimizer:
        overrides |= server_optimizer()
    config = run_config(**overrides)
    before = set(root.iterdir()) if root.exists() else set()
    started = time.perf_counter()
    run_server(config, InProcessGrid(config, list(range(1, num_clients + 1))))
    seconds = time.perf_counter() - started
    (run_dir,) = set(root.iterdir()) - before
    metrics = pd.read_csv(run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    if central.index.max() != WORKLOAD["num-server-rounds"]:
        raise RuntimeError(f"{run_dir} stopped after round {central.index.max()}: see its log")
    label = "DP preset" if epsilon is not None else "FedAvg"
    if epsilon is None and optimizer:
        label += " + " + ", ".join(f"{k} {v}" for k, v in server_optimizer().items())
    row = {
        "configuration": label,
        "N": num_clients,
        "cohort": cohort,
        "epsilon-target": epsilon,
        "seed": seed,
        "accuracy": float(central["eval-accuracy"].iloc[-1]),
        "best-accuracy": float(central.loc[1:, "eval-accuracy"].max()),
        "rounds": int(central.index.max()),
        "seconds": round(seconds, 1),
        "run": str(run_dir),
    }
    if epsilon is not None:
        ledger = json.loads((run_dir / "ledger.json").read_text())
        row |= {
            "epsilon": ledger["summary"]["epsilon"],
            "noise-multiplier": ledger["calibration"]["value"],
            "sampling": ledger["summary"]["sampling"],
            "accountant": ledger["summary"]["accountant"],
        }
    print(json.dumps({k: v for k, v in row.items() if k != "run"}), flush=True)
    return row


def pfl_side_by_side(path: Path | None) -> dict[tuple[int, float | None], str]:
    """pfl-research's mean ± std per (N, epsilon) from the ``pfl`` command's runs.csv."""
    if path is None:
        return {}
    runs = pd.read_csv(path)
    out = {}
    for (n, eps), group in runs.groupby(["N", "epsilon"], dropna=False):
        acc = group["accuracy"]
        std = acc.std() if len(acc) > 1 else 0.0
        out[(int(n), None if pd.isna(eps) else float(eps))] = (
            f"{acc.mean():.3f} ± {std:.3f} ({len(acc)})"
        )
    return out


def summarise(rows: list[dict], pfl_runs: Path | None = None) -> pd.DataFrame:
    """Mean ± std (ddof 1) over seeds per (N, epsilon), beside pfl-research's published
    single-seed number and, with ``pfl_runs``, its mean ± std over seeds run here."""
    side_by_side = pfl_side_by_side(pfl_runs)
    frame = pd.DataFrame(rows)
    out = []
    keys = ["N", "epsilon-target", "configuration"]
    for (n, eps, label), group in frame.groupby(keys, dropna=False, sort=True):
        target = None if pd.isna(eps) else float(eps)
        acc = group["accuracy"]
        out.append(
            {
                "configuration": label,
                "N": int(n),
                "per round": int(group["cohort"].iloc[0]),
                "epsilon target": "none" if target is None else f"{target:g}",
                "epsilon printed": "-" if target is None else f"{group['epsilon'].max():.3f}",
                "z": "-" if target is None else f"{group['noise-multiplier'].iloc[0]:.4f}",
                "accuracy mean": acc.mean(),
                "accuracy std": acc.std() if len(acc) > 1 else 0.0,
                "seeds": len(acc),
                "pfl-research": PFL.get((int(n), target)),
                "pfl-research seeds": side_by_side.get((int(n), target), "-"),
                "s per run": statistics.median(group["seconds"]),
            }
        )
    return pd.DataFrame(out)


def to_markdown(table: pd.DataFrame) -> str:
    lines = [
        "| configuration | N | per round | target ε | ε printed | z | accuracy (mean ± std) "
        "| seeds | pfl-research published | pfl-research, same seeds here | s per run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in table.to_dict("records"):
        pfl = "-" if row["pfl-research"] is None else f"{row['pfl-research']:.2f}"
        lines.append(
            f"| {row['configuration']} | {row['N']} | {row['per round']} | "
            f"{row['epsilon target']} | "
            f"{row['epsilon printed']} | {row['z']} | {row['accuracy mean']:.3f} ± "
            f"{row['accuracy std']:.3f} | {row['seeds']} | {pfl} | {row['pfl-research seeds']} | "
            f"{row['s per run']:.0f} |"
        )
    return "\n".join(lines)


def write_tables(out: Path, rows: list[dict], pfl_runs: Path | None) -> None:
    table = summarise(rows, pfl_runs)
    table.to_csv(out / "results.csv", index=False)
    (out / "results.md").write_text(to_markdown(table) + "\n")
    print(to_markdown(table))


def accuracy_main(argv: list[str] | None = None) -> None:
    """This app's accuracy on the peer workload, beside pfl-research's."""
    parser = argparse.ArgumentParser(
        prog="peer_digits.py",
        description=__doc__.split("\n\n")[0],
        epilog="other commands: pfl, engine, engine-vs-pfl; each takes --help",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--curve-only", action="store_true", help="only the N = 100 curve")
    parser.add_argument("--no-curve", action="store_true")
    parser.add_argument(
        "--pfl-runs", type=Path, help="runs.csv of the pfl command, for a side-by-side column"
    )
    parser.add_argument(
        "--table-only", action="store_true", help="rebuild the tables from <out>/runs.csv"
    )
    args = parser.parse_args(argv)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    args.out.mkdir(parents=True, exist_ok=True)
    runs_dir = args.out / "runs"
    if args.table_only:
        rows = pd.read_csv(args.out / "runs.csv").to_dict("records")
        write_tables(args.out, rows, args.pfl_runs)
        return
    if not args.curve_only:
        rows = []
        for n in args.clients:
            for seed in args.seeds:
                rows.append(run_one(n, None, seed, runs_dir / f"N{n}", optimizer=False))
            for eps in [None, *args.epsilons]:
                for seed in args.seeds:
                    rows.append(run_one(n, eps, seed, runs_dir / f"N{n}"))
        pd.DataFrame(rows).to_csv(args.out / "runs.csv", index=False)
        write_tables(args.out, rows, args.pfl_runs)
    if not args.no_curve:
        curve: dict[str, dict[int, Path]] = {}
        for eps in [*CURVE, None]:  # None: the same recipe without DP, the ε = ∞ level
            name = "no-dp" if eps is None else f"epsilon-{eps:g}"
            for seed in args.seeds:
                row = run_one(100, eps, seed, runs_dir / "curve")
                curve.setdefault(name, {})[seed] = Path(row["run"])
        comparison.write_comparison_json(args.out / "curve", curve, {})
        comparison.analyse(curve, args.out / "curve")
        print(f"privacy-utility curve: {args.out / 'curve' / 'plots'}")


# --- pfl: pfl-research's own script over the same seeds -----------------------------
# pfl is not a dependency of the app: install it in a separate environment
#   python -m venv /tmp/pflvenv && /tmp/pflvenv/bin/pip install pfl==0.6.0 torch scikit-learn
# and pass its interpreter as --python.

PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "pfl_digits.py"
CELLS = [(100, None), (100, 8.0), (100, 2.0), (1000, None), (1000, 8.0), (1000, 2.0)]


def timed_run(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, float]:
    """``subprocess.run(cmd)``: the process, its wall seconds and its CPU seconds (user +
    sys of the whole process and its children, as /usr/bin/time counts them)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


# pfl's script fixes its rounds (NUM_ROUNDS = 30); for other counts it is loaded as a
# module, NUM_ROUNDS set, and its own main() run: the script itself is unchanged. With
# the CPU clock its lap timer (time.perf_counter) reads the process's CPU seconds
# (time.process_time) instead; pfl and the engine each train on one torch thread.
PFL_ROUNDS = (
    "import importlib.util as u, sys, time, types; "
    "s = u.spec_from_file_location('pfl_digits', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.NUM_ROUNDS = int(sys.argv[2]); "
    "cpu = sys.argv[3] == 'cpu'; "
    "m.time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) "
    "if not k.startswith('_')}) if cpu else time; "
    "cpu and setattr(m.time, 'perf_counter', time.process_time); "
    "sys.argv = [sys.argv[1], *sys.argv[4:]]; m.main()"
)
# The engine's round clocks (``round-seconds``, ``elapsed-s``) read the process's CPU
# seconds under the CPU clock: only those two modules' ``time`` is replaced.
ENGINE_CPU_CLOCK = (
    "import sys, time, types; import server_app.rounds as r, server_app.results as s; "
    "c = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) "
    "if not k.startswith('_')}); c.monotonic = time.process_time; r.time = s.time = c; "
    "from lab.run import main; sys.exit(main(sys.argv[1:]))"
)


def pfl_run_one(
    python: str,
    script: Path,
    n: int,
    epsilon: float | None,
    seed: int,
    rounds: int = 30,
    clock: str = "wall",
) -> dict:
    """One child run of the peer's script; its JSON result, with its whole process's
    ``process_wall_s`` and ``process_cpu_s`` (``clock`` = "cpu": its laps in CPU s)."""
    args = ["--num-clients", str(n), "--seed", str(seed)]
    if epsilon is None:
        args += ["--dp", "none"]
    else:
        args += ["--dp", "adaptive", "--epsilon", str(epsilon)]
        if (n, epsilon) == (100, 2.0):
            args += ["--indicator-std", "3.0"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        launch = [python, str(script)]
        if rounds != 30 or clock != "wall":
            launch = [python, "-c", PFL_ROUNDS, str(script), str(rounds), clock]
        done, wall, cpu = timed_run([*launch, "--child", "--out", str(out), *args])
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"pfl run {args} failed:\n{done.stdout}\n{done.stderr}")
        result = json.loads(out.read_text())
    if result["status"] != "ok":
        raise RuntimeError(f"pfl run {args}: {result['status']}")
    if result["rounds_completed"] != rounds:
        raise RuntimeError(f"pfl run {args}: {result['rounds_completed']} rounds, not {rounds}")
    return result | {"process_wall_s": wall, "process_cpu_s": cpu}


def pfl_summarise(runs: pd.DataFrame) -> str:
    lines = [
        "| N | per round | epsilon | z (pfl) | accuracy (mean ± std) | seeds | s per round |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (n, eps), group in runs.groupby(["N", "epsilon"], dropna=False, sort=False):
        acc = group["accuracy"].tolist()
        std = statistics.stdev(acc) if len(acc) > 1 else 0.0
        z = group["noise_multiplier"].iloc[0]
        lines.append(
            f"| {n} | {group['cohort'].iloc[0]} | {'none' if pd.isna(eps) else f'{eps:g}'} | "
            f"{'-' if pd.isna(z) else f'{z:.4f}'} | {statistics.mean(acc):.3f} ± {std:.3f} | "
            f"{len(acc)} | {group['round_s'].median():.4f} |"
        )
    return "\n".join(lines) + "\n"


def pfl_main(argv: list[str] | None = None) -> None:
    """pfl-research's own script on the peer workload, over the same seeds."""
    parser = argparse.ArgumentParser(
        prog="peer_digits.py pfl",
        description="pfl-research on the shared peer workload, over the same seeds as this "
        "app's runs (its own script, bench/peers/pfl_digits.py --child, in its own "
        "environment: --python).",
    )
    parser.add_argument("--python", required=True, help="interpreter with pfl installed")
    parser.add_argument("--script", type=Path, default=PEER_SCRIPT)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, epsilon in CELLS:
        for seed in args.seeds:
            r = pfl_run_one(args.python, args.script, n, epsilon, seed)
            rows.append(
                {
                    "N": n,
                    "cohort": r["cohort"],
                    "epsilon": epsilon,
                    "seed": seed,
                    "noise_multiplier": r.get("noise_multiplier"),
                    "accuracy": r["test_accuracy"],
                    "round_s": r["median_round_seconds"],
                }
            )
            print(f"pfl N={n} epsilon={epsilon} seed={seed}: {r['test_accuracy']:.4f}", flush=True)
            pd.DataFrame(rows).to_csv(args.out / "runs.csv", index=False)
    table = pfl_summarise(pd.DataFrame(rows))
    (args.out / "results.md").write_text(table)
    print(table)


# --- engine: the in-process engine's time on the workload ---------------------------
# Each run is ``python -m lab.run --engine inprocess`` in a fresh process (imports, data,
# calibration and the run directory included), without DP (FedAvg) and with the DP
# preset (experiments/digits-dp-eps8.toml). The warm round is the median of
# ``round-seconds`` over rounds 2-30; the round with evaluation the median gap between
# consecutive central evaluations (``elapsed-s``).

# The workload's settings, the rounds given per run and a round timeout for loaded hosts.
ENGINE_WORKLOAD = {
    **{k: v for k, v in WORKLOAD.items() if k != "num-server-rounds"},
    "round-timeout": 600.0,
}


def toml_value(value) -> str:
    """``value`` as a run-config literal (``flwr run --run-config``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def engine_run_config(num_clients: int, private: bool, rounds: int, out: Path) -> str:
    """The run-config string of one run."""
    cohort = COHORT[num_clients]
    config = {**ENGINE_WORKLOAD, "num-server-rounds": rounds, "output-dir": str(out)}
    config |= {"min-available-nodes": num_clients, "min-train-nodes": cohort}
    config["fraction-train"] = cohort / num_clients
    if private:
        preset = tomllib.loads((REPO / "experiments" / "digits-dp-eps8.toml").read_text())
        for key, value in preset.items():
            if isinstance(value, dict):
                config |= {f"{key}.{k}": v for k, v in value.items()}
            else:
                config[key] = value
        config |= {"dp.num-sampled-clients": cohort, "num-server-rounds": rounds}
    return " ".join(f"{k}={toml_value(v)}" for k, v in config.items())


def run_engine(run_config: str, num_clients: int, root: Path, clock: str = "wall"):
    """``python -m lab.run --engine inprocess`` in its own process, its one run written
    under ``root``: (wall s, CPU s, metrics.csv, the timing table: the curator's under
    DP). ``clock`` = "cpu": the run's round clocks read CPU seconds
    (:data:`ENGINE_CPU_CLOCK`)."""
    before = set(root.iterdir())
    launch = ["-m", "lab.run"] if clock == "wall" else ["-c", ENGINE_CPU_CLOCK]
    cmd = [
        sys.executable, *launch, "--engine", "inprocess",
        "--run-config", run_config, "--federation-config", f"num-supernodes={num_clients}",
    ]  # fmt: skip
    proc, seconds, cpu = timed_run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    (run_dir,) = set(root.iterdir()) - before
    metrics = pd.read_csv(run_dir / "metrics.csv")
    timing = metrics
    if (run_dir / "curator" / "metrics.csv").exists():  # under DP timing is the curator's
        timing = pd.read_csv(run_dir / "curator" / "metrics.csv")
    return seconds, cpu, metrics, timing


def engine_one(
    num_clients: int, private: bool, rounds: int, out: Path, clock: str = "wall"
) -> dict:
    root = out / f"n{num_clients}-{'dp' if private else 'plain'}"
    root.mkdir(parents=True, exist_ok=True)
    seconds, cpu, metrics, timing = run_engine(
        engine_run_config(num_clients, private, rounds, root), num_clients, root, clock
    )
    train = timing[(timing["scope"] == "train") & (timing["round"] >= 2)]
    central = metrics[metrics["scope"] == "central-eval"].sort_values("round")
    timed = timing[timing["scope"] == "central-eval"].sort_values("round")
    gaps = timed["elapsed-s"].diff().dropna().iloc[1:] if "elapsed-s" in timed else []
    return {
        "N": num_clients,
        "per round": COHORT[num_clients],
        "DP": "eps 8 adaptive" if private else "none",
        "process s": round(seconds, 1),
        "process CPU s": round(cpu, 1),
        "warm round s": round(statistics.median(train["round-seconds"]), 4),
        "round with eval s": round(statistics.median(gaps), 4) if len(gaps) else None,
        "accuracy": round(float(central["eval-accuracy"].iloc[-1]), 4),
    }


def engine_main(argv: list[str] | None = None) -> int:
    """Whole-process time and warm round of the in-process engine, per (N, DP)."""
    parser = argparse.ArgumentParser(
        prog="peer_digits.py engine",
        description="The in-process engine on the peer workload: whole-process time of a "
        "30-round run and its warm round, per (N, DP).",
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-bench"))
    args = parser.parse_args(argv)
    rows = []
    for num_clients in args.sizes:
        for private in (False, True):
            rows.append(engine_one(num_clients, private, args.rounds, args.out))
            print(rows[-1], flush=True)
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return 0


# --- engine-vs-pfl: both on the same load -------------------------------------------
# Each cell runs the engine and then pfl-research's own script back to back, so both see
# the same load. Warm round: the engine's median ``round-seconds`` over rounds 2-R,
# pfl's median round lap. The two differ in what they hold: ``round-seconds`` is sending
# the round's messages to its aggregate (the clients' training, the server's checks, clip
# and noise, the ledger's charge), without the central evaluation and the per-round
# writes (metrics.csv, TensorBoard, checkpoints) that follow; pfl's lap is one whole
# iteration, and pfl evaluates and writes nothing per round here. The engine's whole
# round, everything included, is also shown: the median gap between consecutive central
# evaluations. Process: the whole child process (imports, data, calibration
# under DP, the run), in wall seconds and in CPU seconds (user + sys, children included);
# on a shared machine the CPU ratio is the honest one. ``flwr run`` is not in this run
# (its Ray start-up alone takes minutes on a shared machine).


def engine_vs_pfl_main(argv: list[str] | None = None) -> int:
    """The engine and pfl-research back to back per (N, DP): warm round and process."""
    parser = argparse.ArgumentParser(
        prog="peer_digits.py engine-vs-pfl",
        description="The in-process engine against pfl-research on the peer workload, "
        "side by side in one run: warm round and whole process (wall and CPU seconds), per "
        "(N, DP), over --rounds rounds (the DP runs calibrate epsilon 8 to them).",
    )
    parser.add_argument("--python", required=True, help="pfl-research's interpreter")
    parser.add_argument("--script", type=Path, default=PEER_SCRIPT)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--dp", nargs="+", choices=["none", "adaptive"], default=["none"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-vs-pfl"))
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="what the round times read: wall seconds, or the process's CPU seconds "
        "(steadier on a shared machine; both sides train on one torch thread)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="pairs per cell (engine, then pfl, K times over): the row gives the median "
        "of each side and of the pairs' ratios, and the ratios' range",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.rounds < 2:
        parser.error(
            f"--rounds must be at least 2 (the warm round is rounds 2-R), got {args.rounds}"
        )
    lines = [
        "| N | per round | DP | rounds | engine warm round s | pfl warm round s | ratio "
        "| engine whole round s (ratio) "
        "| engine process s (CPU s) | pfl process s (CPU s) | process ratio wall (CPU) "
        "| engine acc | pfl acc | pairs (ratio range) |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for n in args.sizes:
        for dp in args.dp:
            epsilon = 8.0 if dp == "adaptive" else None
            pairs = []
            for _ in range(args.repeat):  # alternated, so both sides see the same load
                one = engine_one(n, dp == "adaptive", args.rounds, args.out, args.clock)
                other = pfl_run_one(
                    args.python, args.script, n, epsilon, 0, args.rounds, args.clock
                )
                pairs.append((one, other))
            ours, theirs = _median_pair(pairs)
            ratios = [a["warm round s"] / b["median_round_seconds"] for a, b in pairs]
            ratio = statistics.median(ratios)
            whole = ours["round with eval s"]
            whole_text = (
                "-"
                if whole is None
                else f"{whole:.4f} ({whole / theirs['median_round_seconds']:.1f})"
            )
            wall, cpu = theirs["process_wall_s"], theirs["process_cpu_s"]
            lines.append(
                f"| {n} | {COHORT[n]} | {dp} | {args.rounds} | {ours['warm round s']:.4f} "
                f"| {theirs['median_round_seconds']:.4f} | {ratio:.1f} | {whole_text} "
                f"| {ours['process s']:.1f} ({ours['process CPU s']:.1f}) "
                f"| {wall:.1f} ({cpu:.1f}) "
                f"| {ours['process s'] / wall:.2f} ({ours['process CPU s'] / cpu:.2f}) "
                f"| {ours['accuracy']:.3f} | {theirs['test_accuracy']:.3f} "
                f"| {len(pairs)} ({min(ratios):.1f}-{max(ratios):.1f}) |"
            )
            print(lines[-1], flush=True)
    print(f"round times in {args.clock} seconds")
    print("\n".join(lines))
    return 0


def _median_pair(pairs: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """One (engine, pfl) row of ``pairs``: every timing the median over the pairs, the
    accuracies the first pair's (a DP run's differs by its noise draw)."""
    ours, theirs = dict(pairs[0][0]), dict(pairs[0][1])
    for key in ("warm round s", "process s", "process CPU s"):
        ours[key] = statistics.median(a[key] for a, _ in pairs)
    whole = [a["round with eval s"] for a, _ in pairs if a["round with eval s"] is not None]
    ours["round with eval s"] = statistics.median(whole) if whole else None
    for key in ("median_round_seconds", "process_wall_s", "process_cpu_s"):
        theirs[key] = statistics.median(b[key] for _, b in pairs)
    return ours, theirs


COMMANDS = {"pfl": pfl_main, "engine": engine_main, "engine-vs-pfl": engine_vs_pfl_main}


def main(argv: list[str] | None = None) -> object:
    """``pfl``, ``engine`` or ``engine-vs-pfl`` with their arguments, else the accuracy
    runs' arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    return accuracy_main(args)


if __name__ == "__main__":
    sys.exit(main())
