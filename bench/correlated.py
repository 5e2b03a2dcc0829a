"""Correlated noise against the honest baselines on the peer workload, and its cost.

Digits MLP (the peer workload of ``bench/peer_digits.py``), N = 1 000 clients, 50 a
round, 300 rounds (b = 20 groups: each client about 15 times), delta 1e-5, fixed clip
0.5, server momentum 0.5, z calibrated to the whole run's epsilon:

    a  dp-fedavg-cyclic   banded-mf with 1 band (C = I: DP-FedAvg's noise) on the same
                          cyclic cohorts, no amplification
    b  dp-fedavg-poisson  DP-FedAvg, secret Poisson sampling (the idealised reference)
    c  banded-mf          cyclic cohorts, b = 20 bands, no amplification
    d  banded-mf-amp      amplified banded MF (b = 10 groups of 100, Poisson q = 0.5
                          within the round's group)
    e  dp-ftrl            honest tree, cyclic cohorts

    python bench/correlated.py --eps 2 8 --seeds 0 --out /tmp/correlated-bench
    python bench/correlated.py --cost   # the mechanism's cost per round at 1e7 weights
    python bench/correlated.py --error  # the mechanisms alone: z and prefix-sum error

Each run is ``python -m lab.run --engine inprocess`` in its own process; the table has
the final central accuracy (mean ± std over seeds) and the median warm round.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import peer_digits  # noqa: E402  (this directory is on sys.path when run as a script)

N, COHORT, ROUNDS = 1000, 50, 300
AMPLIFIED_GROUPS = 10  # b of the amplified arm: groups of 100, q = 50/100
# The shared peer workload (bench/peer_digits.py), with this benchmark's own keys.
WORKLOAD = {
    **{k: v for k, v in peer_digits.WORKLOAD.items() if k != "num-server-rounds"},
    "strategy": "fedavg",
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
    # b = 10 groups of 100: q = 50/100 (with b = 20, groups of 50 give q = 1: no sampling)
    "banded-mf-amp": {
        "privacy": "banded-mf",
        "correlated.schema": "amplified",
        "correlated.min-separation": AMPLIFIED_GROUPS,
    },
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


def error_table(epsilons=(2.0, 8.0), delta: float = 1e-5) -> str:
    """The mechanisms alone at the benchmark's size (N, m, n): z calibrated to each ε
    and the mean squared error of the released prefix sums per coordinate, in units
    of C² (the noise the model's trajectory carries; no training)."""
    from dataclasses import replace

    from privacy import correlated as cr
    from privacy.accounting import Release
    from privacy.calibration import calibrate_parameter

    n, b = ROUNDS, N // COHORT
    k = math.ceil(n / b)
    identity = n * (n + 1) / 2 / n  # ||A||_F^2 / n

    def poisson_z(eps: float, population: int, count: int) -> float:
        release = Release(
            server_round=1,
            kind="model-update",
            mechanism="gaussian",
            noise_multiplier=1.0,
            sampling="poisson",
            sample_size=COHORT,
            population=population,
            count=count,
        )
        return calibrate_parameter(
            lambda p: [replace(release, noise_multiplier=p)],
            target_epsilon=eps,
            target_delta=delta,
            accountant="pld",
            neighboring="add-or-remove-one",
        )

    banded = cr.optimize_banded(n, b)
    sens = cr.sensitivity(banded.strategy(), participations=k, min_separation=b).value
    amp_b = AMPLIFIED_GROUPS
    amplified = cr.optimize_banded(n, amp_b)
    tree = cr.tree_sensitivity(n, participations=k, min_separation=b)
    lines = [
        "| arm | ε | z | sensitivity | mean sq. prefix-sum error / C² | RMSE / C |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for eps in epsilons:
        rows = []
        z = cr.calibrate(target_epsilon=eps, sensitivity=math.sqrt(k), delta=delta)
        rows.append(("a dp-fedavg-cyclic", z, math.sqrt(k), z**2 * identity))
        z = poisson_z(eps, N, n)
        rows.append(("b dp-fedavg-poisson", z, 1.0, z**2 * identity))
        z = cr.calibrate(target_epsilon=eps, sensitivity=sens, delta=delta)
        rows.append(("c banded-mf", z, sens, cr.prefix_sum_error(banded.decoder(), noise_std=z)))
        z = poisson_z(eps, N // amp_b, math.ceil(n / amp_b))
        error = cr.prefix_sum_error(amplified.decoder(), noise_std=z)
        rows.append(("d banded-mf-amp", z, 1.0, error))
        z = cr.calibrate(target_epsilon=eps, sensitivity=tree, delta=delta)
        rows.append(("e dp-ftrl", z, tree, cr.prefix_sum_error(cr.tree_decoder(n), noise_std=z)))
        for name, z, s, err in rows:
            lines.append(
                f"| {name} | {eps:g} | {z:.3f} | {s:.3f} | {err:.4g} | {math.sqrt(err):.2f} |"
            )
    return "\n".join(lines)


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
    parser.add_argument("--error", action="store_true", help="only the mechanisms' error")
    args = parser.parse_args(argv)
    if args.cost:
        for key, value in cost().items():
            print(f"{key}: {value:.4f}")
        return 0
    if args.error:
        print(error_table(args.eps))
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
