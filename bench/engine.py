"""The in-process engine on the peer workload: whole-process time of a 30-round run and
its warm round, per (N, DP).

    python bench/engine.py [--rounds 30] [--sizes 100 1000] [--out /tmp/engine-bench]

Each run is ``python -m lab.run --engine inprocess`` in a fresh process (imports,
data, calibration and the run directory included), on digits as ``bench/peer_digits.py``
runs it: N = 100 with 10 clients per round and N = 1 000 with 50, without DP (FedAvg)
and with the DP preset (``experiments/digits-dp-eps8.toml``: adaptive clipping, Poisson
sampling, z calibrated to ε = 8 under PLD). The warm round is the median of
``round-seconds`` (messages out to aggregate; without evaluation) over rounds 2-30, the
round time with evaluation the median gap between consecutive central evaluations
(``elapsed-s``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
COHORT = {100: 10, 1000: 50}
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
    "fraction-evaluate": 0.0,
    "central-eval": True,
    "round-timeout": 600.0,
}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def run_config(num_clients: int, private: bool, rounds: int, out: Path) -> str:
    """The run-config string of one run."""
    cohort = COHORT[num_clients]
    config = {**WORKLOAD, "num-server-rounds": rounds, "output-dir": str(out)}
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
    return " ".join(f"{k}={_toml(v)}" for k, v in config.items())


def one(num_clients: int, private: bool, rounds: int, out: Path) -> dict:
    root = out / f"n{num_clients}-{'dp' if private else 'plain'}"
    root.mkdir(parents=True, exist_ok=True)
    before = set(root.iterdir())
    cmd = [
        sys.executable, "-m", "lab.run", "--engine", "inprocess",
        "--run-config", run_config(num_clients, private, rounds, root),
        "--federation-config", f"num-supernodes={num_clients}",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    (run_dir,) = set(root.iterdir()) - before
    metrics = pd.read_csv(run_dir / "metrics.csv")
    timing = metrics
    if (run_dir / "curator" / "metrics.csv").exists():  # under DP timing is the curator's
        timing = pd.read_csv(run_dir / "curator" / "metrics.csv")
    train = timing[(timing["scope"] == "train") & (timing["round"] >= 2)]
    central = metrics[metrics["scope"] == "central-eval"].sort_values("round")
    timed = timing[timing["scope"] == "central-eval"].sort_values("round")
    gaps = timed["elapsed-s"].diff().dropna().iloc[1:] if "elapsed-s" in timed else []
    return {
        "N": num_clients,
        "per round": COHORT[num_clients],
        "DP": "eps 8 adaptive" if private else "none",
        "process s": round(seconds, 1),
        "warm round s": round(statistics.median(train["round-seconds"]), 4),
        "round with eval s": round(statistics.median(gaps), 4) if len(gaps) else None,
        "accuracy": round(float(central["eval-accuracy"].iloc[-1]), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-bench"))
    args = parser.parse_args(argv)
    rows = []
    for num_clients in args.sizes:
        for private in (False, True):
            rows.append(one(num_clients, private, args.rounds, args.out))
            print(rows[-1], flush=True)
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
