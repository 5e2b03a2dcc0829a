"""Federated PPO against plain SB3 PPO on the same work, at the same moment, on the same
core: every client-round trained twice, by its ClientApp and by a plain process.

`bench/ppo_side_by_side.py` replays a run after it, and divides both windows by a
speedometer on the other core. On this VM the two cores do not drift together closely
enough: the correction barely narrowed the spread (its six repeats: 0.75 to 1.08 before
it, 0.70 to 0.94 after). Here nothing is divided out. Each client-round's twin learns
within seconds of it, on its core:

* The whole simulation is pinned to one core (``flwr run``, the SuperLink, the
  ServerApp, Ray and every ClientApp; cores swap between repeats), one ClientApp at a
  time (``client-resources-num-cpus`` = the machine's cores).
* Its ClientApp is the app's own with `LunarLanderTask.train` wrapped
  (`bench/twin_clientapp.py`, named in the staged app's ``pyproject.toml``): before each
  client-round, deep copies of its inputs go to the ClientApp's twin, a plain Python
  process it started, which makes the same ``task.train`` call (the same episodes where
  PPO is deterministic; the bench counts those that match). The two take turns going
  first, so a drift within a pair cancels over pairs.

The goal's ratio, per repeat: plain SB3's speed (the twins' env steps over their
seconds in ``PPO.learn``, rounds 2..R) against the federated run's throughput (the same
steps over rounds 2..R's wall time, less what the pairing added to it: the copies and
the twins' calls), so the simulation's own processes and the ClientApp's work outside
``PPO.learn`` count against it. Also reported, what the ratio is made of: the ClientApp's speed
inside ``PPO.learn`` over its twin's (geometric mean over client-rounds, with a 95 %
interval over all repeats' pairs), and the share of the run's wall time the ClientApp
spends in ``PPO.learn``.

    python bench/ppo_twin.py --rounds 6 --local-steps 16384 --repeats 8 \\
        --preset experiments/lunar-fl-lands.toml

``--at-once`` measures the preset's own layout instead: ClientApps of one CPU, as many
training at once as there are cores, nothing pinned, a round's clients queued on them
by Ray. Twins then overlap other ClientApps' training, so the run's wall time cannot
be split between the two. Each repeat makes two runs of the same seeded work: the
app's own, whose clock gives each process's share of rounds 2..R in ``PPO.learn`` (the
rest is the app's work and the wait for the round's slowest client), and one with
twins, which gives the ClientApps' seconds in ``PPO.learn`` against their twins'. The
ratio is the product of the two:

    python bench/ppo_twin.py --rounds 3 --clients-per-round 6 --local-steps 16384 \\
        --repeats 3 --preset experiments/lunar-fl-lands.toml --at-once

``--control`` checks the bench itself: the ClientApp's side of each pair is played by a
second twin, fed the same pickled call as the first (`bench/twin_clientapp.py`'s
``control_app``; the ClientApp trains nothing). Both sides are then the same kind of
process fed the same way, so their speeds in ``PPO.learn`` should agree; what the ratio
reads is the pairing's own bias (turns, order of creation, the core's moments):

    python bench/ppo_twin.py --rounds 6 --local-steps 16384 --repeats 4 \\
        --preset experiments/lunar-fl-lands.toml --control

Run it from a clean checkout (``git worktree add /tmp/wt HEAD``, then
``PYTHONPATH=/tmp/wt python bench/...`` from ``/tmp/wt``) with nothing else running.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lunar_lands import confidence_interval
from bench.ppo_side_by_side import window
from bench.ppo_throughput import federated, federation_arguments, preset_ppo
from lab.launcher import APP_DIR, LocalSimulation, stage_app
from tasks.base import NUM_EXAMPLES, TRAIN_REWARD, TRAIN_SECONDS
from tasks.lunar_lander.task import TRAIN_EPISODES


def twin_lines(component: str) -> dict[str, str]:
    """The staged pyproject.toml's lines, and what replaces them."""
    return {
        'clientapp = "client_app.app:app"': f'clientapp = "bench.twin_clientapp:{component}"',
        "fab-include = [": 'fab-include = [\n    "bench/twin_clientapp.py",',  # shipped too
    }


def stage_twin_app(dest: Path, component: str = "app") -> Path:
    """The app staged in ``dest`` with `bench/twin_clientapp.py`'s ``component`` as its
    ClientApp (``control_app``: the bench's control)."""
    stage_app(APP_DIR, dest)
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    for line, twin in twin_lines(component).items():
        if text.count(line) != 1:
            raise SystemExit(f"{pyproject}: no single line {line!r} to replace")
        text = text.replace(line, twin)
    pyproject.write_text(text)
    return dest


def pairs(run_dir: Path) -> pd.DataFrame:
    """The run's client-rounds, each with its twin's (``clients/twin-*.json``)."""
    rows = []
    for path in sorted((run_dir / "clients").glob("twin-round-*-partition-*.json")):
        record = json.loads(path.read_text())
        ours, theirs = record["clientapp"], record["twin"]

        def played(side: dict) -> tuple:
            return side["metrics"][TRAIN_EPISODES], side["metrics"].get(TRAIN_REWARD)

        rows.append(
            {
                "round": record["round"],
                "partition": record["partition"],
                "first": record["first"],
                "steps": ours["metrics"][NUM_EXAMPLES],
                "clientapp-learn": ours["metrics"][TRAIN_SECONDS],
                "twin-learn": theirs["metrics"][TRAIN_SECONDS],
                "same": played(ours) == played(theirs),
                "added": record["added-seconds"],
                "clientapp-cpu": tuple(ours["cpu"]),
                "twin-cpu": tuple(theirs["cpu"]),
            }
        )
    if not rows:
        raise SystemExit(f"{run_dir}: no twin records: did bench.twin_clientapp run?")
    return pd.DataFrame(rows).sort_values(["round", "partition"], ignore_index=True)


def summary(paired: pd.DataFrame, seconds: float) -> dict:
    """The goal's ratio over rounds 2..R, whose wall time is ``seconds``, and its two
    factors (see the module's docstring)."""
    later = paired[paired["round"] > paired["round"].min()]
    run_seconds = seconds - later["added"].sum()  # the federated run's own
    plain_seconds = later["twin-learn"].sum()
    speed = later["twin-learn"] / later["clientapp-learn"]  # ClientApp's over twin's
    return {
        "ratio": plain_seconds / run_seconds,
        "learn-ratio": float(np.exp(np.log(speed).mean())),
        "in-learn": later["clientapp-learn"].sum() / run_seconds,
        "run-rate": later["steps"].sum() / run_seconds,
        "plain-rate": later["steps"].sum() / plain_seconds,
        "same": int(later["same"].sum()),
        "client-rounds": len(later),
    }


def one_repeat(args, core: int, out: str) -> tuple[dict, pd.DataFrame]:
    """One federated run with twins, everything pinned to ``core``."""
    everyone = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # the simulation's processes inherit it
    try:
        with tempfile.TemporaryDirectory() as app, LocalSimulation() as sim:
            staged = stage_twin_app(Path(app), "control_app" if args.control else "app")
            row = federated(sim, args, os.cpu_count() or 1, out, app=staged)
    finally:
        os.sched_setaffinity(0, everyone)
    paired = check_count(args, pairs(row["run-dir"]))
    cpus = set(paired["clientapp-cpu"]) | set(paired["twin-cpu"])
    if cpus != {(core,)}:
        raise SystemExit(f"a ClientApp or twin ran outside core {core}: {sorted(cpus)}")
    start, end = window(row["run-dir"])
    return {**summary(paired, end - start), "core": core, "epochs": row["epochs"]}, paired


def at_once_repeat(args, out: str) -> tuple[dict, pd.DataFrame]:
    """``--at-once``: two runs of the same seeded work, nothing pinned, ClientApps of one
    CPU, as many at once as there are cores. The app's own run gives each process's
    share of rounds 2..R in ``PPO.learn`` (from its own clock: the rest is the app's
    work and the wait for the round's slowest client); the run with twins gives the
    ClientApps' time in ``PPO.learn`` against their twins'. The ratio is their product:
    plain SB3's time for the work over the run's."""
    with LocalSimulation() as sim:
        own = federated(sim, args, 1, out)
    with tempfile.TemporaryDirectory() as app, LocalSimulation() as sim:
        twinned = federated(sim, args, 1, out, app=stage_twin_app(Path(app)))
    paired = check_count(args, pairs(twinned["run-dir"]))
    later = paired[paired["round"] > paired["round"].min()]
    speed = later["twin-learn"] / later["clientapp-learn"]
    factor = later["twin-learn"].sum() / later["clientapp-learn"].sum()
    processes = min(os.cpu_count() or 1, args.clients_per_round)
    row = {
        "ratio": own["in-learn"] * factor,
        "learn-ratio": float(np.exp(np.log(speed).mean())),
        "in-learn": own["in-learn"],
        "waiting": own["waiting"],
        "run-rate": own["steady"] / processes,
        "plain-rate": later["steps"].sum() / later["twin-learn"].sum(),
        "same": int(later["same"].sum()),
        "client-rounds": len(later),
        "core": "all",
        "epochs": own["epochs"],
    }
    return row, paired


def check_count(args, paired: pd.DataFrame) -> pd.DataFrame:
    """``paired``, if it holds every client-round of the run."""
    expected = args.rounds * args.clients_per_round
    if len(paired) != expected:
        raise SystemExit(f"{len(paired)} twin records, {expected} client-rounds")
    return paired


def main() -> None:
    parser = federation_arguments(__doc__.split("\n\n")[0], repeats=4)
    parser.add_argument("--out", type=Path, help="keep the federated runs' directories here")
    parser.add_argument(
        "--at-once",
        action="store_true",
        help="ClientApps of one CPU, as many at once as cores, nothing pinned",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="the bench's control: the ClientApp's side of each pair is a second twin "
        "(the ratio inside PPO.learn is then the pairing's own bias; one ClientApp at a time)",
    )
    args = parser.parse_args()
    if args.control and args.at_once:
        parser.error("--control runs one ClientApp at a time: leave out --at-once")
    args.ppo = preset_ppo(args.preset)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores: the simulation pinned to one, the bench on another")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop the SuperLink
    rows, all_pairs = [], []
    with tempfile.TemporaryDirectory() as scratch:
        out = str(args.out or scratch)
        for repeat in range(args.repeats):
            if args.at_once:
                row, paired = at_once_repeat(args, out)
            else:
                row, paired = one_repeat(args, repeat % 2, out)
            rows.append(row)
            all_pairs.append(paired.assign(repeat=repeat))
            waiting = row.get("waiting", 0.0)  # one ClientApp at a time: none
            if args.control:  # nothing federated was trained: only the pairs mean anything
                print(
                    f"repeat {repeat + 1}/{args.repeats}, core {row['core']}: in PPO.learn "
                    f"the second twin at {row['learn-ratio']:.2f} of the twin's speed; "
                    f"{row['same']}/{row['client-rounds']} client-rounds played the same "
                    "episodes",
                    flush=True,
                )
                continue
            print(
                f"repeat {repeat + 1}/{args.repeats}, cores {row['core']}: "
                f"ratio {row['ratio']:.2f} (per process: federated {row['run-rate']:.0f} "
                f"steps/s{', the run without twins' if args.at_once else ''}, plain SB3 "
                f"{row['plain-rate']:.0f}); in PPO.learn the ClientApp at "
                f"{row['learn-ratio']:.2f} of its twin's speed, there {row['in-learn']:.1%} "
                f"of the run{f' ({waiting:.1%} waiting)' if np.isfinite(waiting) else ''}; "
                f"{row['same']}/{row['client-rounds']} "
                f"client-rounds played the same episodes; {row['epochs']:.2f} epochs/rollout",
                flush=True,
            )
    pooled = pd.concat(all_pairs)
    later = pooled[pooled["round"] > pooled["round"].min()]
    logs = np.log(later["twin-learn"] / later["clientapp-learn"])
    learn, learn_half = confidence_interval(logs)
    if args.control:  # no federated training ran: only the pairing's bias means anything
        print(
            f"\ncontrol: second twin / twin in PPO.learn {np.exp(learn):.2f} "
            f"[{np.exp(learn - learn_half):.2f}, {np.exp(learn + learn_half):.2f}] over "
            f"{len(later)} client-rounds (1: the pairing favours neither side)"
        )
        return
    ratio, ratio_half = confidence_interval([r["ratio"] for r in rows])
    share, share_half = confidence_interval([r["in-learn"] for r in rows])
    print(
        f"\n| {args.repeats} repeats | federated / plain SB3 | ClientApp / twin in PPO.learn "
        f"({len(later)} client-rounds) | share in PPO.learn |\n|---|---:|---:|---:|\n"
        f"| mean, 95 % interval | {ratio:.2f} ± {ratio_half:.2f} | {np.exp(learn):.2f} "
        f"[{np.exp(learn - learn_half):.2f}, {np.exp(learn + learn_half):.2f}] | "
        f"{share:.1%} ± {share_half:.1%} |"
    )


if __name__ == "__main__":
    main()
