"""Correlated noise against the honest baselines on the peer workload, and its cost.

Digits MLP (the peer workload of ``bench/peer_digits.py``), N = 1 000 clients, 50 a
round, 300 rounds (b = 20 groups: each client about 15 times), delta 1e-5, fixed clip
0.5, server momentum 0.5, z calibrated to the whole run's epsilon:

    a  dp-fedavg-cyclic   banded-mf with 1 band (C = I: DP-FedAvg's noise) on the same
                          cyclic cohorts, no amplification
    b  dp-fedavg-poisson  DP-FedAvg, secret Poisson sampling (the idealised reference)
    c  banded-mf          cyclic cohorts, b = 20 bands, no amplification
    d  banded-mf-amp      amplified banded MF (Poisson within the round's group)
    e  dp-ftrl            honest tree, cyclic cohorts

    python bench/correlated.py --eps 2 8 --seeds 0 --out /tmp/correlated-bench
    python bench/correlated.py --cost   # the mechanism's cost per round at 1e7 weights

Each run is ``python -m lab.run --engine inprocess`` in its own process; the table has
the final central accuracy (mean ± std over seeds) and the median warm round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

N, COHORT, ROUNDS = 1000, 50, 300
WORKLOAD = {
    "task": "digits",
    "strategy": "fedavg",
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
    "dp.clip-norm": 0.5,
    "dp.num-sampled-clients": COHORT,
    "dp.target-delta": 1e-5,
    "server.optimizer": "momentum",
    "server.lr": 1.0,
    "server.momentum": 0.5,
}
ARMS = {
    "dp-fedavg-cyclic": {"privacy": "banded-mf", "correlated.bands": 1},
    "dp-fedavg-poisson": {"privacy": "dp-fedavg-fixed", "dp.sampling": "poisson"},
    "banded-mf": {"privacy": "banded-mf"},
    "banded-mf-amp": {"privacy": "banded-mf", "correlated.schema": "amplified"},
    "dp-ftrl": {"privacy": "dp-ftrl"},
}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def one(
    arm: str, epsilon: float, seed: int, rounds: int, out: Path, clients=N, cohort=COHORT
) -> dict:
    """One run; its final accuracy, ε (the ledger's), z and warm round."""
    root = out / f"{arm}-eps{epsilon:g}-seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    before = set(root.iterdir())
    config = {**WORKLOAD, **ARMS[arm], "seed": seed, "num-server-rounds": rounds}
    config |= {"dp.target-epsilon": epsilon, "output-dir": str(root)}
    config |= {"min-available-nodes": clients, "min-train-nodes": cohort}
    config["dp.num-sampled-clients"] = cohort
    cmd = [
        sys.executable, "-m", "lab.run", "--engine", "inprocess",
        "--run-config", " ".join(f"{k}={_toml(v)}" for k, v in config.items()),
        "--federation-config", f"num-supernodes={clients}",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    (run_dir,) = set(root.iterdir()) - before
    metrics = pd.read_csv(run_dir / "metrics.csv")
    timing = metrics
    if (run_dir / "curator" / "metrics.csv").exists():
        timing = pd.read_csv(run_dir / "curator" / "metrics.csv")
    train = timing[(timing["scope"] == "train") & (timing["round"] >= 2)]
    central = metrics[metrics["scope"] == "central-eval"].sort_values("round")
    released = metrics[metrics["scope"] == "train"].sort_values("round")
    return {
        "arm": arm,
        "epsilon": epsilon,
        "seed": seed,
        "ledger epsilon": float(released["dp-epsilon"].iloc[-1]),
        "accuracy": float(central["eval-accuracy"].iloc[-1]),
        "warm round s": statistics.median(train["round-seconds"]),
        "process s": round(seconds, 1),
    }


def table(rows: list[dict]) -> str:
    """Markdown: accuracy mean ± std over seeds and the median warm round per arm × ε."""
    frame = pd.DataFrame(rows)
    lines = [
        "| arm | ε | ledger ε | accuracy | seeds | warm round (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (arm, eps), group in frame.groupby(["arm", "epsilon"], sort=False):
        acc = group["accuracy"]
        std = f" ± {acc.std(ddof=1):.3f}" if len(acc) > 1 else ""
        lines.append(
            f"| {arm} | {eps:g} | {group['ledger epsilon'].max():.3f} | {acc.mean():.3f}{std} "
            f"| {len(acc)} | {group['warm round s'].median():.3f} |"
        )
    return "\n".join(lines)


def cost(dim: int = 10_000_000, rounds: int = 5, bands: int = 20) -> dict[str, float]:
    """Seconds per round of the mechanism at ``dim`` weights: the stream's increment
    (noise drawn, the factorization applied) for banded MF (b bands), the tree, and
    DP-FedAvg's independent draw, beside the server's clip-and-sum of the cohort's
    updates; the L-BFGS time of the strategy for 2 000 rounds, b = 64 (uncached)."""
    import tempfile

    from privacy import correlated as cr

    out = {}
    coefs = cr.optimize_banded(ROUNDS, bands, use_cache=False).coefs
    streams = {
        "banded-mf": cr.BandedNoise(coefs, dim=dim, std=1.0, generator=np.random.default_rng()),
        "dp-ftrl": cr.TreeNoise(dim=dim, std=1.0, generator=np.random.default_rng()),
    }
    for name, stream in streams.items():
        for _ in range(bands):  # fill the band
            stream.next()
        started = time.perf_counter()
        for _ in range(rounds):
            stream.next()
        out[f"{name} s/round"] = (time.perf_counter() - started) / rounds
    rng = np.random.default_rng()
    started = time.perf_counter()
    for _ in range(rounds):
        rng.normal(0.0, 1.0, dim)
    out["independent draw s/round"] = (time.perf_counter() - started) / rounds
    # The server's own aggregate of one round at this size: m clipped updates summed
    # (DP-FedAvg's clip and sum; the floor of a round, before training and messages).
    from privacy.mechanisms import GaussianMechanism

    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0)
    update = [rng.normal(0.0, 1.0, dim).astype(np.float32)]
    started = time.perf_counter()
    total = np.zeros(dim)
    for _ in range(COHORT):
        total += mech.clip(update).arrays[0]
    out[f"clip and sum of {COHORT} updates s"] = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cr.optimize_banded(2000, 64, cache=Path(tmp))
        out["strategy n=2000 b=64 s"] = time.perf_counter() - started
        started = time.perf_counter()
        cr.optimize_banded(2000, 64, cache=Path(tmp))
        out["cached s"] = time.perf_counter() - started
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eps", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--clients", type=int, default=N)
    parser.add_argument("--cohort", type=int, default=COHORT)
    parser.add_argument("--out", type=Path, default=Path("/tmp/correlated-bench"))
    parser.add_argument("--cost", action="store_true", help="only the mechanism's cost")
    args = parser.parse_args(argv)
    if args.cost:
        for key, value in cost().items():
            print(f"{key}: {value:.4f}")
        return 0
    rows = []
    for seed in args.seeds:
        for epsilon in args.eps:
            for arm in args.arms:
                rows.append(
                    one(arm, epsilon, seed, args.rounds, args.out, args.clients, args.cohort)
                )
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "results.csv", index=False)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
