"""Whether this machine's cores are independent: plain SB3 PPO pinned to one core, with
the other cores idle and with a busy loop on each of them.

`bench/ppo_throughput.py` compares ClientApps with plain SB3 alone on the machine. That
comparison assumes that what runs on the other cores (the simulation's own processes,
another ClientApp) does not slow the core SB3 runs on. On a VM whose vCPUs share a
physical core, or a host budget, it does; this bench measures by how much, alternating
idle and busy so that both see the same minutes of the host. One busy loop per other
core: a Python ``while True: pass`` pinned there (``taskset``), which touches no memory,
so what it costs SB3 is the core's own share, not caches or memory bandwidth.

    python bench/core_independence.py --repeats 5 --preset experiments/lunar-fl-lands.toml

Run it from a clean checkout (``git worktree add /tmp/wt HEAD``, then
``PYTHONPATH=/tmp/wt python bench/...`` from ``/tmp/wt``) with nothing else running.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ppo_throughput import preset_ppo, standalone_steps_per_second

SPIN = "while True: pass"


def measure(steps: int, ppo: dict, busy: bool, seed: int) -> float:
    """Plain SB3's steps/s on core 0, the other cores idle or each running a busy loop."""
    others = sorted(os.sched_getaffinity(0) - {0})
    spins = (
        [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", SPIN]) for c in others]
        if busy
        else []
    )
    try:
        time.sleep(0.5)  # the loops are running before the clock starts
        _, rate, _ = standalone_steps_per_second(steps, 4, seed, 1, ppo)
    finally:
        for spin in spins:
            spin.kill()
            spin.wait()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", type=Path, help="take the ppo.* settings from this preset")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or 0 not in os.sched_getaffinity(0):
        raise SystemExit("core_independence: needs core 0 and at least one other core")
    os.sched_setaffinity(0, {0})  # SB3 (this process) on core 0 only
    ppo = preset_ppo(args.preset)
    idle, busy = [], []
    for repeat in range(args.repeats):
        idle.append(measure(args.steps, ppo, False, args.seed))
        busy.append(measure(args.steps, ppo, True, args.seed))
        print(
            f"#{repeat} plain SB3 on core 0: {idle[-1]:.0f} steps/s with the other cores "
            f"idle, {busy[-1]:.0f} with a busy loop on each ({busy[-1] / idle[-1]:.2f})",
            flush=True,
        )
    ratios = np.asarray(busy) / np.asarray(idle)
    print("\n| other cores | steps/s, median | busy / idle, per repeat | median |")
    print("| --- | ---: | --- | ---: |")
    print(f"| idle | {np.median(idle):.0f} | | |")
    shown = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"| a busy loop each | {np.median(busy):.0f} | {shown} | {np.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
