"""The shared peer workload in this app, beside
pfl-research's numbers measured on this machine.

Workload, exactly as the peers run it: scikit-learn digits, X / 16 (``data.normalize =
false``), ``train_test_split(test_size=0.2, random_state=0, stratify=y)`` and the
training rows cut by ``np.array_split(default_rng(0).permutation(n_train), N)``
(``data.partitioner = "array-split"``, every client example trains); the MLP 64-64-10
(``model.name = "mlp"``); local SGD lr 0.1, no momentum, batch 16, one epoch; 30
rounds; central test accuracy after round 30. N = 100 with 10 clients per round and
N = 1000 with 50; DP at epsilon 2 and 8, delta 1e-5, client-level.

Design notes: ``docs/notes.md``, ``bench.peer_digits``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    "model.name": "mlp",
    "data.partitioner": "array-split",
    "data.normalize": False,
    "data.test-fraction": 0.0,
    "data.batch-size": 16,
    "train.lr": 0.1,
    "train.momentum": 0.0,
    "train.local-epochs": 1,
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
    """pfl-research's mean ± std per (N, epsilon) from ``bench/peer_pfl.py``'s runs.csv."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--curve-only", action="store_true", help="only the N = 100 curve")
    parser.add_argument("--no-curve", action="store_true")
    parser.add_argument(
        "--pfl-runs", type=Path, help="runs.csv of bench/peer_pfl.py, for a side-by-side column"
    )
    parser.add_argument(
        "--table-only", action="store_true", help="rebuild the tables from <out>/runs.csv"
    )
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
