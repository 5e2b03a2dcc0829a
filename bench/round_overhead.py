"""A federated PPO round's time outside its clients' ``PPO.learn``, one ClientApp at a
time, with the ServerApp's reply polling as shipped and as it was.

One ClientApp trains at a time (``client-resources-num-cpus`` = the machine's cores),
so a round's wall time is its clients' ``PPO.learn`` one after the other plus what the
app and Flower add: sending the messages (Flower's engine picks them up every 0.1 s),
each client's set-up and reply, the server noticing the last reply, and its
aggregation. The gap per round is ``round-seconds`` (metrics.csv) less the round's
``train-seconds`` (participation.csv), over rounds 2..R.

Two staged copies of the app take turns, run after run:

* ``shipped``: ``strategies.runtime.messaging`` as it is, whose polls for replies back off to
  ``SIMULATION_MAX_POLL`` (0.05 s) in a simulation;
* ``0.5 s``: the same copy with ``SIMULATION_MAX_POLL`` set to ``MAX_POLL`` (0.5 s),
  which every grid used before.

    python bench/round_overhead.py --rounds 6 --local-steps 4096 --repeats 3 \\
        --preset experiments/lunar-fl-lands.toml

Run it from a clean checkout with nothing else running (see bench/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lunar_lands import confidence_interval
from bench.ppo_throughput import federated, federation_arguments, preset_ppo
from lab.launcher import APP_DIR, LocalSimulation, stage_app
from tasks.base import TRAIN_SECONDS

SHIPPED_LINE = "SIMULATION_MAX_POLL = 0.05"


def stage(dest: Path, old_polling: bool) -> Path:
    """The app staged in ``dest``; with ``old_polling``, simulations poll as deployments."""
    stage_app(APP_DIR, dest)
    if old_polling:
        module = dest / "strategies" / "messaging.py"
        text = module.read_text()
        if text.count(SHIPPED_LINE) != 1:
            raise SystemExit(f"{module}: no single line starting {SHIPPED_LINE!r}")
        module.write_text(text.replace(SHIPPED_LINE, "SIMULATION_MAX_POLL = MAX_POLL"))
    return dest


def later_rounds(run_dir: Path) -> pd.DataFrame:
    """Rounds 2..R: each one's wall time (``round-seconds``), its clients' seconds in
    ``PPO.learn`` (``learn``) and the difference (``gap``)."""
    train = pd.read_csv(run_dir / "metrics.csv").query("scope == 'train'").set_index("round")
    learn = pd.read_csv(run_dir / "participation.csv").groupby("round")[TRAIN_SECONDS].sum()
    rounds = pd.DataFrame({"round-seconds": train["round-seconds"], "learn": learn})
    rounds["gap"] = rounds["round-seconds"] - rounds["learn"]
    return rounds.sort_index().iloc[1:]


def gaps(run_dir: Path) -> pd.Series:
    """Per round 2..R, its wall time less its clients' seconds in ``PPO.learn``."""
    return later_rounds(run_dir)["gap"]


def main() -> None:
    parser = federation_arguments(__doc__.split("\n\n")[0], repeats=3)
    args = parser.parse_args()
    args.ppo = preset_ppo(args.preset)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop the SuperLink
    cpus = os.cpu_count() or 1  # a ClientApp of every core: one at a time
    per_round: dict[str, list[float]] = {"shipped": [], "0.5 s": []}
    shares: dict[str, list[float]] = {"shipped": [], "0.5 s": []}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(args.repeats):
            # the two take turns going first
            order = ["shipped", "0.5 s"] if repeat % 2 == 0 else ["0.5 s", "shipped"]
            for way in order:
                with tempfile.TemporaryDirectory() as app, LocalSimulation() as sim:
                    row = federated(sim, args, cpus, out, app=stage(Path(app), way == "0.5 s"))
                rounds = later_rounds(row["run-dir"])
                gap = rounds["gap"]
                seconds = rounds["round-seconds"].sum()
                per_round[way] += gap.tolist()
                shares[way].append(gap.sum() / seconds)
                print(
                    f"repeat {repeat + 1}/{args.repeats}, {way}: outside PPO.learn "
                    f"{gap.mean():.3f} s a round ({gap.sum() / seconds:.1%} of rounds 2.."
                    f"{args.rounds}); per round {', '.join(f'{g:.2f}' for g in gap)}",
                    flush=True,
                )
    print("\n| polling | rounds | outside `PPO.learn`, s a round | share of the round |")
    print("| --- | ---: | ---: | ---: |")
    for way in per_round:
        mean, half = confidence_interval(per_round[way])
        share, share_half = confidence_interval(shares[way])
        print(
            f"| {way} | {len(per_round[way])} | {mean:.3f} ± {half:.3f} "
            f"(median {np.median(per_round[way]):.3f}) | {share:.1%} ± {share_half:.1%} |"
        )


if __name__ == "__main__":
    main()
