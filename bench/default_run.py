"""Wall time, accuracy and epsilon of whole `flwr run . local-simulation` runs.

Runs each configuration ``--repeats`` times through a private local SuperLink (the
first run of the session also pays the SuperLink's start-up; it is reported
separately) and prints a markdown table: median wall time, the final-round central
and federated accuracy, and the final client-level epsilon (medians over repeats).

    python bench/default_run.py --repeats 3
    python bench/default_run.py --repeats 3 --config "fedavg=strategy='fedavg'" \\
        --config "local=strategy='local'"

Run it from a clean checkout (``git worktree add /tmp/wt HEAD``, then
``PYTHONPATH=/tmp/wt python bench/...`` from ``/tmp/wt``; without ``PYTHONPATH`` an
editable install imports, and ``flwr run`` packages, the installed checkout instead):
editing the app while it runs changes what is measured.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile

import pandas as pd

from lab.launcher import LocalSimulation


def final_value(metrics: pd.DataFrame, scope: str, column: str) -> float:
    """The last round's ``column`` in ``scope`` (NaN when absent)."""
    rows = metrics[metrics["scope"] == scope].sort_values("round")
    if column not in rows or rows[column].isna().all():
        return float("nan")
    return float(rows[column].dropna().iloc[-1])


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


if __name__ == "__main__":
    main()
