"""Byzantine clients against each aggregation rule, on digits.

20 clients, all training every round, 20 rounds; 0, 1, 2 or 4 adversaries, each attack
on its own: ``zero-huge`` (an all-zero model claiming 999 999 999 examples),
``sign-flip`` (the honest update x -10) and ``noise`` (N(0, 1) on every weight). Every
``aggregation.rule`` runs with the default weight and update-norm bounds;
``mean-unbounded`` is the mean with both off. Robust rules are set for f = 4. Central
test accuracy after round 20, the mean over ``--seeds``; each run is the real ServerApp
against the real ClientApp in one process, an adversary's reply rewritten before the
server sees it (docs/robustness.md has the threat model).

    python bench/byzantine.py --out bench/results/byzantine --seeds 42 0
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
sys.path.insert(0, str(REPO))  # tests.inprocess

from flwr.app import Array, ArrayRecord, Message  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from protocol import keys  # noqa: E402
from strategies.runtime.partitions import QUERY_TYPE  # noqa: E402
from tests.inprocess import InProcessGrid, run_config, run_server  # noqa: E402

NUM_CLIENTS = 20
HUGE = 999_999_999
ATTACKS = ("zero-huge", "sign-flip", "noise")
ADVERSARIES = (1, 2, 4)
RULES = ("mean", "median", "trimmed-mean", "krum", "multi-krum", "bulyan", "mean-unbounded")
WORKLOAD = {
    "task": "digits",
    "vision.model": "mlp",
    "num-server-rounds": 20,
    "fraction-train": 1.0,
    "min-train-nodes": NUM_CLIENTS,
    "min-available-nodes": NUM_CLIENTS,
    "fraction-evaluate": 0.0,
    "central-eval": True,
    "round-timeout": 60.0,
    "aggregation.num-byzantine": 4,
    "aggregation.trim-fraction": 0.2,
    "run.divergence-factor": 0.0,  # a poisoned model is measured, not stopped
    "run.max-failed-rounds": 0,
}


def poison(reply: Message, sent: Message, attack: str, rng: np.random.Generator) -> Message:
    """``reply`` rewritten by ``attack`` (module docstring), in place."""
    received = sent.content[keys.ARRAYS]
    trained = reply.content[keys.ARRAYS]
    out = {}
    for key in received:
        base, mine = received[key].numpy(), trained[key].numpy()
        if attack == "zero-huge":
            value = np.zeros_like(mine)
        elif attack == "sign-flip":
            value = base - 10.0 * (mine - base)
        else:
            value = base + rng.normal(size=base.shape)
        out[key] = Array(np.asarray(value, dtype=mine.dtype))
    reply.content[keys.ARRAYS] = ArrayRecord(out)
    if attack == "zero-huge":
        reply.content[keys.METRICS][keys.NUM_EXAMPLES] = HUGE
    return reply


class ByzantineGrid(InProcessGrid):
    """The in-process federation, with ``adversaries`` rewriting their train replies."""

    def __init__(self, config: dict, node_ids: list[int], adversaries: set[int], attack: str):
        super().__init__(config, node_ids)
        self.adversaries, self.attack = adversaries, attack
        self.rng = np.random.default_rng(0)  # the attack's noise: one draw for every seed

    def _answer(self, message: Message, context) -> Message:
        reply = super()._answer(message, context)
        node = message.metadata.dst_node_id
        if node not in self.adversaries or reply.has_error():
            return reply
        if message.metadata.message_type == "train":
            poison(reply, message, self.attack, self.rng)
        elif message.metadata.message_type == QUERY_TYPE and self.attack == "zero-huge":
            reply.content[keys.METRICS][keys.NUM_EXAMPLES] = HUGE  # a lie from the start
        return reply


def run_one(
    rule: str,
    attack: str,
    num_adversaries: int,
    root: Path,
    seed: int = 0,
    extra: dict | None = None,
) -> dict:
    """One run; its final central accuracy and what participation.csv noted."""
    overrides = {**WORKLOAD, "output-dir": str(root), "seed": seed, **(extra or {})}
    if rule == "mean-unbounded":
        overrides |= {
            "aggregation.rule": "mean",
            "aggregation.max-weight-share": 1.0,
            "aggregation.max-update-norm": 0.0,
        }
    else:
        overrides["aggregation.rule"] = rule
    config = run_config(**overrides)
    nodes = list(range(1, NUM_CLIENTS + 1))
    grid = ByzantineGrid(config, nodes, set(nodes[:num_adversaries]), attack)
    before = set(root.iterdir()) if root.exists() else set()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    started = time.perf_counter()
    run_server(config, grid)
    seconds = time.perf_counter() - started
    (run_dir,) = set(root.iterdir()) - before
    metrics = pd.read_csv(run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    participation = pd.read_csv(run_dir / "participation.csv")
    noted = int(participation["note"].notna().sum()) if "note" in participation else 0
    row = {
        "rule": rule,
        "attack": attack if num_adversaries else "none",
        "adversaries": num_adversaries,
        "seed": seed,
        "accuracy": round(float(central["eval-accuracy"].iloc[-1]), 4),
        "rounds": int(central.index.max()),
        "noted-replies": noted,
        "seconds": round(seconds, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def table(rows: pd.DataFrame) -> str:
    """Accuracy by (attack, adversaries) x rule (the mean over seeds), markdown."""
    order = {attack: i for i, attack in enumerate(("none", *ATTACKS))}
    rows = rows.assign(scenario=rows["attack"] + " x" + rows["adversaries"].astype(str))
    rows = rows.sort_values(["attack", "adversaries"], key=lambda c: c.map(order).fillna(c))
    pivot = rows.pivot_table(index="scenario", columns="rule", values="accuracy", sort=False)
    pivot = pivot[[r for r in RULES if r in pivot.columns]]
    lines = ["| attack x adversaries | " + " | ".join(pivot.columns) + " |"]
    lines.append("|---" * (len(pivot.columns) + 1) + "|")
    for scenario, values in pivot.iterrows():
        cells = ("" if np.isnan(v) else f"{v:.3f}" for v in values)
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)  # the ClientApps train one after the other; 2 shared cores
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/byzantine")
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--adversaries", nargs="+", type=int, default=[0, *ADVERSARIES])
    parser.add_argument("--rounds", type=int, default=WORKLOAD["num-server-rounds"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[42])  # pyproject's seed
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="run-config overrides"
    )
    args = parser.parse_args()
    extra = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    WORKLOAD["num-server-rounds"] = args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    scenarios = [("none", 0)] if 0 in args.adversaries else []
    scenarios += [(a, k) for a in args.attacks for k in args.adversaries if k]
    rows = []
    for seed in args.seeds:
        for attack, k in scenarios:
            for rule in args.rules:
                rows.append(run_one(rule, attack, k, runs, seed, extra))
                frame = pd.DataFrame(rows)
                frame.to_csv(args.out / "results.csv", index=False)
                (args.out / "results.md").write_text(table(frame) + "\n")
    print(table(pd.DataFrame(rows)))


if __name__ == "__main__":
    main()
