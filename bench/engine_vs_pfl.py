"""The in-process engine against pfl-research on the peer workload, side by side in one
run: warm round and whole process, per (N, DP).

    python bench/engine_vs_pfl.py --python .pfl-venv/bin/python [--sizes 100 1000] \\
        [--dp none adaptive] [--out /tmp/engine-vs-pfl]

Each cell runs the engine (``bench/engine.py``'s run: ``python -m lab.run --engine
inprocess``, 30 rounds, a fresh process) and then the peer's own script
(``bench/peers/pfl_digits.py --child``, unchanged, pfl-research 0.6.0 in its own
environment: ``--python``) back to back, so both see the same load. Warm round: the
engine's median ``round-seconds`` over rounds 2-30, pfl's median round lap; process: wall
seconds of the whole child process (imports, data, calibration included). ``flwr run``
is not in this run (its Ray start-up alone takes minutes on the shared machine):
``bench/engine.py`` and the e2e parity test compare it with the engine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # bench/engine.py
import peer_pfl  # bench/peer_pfl.py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="pfl-research's interpreter")
    parser.add_argument("--script", type=Path, default=peer_pfl.PEER_SCRIPT)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--dp", nargs="+", choices=["none", "adaptive"], default=["none"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-vs-pfl"))
    args = parser.parse_args(argv)
    lines = [
        "| N | per round | DP | engine warm round s | pfl warm round s | ratio "
        "| engine process s | pfl process s | engine acc | pfl acc |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in args.sizes:
        for dp in args.dp:
            ours = engine.one(n, dp == "adaptive", args.rounds, args.out)
            started = time.perf_counter()
            theirs = peer_pfl.run_one(
                args.python, args.script, n, 8.0 if dp == "adaptive" else None, 0
            )
            theirs_s = time.perf_counter() - started
            ratio = ours["warm round s"] / theirs["median_round_seconds"]
            lines.append(
                f"| {n} | {engine.COHORT[n]} | {dp} | {ours['warm round s']:.4f} "
                f"| {theirs['median_round_seconds']:.4f} | {ratio:.1f} "
                f"| {ours['process s']:.1f} | {theirs_s:.1f} | {ours['accuracy']:.3f} "
                f"| {theirs['test_accuracy']:.3f} |"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
