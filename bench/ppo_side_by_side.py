"""Federated PPO against plain SB3 PPO on the same work, with the machine's speed
measured throughout on a core of its own.

`bench/ppo_throughput.py` compares runs taken minutes apart, and this VM's speed moves
between them: the same PPO client-round, repeated three times in one ClientApp process
within a minute, took 7.5, 5.4 and 5.6 s (a scratch probe, 22:20 UTC 2026-11-27). Its
ratios are ratios of two moments. This bench divides the moment out.

* A speedometer: plain SB3 PPO learns on core B for the whole repeat, the same work
  over and over (``--speedometer-steps`` steps of the moon client from a fresh PPO with
  the same seed, built as the clients build theirs, the preset's ``ppo.*`` settings,
  one torch thread). Its steps/s inside ``PPO.learn``, between rollouts that start
  within a window, is how fast the machine ran in that window.
* The federated run on core A: ``flwr run``, the local SuperLink, the ServerApp, Ray's
  processes and every ClientApp, all children of this process pinned there (the bench
  checks each ClientApp it sees). ``clients-per-round`` clients a round, one ClientApp
  at a time (``client-resources-num-cpus`` = the machine's cores), each learning on one
  torch thread (``ppo.torch-threads``' default). Its throughput is rounds 2..R's env
  steps over their wall time (round 1 also pays Ray's start-up and the ClientApps'
  imports), as `bench/ppo_throughput.py` reports it, so the simulation's own processes
  are paid for on the ClientApps' core.
* Plain SB3 on the same work, on core A right after: the run's client-rounds again,
  outside Ray (`bench/ppo_throughput.py`'s replay: the weights each round sent, the
  seeds and kept Adam state of its ClientApps, through the same ``task.train``: the
  same episodes where PPO is deterministic, and the bench counts the client-rounds
  that match), one after another, nothing else on core A.

The goal's ratio, per repeat: the federated throughput over the replay's speed in
``PPO.learn``, each first divided by the speedometer's speed in its own window (the
run's rounds 2..R; the whole replay, its start-up included). That is
plain SB3 doing the same PPO work on the same core, with the machine's drift between
the two windows divided out. Also reported: the same for the ClientApps' speed inside
``PPO.learn`` (what the simulation's own processes take from a ClientApp's core while
it learns), the share of the run's time in ``PPO.learn``, and the federated throughput
against the speedometer at the same moment (other work: the moon client alone, from
scratch). Cores A and B swap between repeats, in case they differ.

``--apart`` moves each ClientApp's threads to core A as the bench sees them (within a
second of their start) and leaves the simulation's own processes on core B, with no
speedometer: what the ClientApps' PPO does when nothing shares its core. The machine's
drift between run and replay then stays in the ratio.

    python bench/ppo_side_by_side.py --rounds 4 --local-steps 16384 --repeats 6 \\
        --preset experiments/lunar-fl-lands.toml
    python bench/ppo_side_by_side.py --rounds 4 --local-steps 16384 --repeats 4 \\
        --preset experiments/lunar-fl-lands.toml --apart

`bench/ppo_twin.py` leaves no time between the two sides instead: each client-round's
twin learns within seconds of it, on its core.

Run it from a clean checkout (``git worktree add /tmp/wt HEAD``, then
``PYTHONPATH=/tmp/wt python bench/...`` from ``/tmp/wt``) with nothing else running,
on a machine with at least two cores.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import pandas as pd
from stable_baselines3.common.callbacks import BaseCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lunar_lands import confidence_interval
from bench.ppo_throughput import (
    federated,
    federation_arguments,
    preset_ppo,
    replay,
    standalone_steps_per_second,
)
from lab.launcher import LocalSimulation


class RolloutClock(BaseCallback):
    """(chunk, wall time, env steps) at each rollout's start, a chunk per ``learn``."""

    def __init__(self, marks: list) -> None:
        super().__init__()
        self.marks, self.chunk = marks, 0

    def _on_training_start(self) -> None:
        self.chunk += 1

    def _on_rollout_start(self) -> None:
        self.marks.append((self.chunk, time.time(), self.model.num_timesteps))

    def _on_step(self) -> bool:
        return True


def speedometer(core: int, steps: int, args: dict, stop, out) -> None:
    """Plain SB3 on ``core``: ``steps`` steps from a fresh PPO, again and again, until
    ``stop`` (the chunk under way finishes); its rollout marks into ``out``."""
    os.sched_setaffinity(0, {core})
    marks: list = []
    clock = RolloutClock(marks)
    while not stop.is_set():
        standalone_steps_per_second(
            steps, args["n_envs"], args["seed"], 1, args["ppo"], callback=clock
        )
    out.put(marks)


def rate_within(marks: list, start: float, end: float) -> tuple[float, float]:
    """Env steps and seconds inside ``PPO.learn`` between consecutive rollout starts of
    one chunk that both lie within [start, end]."""
    steps = seconds = 0.0
    for (c0, t0, n0), (c1, t1, n1) in itertools.pairwise(marks):
        if c0 == c1 and start <= t0 and t1 <= end:
            steps += n1 - n0
            seconds += t1 - t0
    return steps, seconds


def _process_name(pid: str) -> str:
    """A short name: Ray's ``ray::X`` title, else the script a Python runs (its first
    ``.py`` or ``bin/`` argument), else the program."""
    words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if not words[0].strip():  # a kernel thread
        return f"[{Path(f'/proc/{pid}/comm').read_text().strip()}]"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0].split()[0]
    program = Path(words[0].split()[0]).name
    if program.startswith("python"):
        scripts = [w for w in words[1:] if w.endswith(".py") or "bin/" in w]
        return Path(scripts[0]).name if scripts else program
    return program


def _move_threads(pid: str, core: int) -> None:
    """Every thread of process ``pid`` onto ``core`` (``--apart``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        if os.sched_getaffinity(int(tid)) != {core}:
            os.sched_setaffinity(int(tid), {core})


def watch(
    core: int, snapshots: list, seen: dict, done: threading.Event, move: bool = False
) -> None:
    """Every second while the run lasts: the CPU time (user + system, in clock ticks) of
    each process that may run on ``core`` and, for ClientApp processes, the CPUs they
    may run on; with ``move``, each ClientApp's threads moved onto ``core`` first."""
    while not done.wait(1.0):
        now, cpu = time.time(), {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                name = _process_name(pid)
                clientapp = name == "ray::ClientAppActor"
                if clientapp and move:
                    _move_threads(pid, core)
                allowed = sorted(os.sched_getaffinity(int(pid)))
                if core not in allowed:
                    continue  # the speedometer, or (--apart) the simulation's processes
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                cpu[pid] = (name, int(fields[11]) + int(fields[12]))
                if clientapp:
                    seen[int(pid)] = allowed
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
        snapshots.append((now, cpu))


def cpu_shares(snapshots: list, start: float, end: float) -> dict[str, float]:
    """Each process name's CPU time between the first and the last snapshot within
    [start, end], as a share of that time (processes alive at both)."""
    inside = [snap for snap in snapshots if start <= snap[0] <= end]
    if len(inside) < 2:
        return {}
    (t0, first), (t1, last) = inside[0], inside[-1]
    ticks = os.sysconf("SC_CLK_TCK")
    shares: dict[str, float] = {}
    for pid, (name, used) in last.items():
        if pid in first:
            shares[name] = shares.get(name, 0.0) + (used - first[pid][1]) / ticks / (t1 - t0)
    return dict(sorted(shares.items(), key=lambda item: -item[1]))


def window(run_dir: Path) -> tuple[float, float]:
    """Wall times of the end of round 1's training and of the last round's."""
    started = json.loads((run_dir / "config.json").read_text())["started-at"]
    origin = datetime.fromisoformat(started).timestamp()
    train = pd.read_csv(run_dir / "metrics.csv").query("scope == 'train'").sort_values("round")
    elapsed = train["elapsed-s"].to_numpy()
    return origin + elapsed[0], origin + elapsed[-1]


def machine_speed(marks: list, start: float, end: float, what: str) -> float:
    """The speedometer's steps/s within [start, end] (``what`` names the window), if it
    learned for at least half of it."""
    steps, seconds = rate_within(marks, start, end)
    if seconds < 0.5 * (end - start):
        raise SystemExit(
            f"the speedometer learned only {seconds:.0f} s of the {end - start:.0f} s of {what}"
        )
    return steps / seconds


def one_repeat(args, core_a: int, core_b: int, out: str) -> dict:
    """One federated run and its replay on ``core_a``; the speedometer on ``core_b``, or
    with ``args.apart`` the simulation's own processes there instead."""
    context = multiprocessing.get_context("spawn")
    stop, marks = context.Event(), context.Queue()
    settings = {"n_envs": args.n_envs, "seed": args.seed, "ppo": args.ppo}
    meter = None
    if not args.apart:
        meter = context.Process(
            target=speedometer, args=(core_b, args.speedometer_steps, settings, stop, marks)
        )
        meter.start()
    everyone = os.sched_getaffinity(0)
    # the simulation's processes inherit this; the replay runs on core A
    os.sched_setaffinity(0, {core_b if args.apart else core_a})
    seen: dict = {}
    snapshots: list = []
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(core_a, snapshots, seen, done, args.apart))
    watcher.start()
    try:
        with LocalSimulation() as sim:
            row = federated(sim, args, os.cpu_count() or 1, out)
        done.set()
        os.sched_setaffinity(0, {core_a})
        replay_start = time.time()
        same = replay(row["run-dir"], 1, os.cpu_count() or 1)
        replay_end = time.time()
    finally:
        done.set()
        watcher.join()
        os.sched_setaffinity(0, everyone)
        stop.set()
    if not seen:
        raise SystemExit("no ClientApp process seen: cannot check where it ran")
    if any(cpus != [core_a] for cpus in seen.values()):
        raise SystemExit(f"a ClientApp ran outside core {core_a}: {seen}")
    fed_start, fed_end = window(row["run-dir"])
    shares = cpu_shares(snapshots, fed_start, fed_end)
    clientapp = shares.pop("ray::ClientAppActor", 0.0)
    if meter is None:  # --apart: the machine's drift stays in the ratio
        during_run = during_replay = float("nan")
        plain = same["learn-rate"]
    else:
        meter_marks = marks.get(timeout=600)
        meter.join()
        during_run = machine_speed(meter_marks, fed_start, fed_end, "the run's rounds 2..R")
        during_replay = machine_speed(meter_marks, replay_start, replay_end, "the replay")
        # plain SB3's speed on the same work, at the machine's speed during the run
        plain = same["learn-rate"] * during_run / during_replay
    return {
        "core A": core_a,
        "federated steps/s": row["steady"],
        "in PPO.learn": row["in-learn"],
        "learn steps/s": row["learn-rate"],
        "replay learn steps/s": same["learn-rate"],
        "speedometer, run": during_run,
        "speedometer, replay": during_replay,
        "ratio": row["steady"] / plain,
        "learn ratio": row["learn-rate"] / plain,
        "against the speedometer": row["steady"] / during_run,
        "identical": f"{same['same']}/{same['client-rounds']}",
        "epochs per rollout": row["epochs"],
        "ClientApp CPU": clientapp,
        "others CPU": sum(shares.values()),
        "busiest others": "; ".join(f"{n} {v:.1%}" for n, v in list(shares.items())[:4]),
    }


def interval(values: np.ndarray) -> str:
    """mean ± the half-width of its 95 % Student t interval (none for one value)."""
    mean, half = confidence_interval(values)
    return f"{mean:.3f}" if len(values) < 2 else f"{mean:.3f} ± {half:.3f}"


def main() -> None:
    parser = federation_arguments(__doc__.split("\n\n")[0], repeats=4)
    parser.add_argument("--speedometer-steps", type=int, default=8192)
    parser.add_argument(
        "--apart",
        action="store_true",
        help="the ClientApps alone on core A, the simulation's own processes on core B "
        "(no speedometer: the ratio keeps the machine's drift between run and replay)",
    )
    args = parser.parse_args()
    args.ppo = preset_ppo(args.preset)
    if args.ppo.get("ppo.torch-threads", 1) != 1:
        raise SystemExit("the replay and the speedometer learn on one torch thread")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one for the runs, one for the speedometer")
    if args.apart and args.repeats % 2:
        raise SystemExit("--apart: an even --repeats, so that both cores run both sides")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop the SuperLink
    rows = []
    with TemporaryDirectory() as out:
        for repeat in range(args.repeats):
            core_a, core_b = cores[repeat % 2], cores[1 - repeat % 2]
            row = one_repeat(args, core_a, core_b, f"{out}/{repeat}")
            rows.append(row)
            print(
                f"#{repeat} core {core_a}: federated {row['federated steps/s']:.0f} steps/s "
                f"(rounds 2..{args.rounds}; {row['in PPO.learn']:.1%} in PPO.learn, at "
                f"{row['learn steps/s']:.0f}), the same client-rounds replayed "
                f"{row['replay learn steps/s']:.0f} ({row['identical']} identical); "
                + (
                    f"the simulation's own processes on core {core_b}; "
                    if args.apart
                    else f"speedometer on core {core_b}: {row['speedometer, run']:.0f} during "
                    f"the run, {row['speedometer, replay']:.0f} during the replay; "
                )
                + f"ratio "
                f"{row['ratio']:.3f} (in PPO.learn {row['learn ratio']:.3f}); core {core_a}'s "
                f"time, rounds 2..{args.rounds}: ClientApp {row['ClientApp CPU']:.1%}, the "
                f"rest {row['others CPU']:.1%} ({row['busiest others']})",
                flush=True,
            )
    table = pd.DataFrame(rows)
    print()
    print(table.to_csv(index=False, float_format="%.4g"))
    print(
        f"ratio (the goal's): median {table['ratio'].median():.3f}, mean "
        f"{interval(table['ratio'].to_numpy())} (95 % t over {len(table)} repeats); "
        f"in PPO.learn: median {table['learn ratio'].median():.3f}, mean "
        f"{interval(table['learn ratio'].to_numpy())}; share of the run in PPO.learn: "
        f"median {table['in PPO.learn'].median():.1%}"
    )


if __name__ == "__main__":
    main()
