"""How far does PPO get on one planet alone with the whole budget?

The federated study splits the PPO study's 1.6 M env steps over 9 clients on three planets.
This is the other extreme, an upper bound for what one planet's base client could
reach: one agent on one base environment (e.g. ``moon-00``) takes *every* env step,
with a preset's PPO settings, as a client that is sampled every round and keeps its
Adam state (the task's own :meth:`~tasks.lunar_lander.LunarLanderTask.train`, so
exactly the local training of a federated round). After every ``ppo.local-steps``
chunk its policy plays the central evaluation's seeded episodes of that planet.
No Flower, no federation::

    python bench/lunar_one_planet.py studies/lunar-lands/presets/lunar-fl-lands-fedavg.toml \\
        --planet moon --steps 1572864 --seeds 0 1 --out results/lunar-one-planet

Design notes: ``docs/notes.md``, ``bench.lunar_one_planet``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import study  # noqa: E402
from tasks.base import LocalTraining, local_seed  # noqa: E402
from tasks.lunar_lander import LunarLanderTask  # noqa: E402
from tasks.lunar_lander.clients import PLANETS  # noqa: E402
from tasks.lunar_lander.task import EVAL_REWARD, EVAL_REWARD_SE  # noqa: E402


def one_planet(config: dict, planet: str, steps: int, seed: int) -> Iterator[dict]:
    """``seed, planet, env-steps, reward, se`` after each ``ppo.local-steps`` chunk of
    PPO on ``planet``'s base environment, trained by one client with kept Adam state."""
    task = LunarLanderTask({**config, "seed": seed, "ppo.keep-optimizer": True})
    index = list(PLANETS).index(planet)  # base clients come first in the table
    env = task.clients[index]
    model = task.build_model(seed)
    state: dict = {}  # the client's persistent state and Adam tensors, kept across chunks
    tensors: dict = {}
    done, chunk = 0, 0
    while done < steps:
        chunk += 1
        local = LocalTraining(
            server_round=chunk, seed=local_seed(seed, chunk, index), state=state,
            state_tensors=tensors, partition_id=index,
        )  # fmt: skip
        done += int(task.train(model, env, local)["num-examples"])
        played = task.evaluate(model, env)  # the central evaluation's episodes of env
        yield {
            "seed": seed,
            "planet": planet,
            "env-steps": done,
            "reward": played[EVAL_REWARD],
            "se": played.get(EVAL_REWARD_SE, float("nan")),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", type=Path, help="take the ppo.* settings from this preset")
    parser.add_argument("--planet", choices=tuple(PLANETS), default="moon")
    parser.add_argument("--steps", type=int, default=1_572_864, help="env steps in all")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--print-every", type=int, default=4, help="chunks between lines")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # One torch thread, as each ClientApp of the federated runs has one CPU (2 threads
    # on a busy 2-core machine spin OpenMP workers for most of the time).
    torch.set_num_threads(1)
    config = study.load_preset(str(args.preset), study.app_defaults()).run_config
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        started = time.perf_counter()
        for chunk, row in enumerate(one_planet(dict(config), args.planet, args.steps, seed), 1):
            rows.append(row)
            if chunk % args.print_every == 0 or row["env-steps"] >= args.steps:
                elapsed = time.perf_counter() - started
                eta = elapsed / row["env-steps"] * max(args.steps - row["env-steps"], 0)
                print(
                    f"seed {seed} {args.planet}: {row['env-steps']:>9,} steps  reward "
                    f"{row['reward']:7.1f} ± {row['se']:.1f} (SE)  {elapsed:.0f} s, "
                    f"ETA {eta:.0f} s for this seed",
                    flush=True,
                )
        pd.DataFrame(rows).to_csv(args.out / "one_planet.csv", index=False)
    print(f"Written: {args.out / 'one_planet.csv'}")


if __name__ == "__main__":
    main()
