"""Environment steps per second: federated PPO (`flwr run`) vs plain SB3 PPO.

Both sides train SB3's PPO (MlpPolicy, SB3's default hyperparameters, ``n_envs``
DummyVecEnv copies of LunarLander-v3) for the same total number of environment
steps. Plain SB3 trains one policy in this process; the federated run trains
``clients-per-round`` clients per round for ``rounds`` rounds through a private
local SuperLink (Ray simulation), with central and federated evaluation off so that
only training is timed. Two federated throughputs are reported:

* all rounds: total steps / time from the ServerApp's first round to its last;
* steady state: rounds 2..R only (round 1 also pays Ray's actor start-up and each
  actor's first import of torch/SB3).

and each with ``client-resources-num-cpus`` = the machine's cores (one ClientApp at a
time) and = 1 (as many ClientApps at once as there are cores, at most a round's
clients: ``--clients-per-round 1`` leaves that ClientApp a core to spare for the
simulation's own processes). A ClientApp's PPO
learns on ``ppo.torch-threads`` torch threads (the app's default 1; 0: its num-cpus,
which Ray sets as its ``OMP_NUM_THREADS``). Each ClientApp's share of the throughput
is compared with plain SB3 on as many torch threads: alone on the machine, and with as
many plain processes learning at once as ClientApps train at once (one per core),
which share the machine as those ClientApps do. It is also compared with plain SB3
alone on torch's default for the ClientApp's CPUs (one thread per core), what SB3 run
by itself on those cores gets; the goal's ratio is against the faster of the two.

The ratio of the two is a ratio of runs minutes apart. Its two factors are reported
too. The first is measured within each federated run, on its own clock: the share of
each ClientApp process's time that its clients spent in SB3's ``PPO.learn`` (their
``train-seconds``). With a round's clients all training at once, each of them but the
slowest then waits for the slowest (rounds are synchronous), which is split out as
waiting; the rest is what the app adds (messages, building PPO and its environments,
the server's round). These shares hold however fast the machine runs that minute,
which on a shared VM swings by 20 % and more. The second is SB3's speed inside
``PPO.learn`` against plain SB3. It is a ratio across runs, so it swings with the
machine. It also compares different work: the federated clients fly every planet,
from policies that learn differently, while plain SB3 flies the moon client alone. The
env step and the epochs per rollout (under a KL stop) vary with both.

A third control takes the work out of that ratio: right after each federated run, the
bench trains the run's client-rounds again outside Ray (:func:`replay`), in as many
plain processes at once as ClientApps trained at once, on as many threads. Each
client-round starts from the weights its round sent (rebuilt from the clients' logs as
FedAvg averages them, and checked against the run's checkpoint), with the seed its
ClientApp used and the Adam state it carried, through the same ``task.train`` call.
PPO is deterministic given all that, so the replay plays the very episodes the run
played (the bench counts the client-rounds whose episodes match), and its speed in
``PPO.learn`` against the ClientApps' is a ratio of the same work, taken a minute
apart. Ray runs its workers at niceness 15 (its ``worker_niceness``);
``RAY_worker_niceness=0`` in the bench's environment runs the ClientApps at the
replay's.

Every number is the median of ``--repeats`` runs (plain and federated interleaved).
``--preset FILE.toml`` takes the PPO hyperparameters (its ``ppo.*`` keys other than the
federation's) from a preset, for both sides (``ppo.observe-gravity``: both observe
gravity), and passes its ``ppo.keep-optimizer`` to the federated run (plain SB3 keeps
its optimizer anyway).

    python bench/ppo_throughput.py --rounds 4 --local-steps 16384 --repeats 5
    python bench/ppo_throughput.py --rounds 4 --local-steps 16384 --repeats 3 \
        --preset experiments/lunar-fl-lands-fedavg.toml
    python bench/ppo_throughput.py --rounds 3 --local-steps 16384 --repeats 3 \
        --preset experiments/lunar-fl-lands.toml
    python bench/ppo_throughput.py --rounds 3 --local-steps 8192 --repeats 3 \
        --preset experiments/lunar-fl-lands.toml --torch-threads 0  # before the default 1

Run it from a clean checkout (``git worktree add /tmp/wt HEAD``, then
``PYTHONPATH=/tmp/wt python bench/...`` from ``/tmp/wt``; without ``PYTHONPATH`` an
editable install imports, and ``flwr run`` packages, the installed checkout instead):
editing the app while it runs changes what is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from stable_baselines3 import PPO

from lab import study
from lab.launcher import APP_DIR, LocalSimulation
from tasks.base import NUM_EXAMPLES, TRAIN_REWARD, TRAIN_SECONDS, LocalTraining, local_seed
from tasks.lunar_lander import LunarLanderTask
from tasks.lunar_lander.clients import client_table
from tasks.lunar_lander.logs import ClientRoundLog
from tasks.lunar_lander.ppo import (
    flatten_state_dict,
    silent_logger,
    training_env,
    unflatten_state_dict,
)
from tasks.lunar_lander.task import TRAIN_EPISODES

# Seconds a worker waits at a barrier for the others: a worker that failed before it
# breaks the barrier (BrokenBarrierError) instead of leaving the rest waiting forever.
BARRIER_TIMEOUT = 600.0

# Keys of a preset that describe the federation or the evaluation, not local PPO.
NOT_PPO = ("ppo.local-steps", "ppo.derived-per-base", "ppo.eval-episodes", "ppo.n-envs")


def preset_ppo(path: Path | None) -> dict:
    """The ``ppo.*`` keys of a preset that set local PPO (empty: SB3's defaults)."""
    if path is None:
        return {}
    config = study.load_preset(str(path), study.app_defaults()).overrides
    return {k: v for k, v in config.items() if k.startswith("ppo.") and k not in NOT_PPO}


def standalone_steps_per_second(
    total_steps: int, n_envs: int, seed: int, threads: int, ppo: dict, start=None, callback=None
) -> tuple[int, float, float]:
    """(steps taken, steps/s, update epochs per rollout) of plain SB3 PPO on the moon
    client's environment.

    The environments are built as local training builds them (``training_env``: no
    render mode, the preset's gravity input and reward scale):
    ``make_vec_env("LunarLander-v3")`` would default to ``render_mode="rgb_array"``,
    with which LunarLander adds a Box2D body per engine particle and steps about 25 %
    slower, flattering the federated side. Under a KL stop the epochs per rollout
    differ between the two sides with what each learns, and the work per step with
    them, so both are reported. ``start`` (a barrier): wait on it before the clock
    starts, so that concurrent copies learn at the same time. ``callback``: SB3's, passed
    to ``learn``.
    """
    torch.set_num_threads(threads)
    moon = client_table(seed, derived_per_base=0)[0]
    cfg = LunarLanderTask({**ppo, "ppo.n-envs": n_envs}).config
    observe = bool(ppo.get("ppo.observe-gravity", False))  # the preset's gravity input too
    env = training_env(moon, cfg, seed=seed, observe_gravity=observe)
    kwargs = cfg.ppo_kwargs() if ppo else {}
    model = PPO("MlpPolicy", env, seed=seed, device="cpu", verbose=0, **kwargs)
    model.set_logger(silent_logger())  # as the clients: no log folder, nothing printed
    if start is not None:
        start.wait(timeout=BARRIER_TIMEOUT)
    started = time.perf_counter()
    model.learn(total_timesteps=total_steps, callback=callback)
    seconds = time.perf_counter() - started
    env.close()
    rollouts = model.num_timesteps // cfg.rollout_size
    epochs = model.logger.name_to_value["train/n_updates"] / rollouts  # as the clients log it
    return model.num_timesteps, model.num_timesteps / seconds, epochs


_START = None  # the barrier of concurrent_standalone's worker processes


def _set_start(barrier) -> None:
    global _START
    _START = barrier


def _concurrent_worker(*args) -> tuple[int, float, float]:
    return standalone_steps_per_second(*args, start=_START)


def concurrent_standalone(
    processes: int, total_steps: int, n_envs: int, seed: int, threads: int, ppo: dict
) -> tuple[int, float, float]:
    """``processes`` copies of plain SB3 PPO at ``threads`` torch threads each, learning at once
    (the same run each): steps, mean steps/s per process, epochs per rollout.

    The control for ClientApps training side by side: they share the machine's
    caches, memory bandwidth and whatever else its cores share, which one plain
    process alone on the machine does not.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    with ProcessPoolExecutor(
        processes, mp_context=context, initializer=_set_start, initargs=(barrier,)
    ) as pool:
        jobs = [
            pool.submit(_concurrent_worker, total_steps, n_envs, seed, threads, ppo)
            for _ in range(processes)
        ]
        results = [job.result() for job in jobs]
    return results[0][0], float(np.mean([r[1] for r in results])), results[0][2]


# -- the same work outside Ray ---------------------------------------------------------
def _replay_client(
    run_config: dict, job: dict, weights: np.ndarray, state: dict, tensors: dict
) -> tuple[dict, dict, dict]:
    """One client-round of a federated run, as its ClientApp trained it (the same
    ``task.train`` call on the same received weights, seed and kept state), in this
    process: (metrics, state, tensors) as the ClientApp would keep them."""
    task = LunarLanderTask(run_config)  # as each ClientApp message builds it
    model = task.build_model(0)
    model.load_state_dict(unflatten_state_dict(weights, model.state_dict()), strict=True)
    partition = task.load_partition(job["partition"], task.num_partitions())
    local = LocalTraining(
        server_round=job["round"],
        seed=local_seed(task.seed, job["round"], job["partition"]),
        state=state,
        state_tensors=tensors,
        partition_id=job["partition"],
        dp_seed=0,  # no DP: unused
    )
    if _START is not None:
        # a round's clients learn at the same time, as in the simulation
        _START.wait(timeout=BARRIER_TIMEOUT)
    metrics = task.train(model, partition, local)
    return metrics, local.state, local.state_tensors


def _set_replay_worker(barrier, threads: int) -> None:
    _set_start(barrier)
    torch.set_num_threads(threads)


def federated_rounds(run_dir: Path) -> tuple[dict, dict[int, list[dict]], dict[int, np.ndarray]]:
    """A federated run's config, its client-rounds and the weights each round sent.

    Client-rounds come from the clients' logs (``clients/*-round-*.npz``): partition,
    episodes and trained weights. Round 1 sent the server's initial model
    (``build_model(seed)``); round r > 1 sent the FedAvg of round r - 1's trained
    weights, computed as the strategy computes it (equal ``num-examples`` here, so
    each weighs 1/n; products summed in float32). The last round's mean is checked
    against the run's ``checkpoint/global.pt``, bit for bit.
    """
    run_config = json.loads((run_dir / "config.json").read_text())["run-config"]
    if run_config["strategy"] != "fedavg" or run_config.get("server.optimizer", "sgd") != "sgd":
        raise ValueError("the replay rebuilds plain FedAvg rounds only")
    examples = pd.read_csv(run_dir / "participation.csv").groupby("round")["num-examples"]
    if (examples.nunique() != 1).any():
        raise ValueError("the replay weighs a round's clients equally: unequal num-examples")
    jobs: dict[int, list[dict]] = {}
    for path in sorted((run_dir / "clients").glob("*-round-*.npz")):
        log = ClientRoundLog.load(path)
        rewards = log.episode_rewards
        jobs.setdefault(log.server_round, []).append(
            {
                "round": log.server_round,
                "partition": log.partition_id,
                # as the client reports them: how many, their mean return (if any)
                "episodes": (len(rewards), float(np.mean(rewards)) if rewards else None),
                "trained": log.weights[-1],
            }
        )
    task = LunarLanderTask(run_config)
    sent = {1: flatten_state_dict(task.build_model(task.seed).state_dict())}
    for server_round in sorted(jobs):
        clients = jobs[server_round]
        mean = clients[0]["trained"] * np.float32(1 / len(clients))
        for client in clients[1:]:
            mean += client["trained"] * np.float32(1 / len(clients))
        sent[server_round + 1] = mean
    final = torch.load(run_dir / "checkpoint" / "global.pt", weights_only=True)
    if not np.array_equal(flatten_state_dict(final), sent.pop(max(jobs) + 1)):
        raise ValueError(f"{run_dir}: the rebuilt last round differs from checkpoint/global.pt")
    return run_config, jobs, sent


def replay(run_dir: Path, processes: int, threads: int) -> dict:
    """Every client-round of a federated run again, outside Ray: ``processes`` plain
    processes at ``threads`` torch threads each (a ClientApp's num-cpus; ``PPO.learn``
    then runs on the run's ``ppo.torch-threads``, as in the ClientApp), a round's
    clients at once when there are as many processes, each client's kept state (Adam's
    moments) carried from its replayed previous round. Returns the rounds 2..R speed
    in ``PPO.learn`` and how many client-rounds played the very episodes the federated
    run played (the same work, step for step, where PPO is deterministic given its
    seed)."""
    run_config, jobs, sent = federated_rounds(run_dir)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    kept: dict[int, tuple[dict, dict]] = {}
    seconds = steps = same = 0
    with ProcessPoolExecutor(
        processes, mp_context=context, initializer=_set_replay_worker,
        initargs=(barrier, threads),
    ) as pool:  # fmt: skip
        for server_round in sorted(jobs):
            clients = jobs[server_round]
            if len(clients) % processes:
                raise ValueError(
                    f"round {server_round}: {len(clients)} clients, {processes} at a time"
                )
            futures = []
            for client in clients:
                state, tensors = kept.get(client["partition"], ({}, {}))
                args = (run_config, client, sent[server_round], state, tensors)
                futures.append(pool.submit(_replay_client, *args))
            for client, future in zip(clients, futures, strict=True):
                metrics, state, tensors = future.result()
                kept[client["partition"]] = (state, tensors)
                if server_round > min(jobs):
                    seconds += metrics[TRAIN_SECONDS]
                    steps += metrics[NUM_EXAMPLES]
                    played = (metrics[TRAIN_EPISODES], metrics.get(TRAIN_REWARD))
                    same += played == client["episodes"]
    later = sum(len(c) for r, c in jobs.items() if r > min(jobs))
    return {"learn-rate": steps / seconds, "same": same, "client-rounds": later}


def federated(sim: LocalSimulation, args, cpus: int, out: str, app: Path = APP_DIR) -> dict:
    """A fedavg run of ``args``' federation at ``cpus`` CPUs per ClientApp, of the app
    staged from ``app``: its throughput, all rounds and rounds 2..R, and its share of
    rounds 2..R in ``PPO.learn``."""
    num_clients = 3 + 3 * args.derived_per_base
    # int(n * f) = clients/round; every client: f = 1
    fraction = min(1.0, (args.clients_per_round + 0.5) / num_clients)
    run_config = (
        f"task='lunar-lander' strategy='fedavg' num-server-rounds={args.rounds} "
        f"fraction-train={fraction:.6f} min-train-nodes={args.clients_per_round} "
        f"fraction-evaluate=0.0 central-eval=false ppo.derived-per-base={args.derived_per_base} "
        f"ppo.local-steps={args.local_steps} ppo.n-envs={args.n_envs} "
        f"output-dir='{out}/cpus-{cpus}'"
    )
    for key, value in args.ppo.items():
        text = str(value).lower() if isinstance(value, bool) else repr(value)
        run_config += f" {key}={text}"
    result = sim.run(
        run_config,
        federation_config=f"num-supernodes={num_clients} client-resources-num-cpus={cpus}",
        app=app,
    )
    if result.returncode != 0 or result.run_dir is None:
        raise SystemExit(result.output)
    train = pd.read_csv(result.run_dir / "metrics.csv").query("scope == 'train'")
    train = train.sort_values("round")
    rollout = int(args.ppo.get("ppo.n-steps", 2048)) * args.n_envs  # PPO: whole rollouts
    per_client = -(-args.local_steps // rollout) * rollout
    steps_per_round = np.full(len(train), args.clients_per_round * per_client)
    elapsed = train["elapsed-s"].to_numpy()  # since the run directory was created
    # Each client's seconds in SB3's PPO.learn, rounds 2..R (`train-seconds`)
    clients = pd.read_csv(result.run_dir / "participation.csv")
    learn = clients.loc[clients["round"] > train["round"].iloc[0]]
    learn = learn.groupby("round")["train-seconds"].agg(["sum", "max"])
    processes = min((os.cpu_count() or 1) // cpus, args.clients_per_round)  # at once
    steady_seconds = elapsed[-1] - elapsed[0]
    if processes == 1:  # one client after another: nobody waits
        waiting = 0.0
    elif processes == args.clients_per_round:  # a round's clients at once: all but the
        # slowest wait for it (synchronous rounds) for the rest of its PPO.learn
        waiting = (processes * learn["max"] - learn["sum"]).sum() / (processes * steady_seconds)
    else:  # some at once, some after: how they queue is Ray's
        waiting = float("nan")
    return {
        "cpus": cpus,
        "epochs": float(train["train-epochs"].mean()),  # each round's mean over its clients
        "steps": int(steps_per_round.sum()),
        "all": steps_per_round.sum() / elapsed[-1],
        "steady": steps_per_round[1:].sum() / steady_seconds,
        "in-learn": learn["sum"].sum() / (processes * steady_seconds),
        "waiting": waiting,
        "learn-rate": steps_per_round[1:].sum() / learn["sum"].sum(),
        "wall": result.seconds,
        "run-dir": result.run_dir,
    }


def federation_arguments(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options of :func:`federated`'s run (shared with ``ppo_side_by_side.py``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients-per-round", type=int, default=2)
    parser.add_argument("--derived-per-base", type=int, default=1)
    parser.add_argument("--local-steps", type=int, default=16384)
    parser.add_argument("--n-envs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--preset", type=Path, help="take the ppo.* settings from this preset")
    return parser


def main() -> None:
    parser = federation_arguments(__doc__.split("\n\n")[0], repeats=5)
    parser.add_argument("--out", type=Path, help="keep the federated runs' directories here")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="the federated run's ppo.torch-threads (default: the preset's, else the app's)",
    )
    args = parser.parse_args()
    args.ppo = preset_ppo(args.preset)
    if args.torch_threads is not None:
        args.ppo["ppo.torch-threads"] = args.torch_threads
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop the SuperLink

    total = args.rounds * args.clients_per_round * args.local_steps
    cores = os.cpu_count() or 1
    # The torch threads a ClientApp of `cpus` CPUs learns on (ppo.torch-threads, 0: cpus)
    default_threads = LunarLanderTask({}).config.torch_threads
    configured = int(args.ppo.get("ppo.torch-threads", default_threads))
    learn_threads = {cpus: configured or cpus for cpus in {cores, 1}}
    # ClientApps that train at once: one per `cpus` CPUs, at most a round's clients
    # (`--clients-per-round 1` leaves the 1-CPU ClientApp a core to spare)
    at_once = {cpus: min(cores // cpus, args.clients_per_round) for cpus in learn_threads}
    # Plain SB3 as (processes at once, torch threads each): alone on the ClientApps'
    # threads and on each setting's CPUs (torch's default: one thread per core), and as
    # many processes side by side as ClientApps learn at once, on their threads.
    settings = sorted(
        {(1, cpus) for cpus in learn_threads}
        | {(1, t) for t in learn_threads.values()}
        | {(at_once[cpus], t) for cpus, t in learn_threads.items()}
    )
    plain_runs: dict[tuple[int, int], list[float]] = {setting: [] for setting in settings}
    plain_epochs: dict[tuple[int, int], list[float]] = {setting: [] for setting in settings}
    federated_runs: dict[int, list[dict]] = {cpus: [] for cpus in sorted({cores, 1}, reverse=True)}
    kept = contextlib.nullcontext(str(args.out)) if args.out else None
    with kept or tempfile.TemporaryDirectory() as out, LocalSimulation() as sim:
        for repeat in range(args.repeats):
            for (processes, threads), rates in plain_runs.items():
                if processes == 1:
                    steps, rate, epochs = standalone_steps_per_second(
                        total, args.n_envs, args.seed, threads, args.ppo
                    )
                else:
                    steps, rate, epochs = concurrent_standalone(
                        processes, total, args.n_envs, args.seed, threads, args.ppo
                    )
                rates.append(rate)
                plain_epochs[processes, threads].append(epochs)
                print(
                    f"#{repeat} plain SB3 PPO, {processes} process(es) at once x {threads} "
                    f"torch thread(s): {steps} steps, {rate:.0f} steps/s per process, "
                    f"{epochs:.2f} epochs per rollout",
                    flush=True,
                )
            for cpus, runs in federated_runs.items():
                row = federated(sim, args, cpus, f"{out}/{repeat}")
                # The same client-rounds at once, outside Ray, right after: same minute
                same = replay(row["run-dir"], at_once[cpus], cpus)
                row["replay-rate"] = same["learn-rate"]
                row["in-ray"] = row["learn-rate"] / same["learn-rate"]
                row["identical"] = f"{same['same']}/{same['client-rounds']}"
                runs.append(row)
                print(
                    f"#{repeat} federated, {at_once[cpus]} ClientApp(s) at once: "
                    f"{row['steps']} steps, {row['all']:.0f} steps/s (all rounds), "
                    f"{row['steady']:.0f} steps/s (rounds 2..{args.rounds}), "
                    f"{row['epochs']:.2f} epochs per rollout, "
                    f"{row['in-learn']:.1%} of rounds 2..{args.rounds} in PPO.learn "
                    f"({row['learn-rate']:.0f} steps/s there), {row['waiting']:.1%} "
                    "waiting for the round's slowest client, "
                    f"whole `flwr run` {row['wall']:.1f} s",
                    flush=True,
                )
                print(
                    f"#{repeat} the same client-rounds outside Ray, as many at once: "
                    f"{same['learn-rate']:.0f} steps/s in PPO.learn (in the ClientApps / "
                    f"outside Ray: {row['in-ray']:.2f}); {same['same']} of "
                    f"{same['client-rounds']} client-rounds played the federated "
                    "run's episodes exactly",
                    flush=True,
                )
    plain = {setting: float(np.median(rates)) for setting, rates in plain_runs.items()}
    epochs = {setting: float(np.median(values)) for setting, values in plain_epochs.items()}
    rows = [
        {
            "cpus": cpus,
            "steps": runs[0]["steps"],
            "identical": ", ".join(r["identical"] for r in runs),
            **{
                key: float(np.median([r[key] for r in runs]))
                for key in (
                    "all",
                    "steady",
                    "wall",
                    "epochs",
                    "in-learn",
                    "waiting",
                    "learn-rate",
                    "replay-rate",
                    "in-ray",
                )
            },
        }
        for cpus, runs in federated_runs.items()
    ]

    # Each ClientApp's share of the throughput against plain SB3 alone on the threads
    # the ClientApp learns on and on one thread per CPU (torch's default: what SB3 gets
    # by itself on those cores), and with as many processes at once as ClientApps at
    # once. The goal's ratio is against the faster of the two alone.
    print(f"\nClientApps learn on ppo.torch-threads = {configured} (0: their num-cpus)\n")
    print(
        "| setting | env steps | epochs per rollout | steps/s | per process "
        "| plain SB3 alone, the ClientApp's threads | ratio "
        "| plain SB3 alone, a thread per CPU | ratio "
        "| plain SB3, as many at once | ratio | goal: against the faster alone |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (processes, threads), rate in plain.items():
        print(
            f"| plain SB3 PPO, {processes} process(es) x {threads} thread(s) | {steps} | "
            f"{epochs[processes, threads]:.2f} | {rate * processes:.0f} | {rate:.0f} | "
            f"{plain[1, threads]:.0f} | {rate / plain[1, threads]:.2f} | | | | | |"
        )
    for row in rows:
        cpus, threads = row["cpus"], learn_threads[row["cpus"]]
        same, per_cpu = plain[1, threads], plain[1, cpus]
        side_by_side = plain[at_once[cpus], threads]
        for key, label in (("all", "all rounds"), ("steady", "rounds 2..R")):
            share = row[key] / at_once[cpus]
            print(
                f"| federated, {at_once[cpus]} ClientApp(s) x {cpus} CPU ({threads} thread(s)), "
                f"{label} | {row['steps']} | {row['epochs']:.2f} | {row[key]:.0f} | "
                f"{share:.0f} | {same:.0f} | {share / same:.2f} | {per_cpu:.0f} | "
                f"{share / per_cpu:.2f} | {side_by_side:.0f} | {share / side_by_side:.2f} | "
                f"{share / max(same, per_cpu):.2f} |"
            )
    print(
        f"\nEach ClientApp process's time, rounds 2..{args.rounds}: in SB3's PPO.learn, "
        "waiting for the round's slowest client (synchronous rounds), and the app's "
        "(receiving, building PPO and its environments, replying, the server's round); "
        "and SB3's speed in PPO.learn\n"
    )
    print(
        "| setting | in PPO.learn | waiting | the app's | steps/s in PPO.learn "
        "| plain SB3, as many at once | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        side_by_side = plain[at_once[row["cpus"]], learn_threads[row["cpus"]]]
        app = 1 - row["in-learn"] - row["waiting"]
        print(
            f"| federated, {at_once[row['cpus']]} ClientApp(s) x {row['cpus']} CPU | "
            f"{row['in-learn']:.1%} | {row['waiting']:.1%} | {app:.1%} | "
            f"{row['learn-rate']:.0f} | {side_by_side:.0f} | "
            f"{row['learn-rate'] / side_by_side:.2f} |"
        )

    print(
        "\nSB3's speed in PPO.learn on the very same work: the federated run's client-rounds "
        f"(rounds 2..{args.rounds}) replayed outside Ray right after it, from the weights "
        "each round sent and each client's kept state, as many at once; the ratio is the "
        "median of each repeat's\n"
    )
    print(
        "| setting | in the ClientApps | the same outside Ray | ratio "
        "| client-rounds identical, per repeat |"
    )
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| federated, {at_once[row['cpus']]} ClientApp(s) x {row['cpus']} CPU | "
            f"{row['learn-rate']:.0f} | {row['replay-rate']:.0f} | {row['in-ray']:.2f} | "
            f"{row['identical']} |"
        )


if __name__ == "__main__":
    main()
