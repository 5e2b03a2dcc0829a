"""The privacy audit (``audit.canaries``, :mod:`privacy.audit`) over the mechanisms that
release one global model, on the peer workload (digits, N = 100 real clients, 30
rounds, ``bench/peer_digits.py``) with k = 100 canaries, at ε = 2 and 8.

Every run is the real ServerApp against the real ClientApp in one process
(``tests/inprocess.py``): N + k = 200 nodes, the canaries the last 100 partition ids.
The expected cohort is 20 (sampling rate 0.1, as the peer workload's 10 of 100), so a
round samples about 10 real clients and 10 canaries, about 5 of them inserted.

Design notes: ``docs/notes.md``, ``bench.audit``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.inprocess, bench.peer_digits

from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from bench.peer_digits import WORKLOAD, preset, toml_value  # noqa: E402
from privacy import audit  # noqa: E402
from privacy.mechanisms import gaussian_noise_like, make_generator  # noqa: E402
from strategies.registry import _SERVER_STREAM  # noqa: E402
from tasks.vision import DigitsTask  # noqa: E402
from tests.inprocess import InProcessGrid, run_config, run_server  # noqa: E402

REAL, CANARIES, RATE = 100, 100, 0.1
NODES = REAL + CANARIES
COHORT = round(RATE * NODES)  # the expected cohort of all nodes, canaries included
EPSILONS = (2.0, 8.0)


def configurations(epsilon: float) -> dict[str, dict]:
    """Each mechanism's run-config overrides at ``epsilon``."""
    adaptive = preset(epsilon) | {"dp.num-sampled-clients": COHORT}
    fixed = adaptive | {"privacy": "dp-fedavg-fixed", "dp.clip-norm": 0.5}
    return {
        "dp-fedavg-adaptive": adaptive,
        "dp-fedavg-fixed": fixed,
        "subspace-dp": {
            "privacy": "subspace-dp",
            "dp.target-epsilon": epsilon,
            "dp.num-sampled-clients": COHORT,
        },
        "laplace": {
            "privacy": "laplace",
            "dp.target-epsilon": epsilon,
            "dp.num-sampled-clients": COHORT,
        },
    }


ATTACK_CANARIES = 300  # the bound's ceiling with k canaries: 1.78 at 100, 3.16 at 300


def attack_config(epsilon: float, canaries: int) -> dict:
    """``dp-fedavg-fixed`` with seed-derived noise and plain server SGD (the final delta
    is the sum of the released means)."""
    return configurations(epsilon)["dp-fedavg-fixed"] | {
        "dp.reproducible-noise": True,
        "server.optimizer": "sgd",
        "server.lr": 1.0,
        "dp.num-sampled-clients": round(RATE * (REAL + canaries)),
    }


def run(overrides: dict, seed: int, root: Path, canaries: int = CANARIES) -> Path:
    """One in-process run; its run directory."""
    nodes = REAL + canaries
    config = run_config(
        **(
            WORKLOAD
            | {
                "seed": seed,
                "output-dir": str(root),
                "audit.canaries": canaries,
                "min-available-nodes": nodes,
                "min-train-nodes": 2,
                "fraction-train": RATE,
            }
            | overrides
        )
    )
    before = set(root.iterdir()) if root.exists() else set()
    run_server(config, InProcessGrid(config, list(range(1, nodes + 1))))
    (run_dir,) = set(root.iterdir()) - before
    return run_dir


def _flat(state: dict) -> np.ndarray:
    return audit.flatten([v.numpy() for v in state.values()])


def attacked_audit(run_dir: Path) -> dict:
    """The audit after subtracting the server's noise, regenerated from the seed as the
    server drew it: per round one uniform per node (Poisson sampling), then N(0, (zC)²)
    per array on the sum; the mean divides by the expected cohort m."""
    config = json.loads((run_dir / "config.json").read_text())["run-config"]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    final = torch.load(run_dir / "model.pt", weights_only=True)
    initial = DigitsTask(config).build_model(config["seed"]).state_dict()  # as the server
    z, clip = ledger["calibration"]["value"], float(config["dp.clip-norm"])
    m, canaries = int(config["dp.num-sampled-clients"]), int(config["audit.canaries"])
    shapes = [v.numpy() for v in final.values()]
    rng = make_generator(config["seed"], _SERVER_STREAM)
    noise = np.zeros(sum(a.size for a in shapes))
    for _ in range(int(config["num-server-rounds"])):
        rng.random(REAL + canaries)  # the round's Poisson sample
        noise += audit.flatten(gaussian_noise_like(shapes, std=z * clip, rng=rng)) / m
    cleaned = _flat(final) - _flat(initial) - noise
    result = audit.audit(
        cleaned,
        seed=config["seed"],
        canaries=canaries,
        delta=float(config["dp.target-delta"]),
        confidence=float(config["audit.confidence"]),
        accountant_epsilon=ledger["summary"]["epsilon"],
    )
    return result.to_json()


def trials() -> list[tuple[str, float | None, dict, int]]:
    """(label, target ε, run-config overrides, canaries) of every run of one seed."""
    out = [("none", None, {"fraction-train": RATE}, CANARIES)]
    for epsilon in EPSILONS:
        out += [(label, epsilon, o, CANARIES) for label, o in configurations(epsilon).items()]
    k = ATTACK_CANARIES
    return [
        *out,
        ("reproducible noise (k = 100)", 8.0, attack_config(8.0, CANARIES), CANARIES),
        (f"reproducible noise (k = {k})", 2.0, attack_config(2.0, k), k),
    ]


def row(label: str, epsilon: float | None, seed: int, run_dir: Path, doc: dict) -> dict:
    metrics = pd.read_csv(run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    out = {
        "mechanism": label,
        "epsilon-target": epsilon,
        "seed": seed,
        "accountant-epsilon": doc["accountant_epsilon"],
        "estimate": doc["epsilon_estimate"],
        "estimate-two-variances": doc["epsilon_estimate_two_variances"],
        "lower-bound": doc["epsilon_lower_bound"],
        "lower-bound-max": doc["epsilon_lower_bound_max"],
        "guesses": doc["guesses"],
        "correct": doc["correct_guesses"],
        "exceeds": doc["exceeds_accountant"],
        "accuracy": float(central["eval-accuracy"].iloc[-1]),
        "run": str(run_dir),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "run"}), flush=True)
    return out


def round_seconds(run_dir: Path) -> float:
    """Median wall time of rounds 2..T (``round-seconds``; under DP in curator/)."""
    path = run_dir / "curator" / "metrics.csv"
    metrics = pd.read_csv(path if path.is_file() else run_dir / "metrics.csv")
    rounds = metrics[(metrics["scope"] == "train") & (metrics["round"] >= 2)]
    return float(rounds["round-seconds"].median())


def cost(seeds: list[int], root: Path) -> pd.DataFrame:
    """Round time of the adaptive preset at ε 8 with k = 0 and k = 100, interleaved."""
    rows = []
    overrides = configurations(8.0)["dp-fedavg-adaptive"]
    for seed in seeds:
        for k in (0, CANARIES):
            cohort = {"dp.num-sampled-clients": round(RATE * (REAL + k))}
            started = time.perf_counter()
            run_dir = run(overrides | cohort, seed, root / "cost", canaries=k)
            rows.append(
                {
                    "canaries": k,
                    "seed": seed,
                    "round-seconds": round_seconds(run_dir),
                    "run-seconds": time.perf_counter() - started,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return pd.DataFrame(rows)


def cost_flwr(seeds: list[int], out: Path) -> pd.DataFrame:
    """The same pair as :func:`cost` through ``flwr run . local-simulation`` (Ray: every
    canary message starts or reuses a ClientApp in a Ray worker, as a real client's)."""
    from lab.launcher import LocalSimulation

    rows = []
    overrides = WORKLOAD | configurations(8.0)["dp-fedavg-adaptive"] | {"fraction-train": RATE}
    with LocalSimulation(num_supernodes=REAL) as sim:
        for seed in seeds:
            for k in (0, CANARIES):
                nodes = REAL + k
                config = overrides | {
                    "seed": seed,
                    "audit.canaries": k,
                    "min-available-nodes": nodes,
                    "dp.num-sampled-clients": round(RATE * nodes),
                    "output-dir": str(out / "flwr-runs"),
                }
                result = sim.run(
                    " ".join(f"{key}={toml_value(v)}" for key, v in config.items()),
                    federation_config=f"num-supernodes={nodes}",
                )
                if result.returncode != 0 or result.run_dir is None:
                    raise RuntimeError(f"flwr run failed:\n{result.output[-3000:]}")
                rows.append(
                    {
                        "canaries": k,
                        "seed": seed,
                        "round-seconds": round_seconds(result.run_dir),
                        "run-seconds": result.seconds,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return pd.DataFrame(rows)


def cost_line(costs: pd.DataFrame, where: str) -> str:
    by_k = costs.groupby("canaries")["round-seconds"].median()
    return (
        f"Round time, {where} (median over seeds of the median of rounds 2-30), adaptive "
        f"preset ε = 8: k = 0: {by_k[0]:.3f} s, k = {CANARIES}: {by_k[CANARIES]:.3f} s "
        f"({by_k[CANARIES] / by_k[0] - 1:+.1%})"
    )


def summarise(runs: pd.DataFrame) -> str:
    lines = [
        "| mechanism | target ε | accountant ε | estimate (mean ± std) | estimate, two "
        "variances | lower bound (max) | bound ≤ ε in every run | accuracy | seeds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for (label, eps), g in runs.groupby(["mechanism", "epsilon-target"], dropna=False, sort=False):
        est, two = g["estimate"].astype(float), g["estimate-two-variances"].astype(float)
        acc = g["accountant-epsilon"]
        accountant = "-" if acc.isna().all() else f"{acc.max():.2f}"
        within = "-" if acc.isna().all() else ("yes" if not g["exceeds"].any() else "**NO**")
        lines.append(
            f"| {label} | {'-' if pd.isna(eps) else f'{eps:g}'} | {accountant} | "
            f"{est.mean():.2f} ± {est.std(ddof=1) if len(est) > 1 else 0:.2f} | "
            f"{two.mean():.2f} ± {two.std(ddof=1) if len(two) > 1 else 0:.2f} | "
            f"{g['lower-bound'].mean():.2f} ({g['lower-bound'].max():.2f}; "
            f"max {g['lower-bound-max'].iloc[0]:.2f}) | {within} | "
            f"{g['accuracy'].mean():.3f} | {len(g)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument(
        "--cost-only", action="store_true", help="only the round-time pairs (cost*.csv)"
    )
    args = parser.parse_args(argv)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    root = args.out / "runs"
    rows = []
    for seed in [] if args.cost_only else args.seeds:
        for label, epsilon, overrides, canaries in trials():
            run_dir = run(overrides, seed, root, canaries)
            doc = json.loads((run_dir / "audit.json").read_text())
            if not label.startswith("reproducible"):
                rows.append(row(label, epsilon, seed, run_dir, doc))
                continue
            rows.append(row(f"{label}, not subtracted", epsilon, seed, run_dir, doc))
            rows.append(row(f"{label}, subtracted by the attacker", epsilon, seed, run_dir,
                            attacked_audit(run_dir)))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if rows:
        pd.DataFrame(rows).to_csv(args.out / "runs.csv", index=False)
    text = [summarise(pd.read_csv(args.out / "runs.csv")), ""]
    if not args.skip_cost:
        costs = cost(args.seeds, args.out)
        costs.to_csv(args.out / "cost.csv", index=False)
        text.append(cost_line(costs, "in process"))
        costs = cost_flwr(args.seeds, args.out)
        costs.to_csv(args.out / "cost-flwr.csv", index=False)
        text.append(cost_line(costs, "flwr run (Ray simulation)"))
    (args.out / "results.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
