"""Wall time and accuracy of whole `flwr run . local-simulation` runs.

Runs each configuration ``--repeats`` times through a private local SuperLink (the
first run of the session also pays the SuperLink's start-up; it is reported
separately) and prints a markdown table: median wall time, and the final-round
central and federated accuracy (median over repeats).

    python bench/default_run.py --repeats 3
    python bench/default_run.py --repeats 3 --config "fedavg=strategy='fedavg'" \\
        --config "local=strategy='local'"
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import pandas as pd

from server_app.launcher import LocalSimulation


def final_accuracy(metrics: pd.DataFrame, scope: str) -> float:
    rows = metrics[metrics["scope"] == scope]
    return (
        float(rows.sort_values("round")["eval-accuracy"].iloc[-1]) if len(rows) else float("nan")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="NAME=RUN_CONFIG (default: the default experiment)",
    )
    args = parser.parse_args()
    configs = dict(c.split("=", 1) for c in args.config) or {"default": ""}

    rows = []
    with tempfile.TemporaryDirectory() as out, LocalSimulation(args.num_supernodes) as sim:
        warmup = sim.run(f"num-server-rounds=1 output-dir='{out}/warmup'")
        print(f"first run incl. SuperLink start-up: {warmup.seconds:.1f} s")
        for name, run_config in configs.items():
            seconds, central, federated = [], [], []
            for i in range(args.repeats):
                result = sim.run(f"{run_config} output-dir='{out}/{name}-{i}'".strip())
                if result.returncode != 0 or result.run_dir is None:
                    raise SystemExit(result.output)
                metrics = pd.read_csv(result.run_dir / "metrics.csv")
                seconds.append(result.seconds)
                central.append(final_accuracy(metrics, "central-eval"))
                federated.append(final_accuracy(metrics, "federated-eval"))
                print(
                    f"{name} #{i}: {result.seconds:.1f} s, central {central[-1]:.4f}, "
                    f"federated {federated[-1]:.4f}"
                )
            rows.append(
                (
                    name,
                    run_config or "(defaults)",
                    statistics.median(seconds),
                    statistics.median(central),
                    statistics.median(federated),
                )
            )

    print("\n| config | run-config | wall time (s, median) | central acc. | federated acc. |")
    print("| --- | --- | --- | --- | --- |")
    for name, run_config, sec, cen, fed in rows:
        print(f"| {name} | `{run_config}` | {sec:.1f} | {cen:.4f} | {fed:.4f} |")


if __name__ == "__main__":
    main()
