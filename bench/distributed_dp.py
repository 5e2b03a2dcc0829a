"""Central DP against distributed DP (SecAgg+ and Skellam) at the same ε, in process.

Each preset (``experiments/*.toml``) is fused with ``pyproject.toml``'s defaults as
``flwr run --run-config preset.toml`` does, given ``seed`` and ``min-available-nodes`` =
``--nodes``, and run by the app's own ServerApp loop against the real ClientApp in this
process (``tests/inprocess.py``: one Context per node, ``--nodes`` of them). Printed per
run: the final central accuracy, the ledger's ε and calibrated z, the seconds taken; then
a markdown table of the means. Results: bench/BENCHMARKS.md, "What does holding ε
against the server itself cost".

Reproduce from the repository root::

    PYTHONPATH=. python bench/distributed_dp.py --seeds 0 1 2 3 \\
        --presets experiments/digits-dp-eps8.toml experiments/digits-secagg-dp-eps8.toml
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import pandas as pd
from flwr.common.config import flatten_dict, fuse_dicts
from flwr.supercore.task_identity import TaskIdentity

from tests.inprocess import InProcessGrid, run_server

REPO = Path(__file__).resolve().parents[1]


def run(preset: Path, nodes: int, seed: int, out: Path, **extra) -> dict:
    """One run of ``preset``: its final central accuracy, ε, z and wall time."""
    defaults = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    config = fuse_dicts(defaults["config"], flatten_dict(tomllib.loads(preset.read_text())))
    config.update({"output-dir": str(out), "seed": seed, "min-available-nodes": nodes, **extra})
    grid = InProcessGrid(config, list(range(1000, 1000 + nodes)))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", type=Path, required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=100)
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    rows = []
    for preset in args.presets:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as out:
                rows.append(run(preset, args.nodes, seed, Path(out)))
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


if __name__ == "__main__":
    main()
