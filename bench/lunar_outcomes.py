"""How do the final policies' episodes end?

Design notes: ``docs/notes.md``, ``bench.lunar_outcomes``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lunar_lands import _markdown, _run_config, final_policies  # noqa: E402
from lab import comparison  # noqa: E402
from lab.study import StudyError  # noqa: E402
from tasks.lunar_lander import LunarLanderTask  # noqa: E402
from tasks.lunar_lander.ppo import OUTCOMES, play_episodes  # noqa: E402
from tasks.lunar_lander.task import EVAL_REWARD, EVAL_REWARD_SE, episode_stats  # noqa: E402

POLICIES = {"most-likely": False, "sampled": True}  # label -> play_episodes' stochastic


def run_outcomes(run_dir: Path, episodes: int) -> pd.DataFrame:
    """One row per planet and policy of ``run_dir``'s final policies."""
    config = _run_config(run_dir) | {"ppo.eval-episodes": episodes}
    task = LunarLanderTask(config)
    model = task.build_model(0)
    weights = final_policies(run_dir)
    rows = []
    for index, client in enumerate(task.load_central_test()):
        if client.planet not in weights:
            continue
        model.load_state_dict(weights[client.planet])
        for label, stochastic in POLICIES.items():
            played = play_episodes(model, client, task.eval_seeds(index), stochastic=stochastic)
            stats = episode_stats(played.returns, played.lengths)  # the run's own statistics
            rows.append(
                {
                    "planet": client.planet,
                    "policy": label,
                    "episodes": len(played.returns),
                    "reward": stats[EVAL_REWARD],
                    "se": stats[EVAL_REWARD_SE],
                    **{outcome: played.outcomes.count(outcome) for outcome in OUTCOMES},
                }
            )
    return pd.DataFrame(rows)


def outcomes(runs: Mapping[str, Mapping[int, Path]], episodes: int) -> pd.DataFrame:
    frames = []
    for name, seeds in runs.items():
        for seed, run_dir in seeds.items():
            frame = run_outcomes(run_dir, episodes)
            frame.insert(0, "experiment", name)
            frame.insert(1, "seed", seed)
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def totals(table: pd.DataFrame) -> pd.DataFrame:
    """Per experiment, planet and policy: episodes and outcome counts summed over seeds,
    and the mean of the per-seed rewards."""
    keys = ["experiment", "planet", "policy"]
    summed = table.groupby(keys, sort=False)[["episodes", *OUTCOMES]].sum()
    summed.insert(1, "reward", table.groupby(keys, sort=False)["reward"].mean())
    summed.insert(1, "seeds", table.groupby(keys, sort=False)["seed"].nunique())
    return summed.reset_index()


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="from_json", type=Path, metavar="COMPARISON.json")
    source.add_argument("--runs", nargs="+", metavar="NAME:SEED=RUN_DIR")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.episodes < 2:
        parser.error(f"--episodes = {args.episodes}: give 2 or more (the SE needs two)")
    try:
        if args.runs:
            runs = comparison.parse_runs(args.runs)
        else:
            runs, _ = comparison.read_comparison_json(args.from_json)
    except StudyError as err:
        raise SystemExit(f"lunar_outcomes: {err}") from None
    table = outcomes(runs, args.episodes)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "outcomes.csv", index=False)
    text = "\n".join(
        [
            f"## How the final policies' episodes end ({args.episodes} per planet and policy)",
            "",
            _markdown(table),
            "",
            "## Summed over seeds",
            "",
            _markdown(totals(table)),
            "",
        ]
    )
    (args.out / "outcomes.md").write_text(text)
    print(text)
    return table


if __name__ == "__main__":
    main()
