"""pfl-research on the shared peer workload, over the same seeds as ``peer_digits.py``.

The peer's published accuracies are one seed each; this
runs the peer's own script (``bench/peers/pfl_digits.py --child``, unchanged, pfl's own
settings) for several seeds so that both systems are compared as mean ± std over the
same seeds on this machine. pfl is not a dependency of the app: install it in a
separate environment and pass its interpreter:

    python -m venv /tmp/pflvenv && /tmp/pflvenv/bin/pip install pfl==0.6.0 torch scikit-learn
    python bench/peer_pfl.py --python /tmp/pflvenv/bin/python --seeds 0 1 2 \\
        --out bench/results/peer-pfl

Design notes: ``docs/notes.md``, ``bench.peer_pfl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "pfl_digits.py"
CELLS = [(100, None), (100, 8.0), (100, 2.0), (1000, None), (1000, 8.0), (1000, 2.0)]


def run_one(python: str, script: Path, n: int, epsilon: float | None, seed: int) -> dict:
    """One child run of the peer's script; its JSON result."""
    args = ["--num-clients", str(n), "--seed", str(seed)]
    if epsilon is None:
        args += ["--dp", "none"]
    else:
        args += ["--dp", "adaptive", "--epsilon", str(epsilon)]
        if (n, epsilon) == (100, 2.0):
            args += ["--indicator-std", "3.0"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        done = subprocess.run(
            [python, str(script), "--child", "--out", str(out), *args],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"pfl run {args} failed:\n{done.stdout}\n{done.stderr}")
        result = json.loads(out.read_text())
    if result["status"] != "ok":
        raise RuntimeError(f"pfl run {args}: {result['status']}")
    return result


def summarise(runs: pd.DataFrame) -> str:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="interpreter with pfl installed")
    parser.add_argument("--script", type=Path, default=PEER_SCRIPT)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, epsilon in CELLS:
        for seed in args.seeds:
            r = run_one(args.python, args.script, n, epsilon, seed)
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
    table = summarise(pd.DataFrame(rows))
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
