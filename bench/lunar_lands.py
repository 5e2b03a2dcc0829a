"""The PPO study: does federated PPO land, and does it beat single agents?

    python bench/lunar_lands.py PRESET.toml ... --out DIR   # run and analyse the study
    python bench/lunar_lands.py one-planet PRESET.toml --planet moon --out DIR
    python bench/lunar_lands.py outcomes --from DIR/comparison.json --out DIR

``one-planet``: one agent on one planet with the whole env-step budget (no Flower);
``outcomes``: how the final policies' episodes end. Design notes: ``docs/notes.md``,
``bench.lunar_lands`` and its subcommands.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import torch
from scipy import stats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import comparison, study  # noqa: E402
from lab.study import StudyError  # noqa: E402
from server_app.evaluation import best_of_clusters  # noqa: E402
from tasks.base import LocalTraining, local_seed  # noqa: E402
from tasks.lunar_lander import LunarLanderTask  # noqa: E402
from tasks.lunar_lander.clients import PLANETS, ClientEnv  # noqa: E402
from tasks.lunar_lander.logs import load_snapshots  # noqa: E402
from tasks.lunar_lander.ppo import (  # noqa: E402
    OUTCOMES,
    flatten_state_dict,
    play_episodes,
    unflatten_state_dict,
)
from tasks.lunar_lander.task import EVAL_REWARD, EVAL_REWARD_SE, episode_stats  # noqa: E402

LANDED = 200.0  # the study's goal: mean evaluation reward per planet
STABLE_FROM, MAX_DROP = 150.0, 50.0  # after first reaching 150, no drop > 50
SINGLE_AGENT, CLUSTERED = "local", "clustered"
Y_RANGE = (-400.0, 350.0)  # learning curves: where the rounds after the first lie


def _run_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())["run-config"]


def env_steps(run_dir: Path) -> pd.Series:
    """Env steps of all clients up to each round (index: round, 0 = before training)."""
    rows = pd.read_csv(run_dir / "participation.csv")
    per_round = rows[rows["replied"].astype(bool)].groupby("round")["num-examples"].sum()
    steps = per_round.sort_index().cumsum()
    return pd.concat([pd.Series({0: 0}), steps]).astype(int)


def central_rewards(run_dir: Path) -> pd.DataFrame:
    """``round, planet, reward, se`` of the central evaluation in ``metrics.csv``.

    Rounds with cluster models (``cluster-<k>-…`` columns) are merged again by
    :func:`~server_app.evaluation.best_of_clusters`, so runs written before its SE
    followed the picked model read the same as new ones."""
    metrics = pd.read_csv(run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"]
    rows = []
    for _, row in central.iterrows():
        merged = _merged_clusters(row.dropna().to_dict())
        for planet in PLANETS:
            rows.append(
                {
                    "round": int(row["round"]),
                    "planet": planet,
                    "reward": float(merged[f"{EVAL_REWARD}-{planet}"]),
                    "se": float(merged.get(f"{EVAL_REWARD_SE}-{planet}", np.nan)),
                }
            )
    return pd.DataFrame(rows)


def _merged_clusters(row: dict) -> dict:
    """``row`` with its plain keys re-merged from its ``cluster-<k>-<key>`` columns."""
    per_model: dict[int, dict[str, float]] = {}
    for key, value in row.items():
        head, _, rest = str(key).partition("-")
        number, _, metric = rest.partition("-")
        if head == "cluster" and number.isdigit() and metric:
            per_model.setdefault(int(number), {})[metric] = value
    if not per_model:
        return row
    return row | best_of_clusters([per_model[k] for k in sorted(per_model)])


def _last_uploads(run_dir: Path, labels: Sequence[str]) -> dict[str, np.ndarray]:
    """Each client's last logged weights (what it uploaded the last round it trained)."""
    snapshots, weights = load_snapshots(run_dir / "clients")
    last = {}
    for label in labels:
        mine = snapshots[snapshots["label"] == label]
        if len(mine):
            last[label] = weights[kept_snapshot(mine)]
    return last


def kept_snapshot(snapshots: pd.DataFrame) -> int:
    """Index of the weights a client kept among ``snapshots`` (its rows of
    :func:`~tasks.lunar_lander.logs.load_snapshots`): the last one logged in its
    latest round. That is the training-end snapshot, which shares its step with an
    in-rollout one (taken before the rollout's update) whenever a check falls on the
    last step, so ties on the step go to the row logged later."""
    order = snapshots.sort_values(["server_round", "step"], kind="stable")
    return int(order.index[-1])


def assigned_clusters(run_dir: Path, bases: Sequence[ClientEnv]) -> dict[str, Path]:
    """Per base client label, the final cluster model's checkpoint nearest (L2) its
    last upload, as the strategy's L2 rule would assign it next (clients that never
    uploaded are left out)."""
    uploads = _last_uploads(run_dir, [c.label for c in bases])
    models = sorted((run_dir / "checkpoint").glob("cluster-*.pt"))
    flat = [flatten_state_dict(torch.load(path)) for path in models]
    return {
        label: models[int(np.argmin([np.sum((upload - model) ** 2) for model in flat]))]
        for label, upload in uploads.items()
    }


def clustered_assigned_rewards(run_dir: Path) -> pd.DataFrame:
    """``round, planet, reward, se`` of the final round: per planet, the final cluster
    model nearest (L2) the base client's last upload, as the strategy assigns models,
    read from that model's central evaluation."""
    config = _run_config(run_dir)
    bases = LunarLanderTask(config).load_central_test()
    assigned = assigned_clusters(run_dir, bases)
    metrics = pd.read_csv(run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"].sort_values("round").iloc[-1]
    rows = []
    for client in bases:
        if client.label not in assigned:
            continue
        k = int(assigned[client.label].stem.removeprefix("cluster-"))
        rows.append(
            {
                "round": int(central["round"]),
                "planet": client.planet,
                "reward": float(central[f"cluster-{k}-{EVAL_REWARD}-{client.planet}"]),
                "se": float(central.get(f"cluster-{k}-{EVAL_REWARD_SE}-{client.planet}", np.nan)),
                "model": k,
            }
        )
    return pd.DataFrame(rows)


def final_policies(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per planet, the weights its base client ends the run with: the assigned cluster
    model (clustered), its own last snapshot (single agents), else the global model."""
    config = _run_config(run_dir)
    task = LunarLanderTask(config)
    bases = task.load_central_test()
    strategy = config["strategy"]
    if strategy == CLUSTERED:
        assigned = assigned_clusters(run_dir, bases)
        return {c.planet: torch.load(assigned[c.label]) for c in bases if c.label in assigned}
    if strategy == SINGLE_AGENT:
        reference = task.build_model(0).state_dict()
        last = _last_uploads(run_dir, [c.label for c in bases])
        return {
            c.planet: unflatten_state_dict(last[c.label], reference)
            for c in bases
            if c.label in last
        }
    weights = torch.load(run_dir / "checkpoint" / "global.pt")
    return {c.planet: weights for c in bases}


def single_agent_rewards(run_dir: Path) -> pd.DataFrame:
    """``round, planet, reward, se`` of each base client's own policy after each round
    (its last logged snapshot up to then), on the central evaluation's episodes."""
    config = _run_config(run_dir)
    task = LunarLanderTask(config)
    model = task.build_model(0)
    reference = model.state_dict()  # keys, shapes and dtypes to cut snapshots into
    snapshots, weights = load_snapshots(run_dir / "clients")
    rows = []
    for client in task.load_central_test():
        mine = snapshots[snapshots["label"] == client.label]
        latest: dict[str, float] | None = None
        for server_round in range(1, int(config["num-server-rounds"]) + 1):
            trained = mine[mine["server_round"] == server_round]
            if len(trained):  # the policy it kept: the round's last snapshot
                last = kept_snapshot(trained)
                model.load_state_dict(unflatten_state_dict(weights[last], reference))
                stats_ = task.evaluate(model, client)  # the central evaluation's episodes
                latest = {"reward": stats_[EVAL_REWARD], "se": stats_[EVAL_REWARD_SE]}
            if latest is not None:
                rows.append({"round": server_round, "planet": client.planet, **latest})
    return pd.DataFrame(rows)


def per_round(runs: Mapping[str, Mapping[int, Path]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``experiment, seed, strategy, round, env-steps, planet, reward, se`` of every run
    and every round, and the final rows of clustered runs by assigned model."""
    frames, finals = [], []
    for name, seeds in runs.items():
        for seed, run_dir in seeds.items():
            strategy = _run_config(run_dir)["strategy"]
            rewards = (
                single_agent_rewards(run_dir)
                if strategy == SINGLE_AGENT
                else central_rewards(run_dir)
            )
            steps = env_steps(run_dir)
            for frame, chosen in (
                (rewards, frames),
                (clustered_assigned_rewards(run_dir) if strategy == CLUSTERED else None, finals),
            ):
                if frame is None:
                    continue
                frame["env-steps"] = frame["round"].map(steps)
                frame.insert(0, "experiment", name)
                frame.insert(1, "seed", seed)
                frame.insert(2, "strategy", strategy)
                chosen.append(frame)
    final = pd.concat(finals, ignore_index=True) if finals else pd.DataFrame()
    return pd.concat(frames, ignore_index=True), final


def confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of a Student-t interval; half-width NaN for one value."""
    values = np.asarray(values, dtype=float)
    n = len(values)
    if n < 2:
        return float(values.mean()), float("nan")
    half = stats.t.ppf(0.5 + level / 2, n - 1) * values.std(ddof=1) / np.sqrt(n)
    return float(values.mean()), float(half)


def final_table(rounds: pd.DataFrame, final: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per experiment and planet: the last round's reward over seeds (mean, 95 % CI).

    ``final`` (same columns) replaces the last round of the runs it covers (clustered
    FedAvg's assigned models)."""
    final_round = rounds.groupby(["experiment", "seed"])["round"].transform("max")
    last = rounds[rounds["round"] == final_round]
    if final is not None and len(final):
        covered = last.set_index(["experiment", "seed"]).index.isin(
            final.set_index(["experiment", "seed"]).index.unique()
        )
        last = pd.concat([last[~covered], final[last.columns]], ignore_index=True)
    rows = []
    for (name, planet), group in last.groupby(["experiment", "planet"], sort=False):
        mean, half = confidence_interval(group["reward"])
        rows.append(
            {
                "experiment": name,
                "planet": planet,
                "seeds": len(group),
                "env-steps": int(group["env-steps"].max()),
                "reward": mean,
                "ci95": half,
                "low": mean - half,
                "high": mean + half,
                "episode-se": float(group["se"].mean()),
                "per-seed": " / ".join(f"{r:.0f}" for r in group["reward"]),
                "landed": mean >= LANDED,
            }
        )
    return pd.DataFrame(rows)


def stability(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per run and planet: the round it first reached 150 and the largest drop between
    consecutive rounds after that (NaN if it never did), with that drop's standard
    error, ``max-drop-se`` = sqrt(se₁² + se₂²) of its two rounds' episode means (NaN
    when nothing dropped).

    The standard error treats the two rounds' episodes as independent. They share their
    seeds, which for two similar policies correlates their returns positively, so it
    overstates the measurement noise of such a drop: a drop several times it is the
    policy's, not the measurement's."""
    rows = []
    for (name, seed, planet), group in rounds.groupby(["experiment", "seed", "planet"]):
        ordered = group.sort_values("round")
        rewards, errors = ordered["reward"].to_numpy(), ordered["se"].to_numpy()
        reached = np.flatnonzero(rewards >= STABLE_FROM)
        first, drop, drop_se = np.nan, np.nan, np.nan
        if reached.size:
            first = int(ordered["round"].iloc[reached[0]])
            after, after_se = rewards[reached[0] :], errors[reached[0] :]
            drops = after[:-1] - after[1:]
            drop = float(np.max(drops, initial=0.0))
            if drops.size and drop > 0:
                worst = int(np.argmax(drops))
                drop_se = float(np.hypot(after_se[worst], after_se[worst + 1]))
        rows.append(
            {
                "experiment": name,
                "seed": seed,
                "planet": planet,
                "first-150-round": first,
                "max-drop": drop,
                "max-drop-se": drop_se,
                "stable": bool(reached.size) and drop <= MAX_DROP,
            }
        )
    return pd.DataFrame(rows)


def overlap_statements(final: pd.DataFrame, baseline: str) -> list[str]:
    """For every other experiment and planet: do its CI and ``baseline``'s overlap?"""
    lines = []
    base = final[final["experiment"] == baseline].set_index("planet")
    for _, row in final[final["experiment"] != baseline].iterrows():
        other = base.loc[row["planet"]]
        if np.isnan(row["ci95"]) or np.isnan(other["ci95"]):
            verdict = "no interval (one seed)"
        elif row["low"] > other["high"]:
            verdict = "better: the intervals do not overlap"
        elif row["high"] < other["low"]:
            verdict = "worse: the intervals do not overlap"
        else:
            verdict = "the intervals overlap: no difference shown"
        lines.append(
            f"{row['experiment']} vs {baseline} on {row['planet']}: "
            f"{row['reward']:.0f} ± {row['ci95']:.0f} vs {other['reward']:.0f} ± "
            f"{other['ci95']:.0f}: {verdict}"
        )
    return lines


def plot_curves(rounds: pd.DataFrame, path: Path) -> None:
    """Reward against env steps per planet: mean over seeds with the 95 % band."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLANETS), figsize=(5 * len(PLANETS), 4), sharey=True)
    for ax, planet in zip(axes, PLANETS, strict=True):
        mine = rounds[rounds["planet"] == planet]
        for name, group in mine.groupby("experiment", sort=False):
            by_round = group.groupby("round")
            steps = by_round["env-steps"].mean() / 1e6
            bands = [confidence_interval(g["reward"]) for _, g in by_round]
            mean = np.array([m for m, _ in bands])
            half = np.nan_to_num(np.array([h for _, h in bands]))
            ax.plot(steps, mean, marker="o", markersize=3, label=name)
            ax.fill_between(steps, mean - half, mean + half, alpha=0.2)
        ax.axhline(LANDED, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(*Y_RANGE)  # the random policy of round 0 (down to -2500) off the axis
        ax.set(title=planet, xlabel="env steps, all clients (millions)")
    axes[0].set_ylabel("evaluation reward (mean over seeds, 95 % CI)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(table: pd.DataFrame) -> str:
    """``table`` as a Markdown table, numbers to one decimal (pandas' own needs
    ``tabulate``, which the app does not install)."""

    def cell(value: object) -> str:
        if isinstance(value, float | np.floating):
            return "–" if np.isnan(value) else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + " --- |" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(False)]
    return "\n".join(lines)


def analyse(runs: Mapping[str, Mapping[int, Path]], out: Path) -> pd.DataFrame:
    """Write and print the per-round rewards, final table, stability and curves."""
    out.mkdir(parents=True, exist_ok=True)
    rounds, assigned = per_round(runs)
    final = final_table(rounds, assigned)
    steady = stability(rounds)
    rounds.to_csv(out / "per_round.csv", index=False)
    if len(assigned):
        assigned.to_csv(out / "clustered_assigned.csv", index=False)
    final.to_csv(out / "final.csv", index=False)
    steady.to_csv(out / "stability.csv", index=False)
    plot_curves(rounds, out / "learning_curves.png")
    lines = ["## Final evaluation reward per planet (mean over seeds, 95 % CI)", ""]
    lines.append(_markdown(final.drop(columns=["low", "high"])))
    lines += ["", "## Stability (after first reaching 150)", ""]
    lines.append(_markdown(steady))
    singles = {n for n, s in rounds.groupby("experiment")["strategy"].first().items()
               if s == SINGLE_AGENT}  # fmt: skip
    for baseline in sorted(singles):
        lines += ["", f"## Against {baseline}", ""]
        lines += [f"- {line}" for line in overlap_statements(final, baseline)]
    text = "\n".join(lines) + "\n"
    (out / "final.md").write_text(text)
    print(text)
    return final


def study_main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """Run the study's presets (or read finished runs) and analyse them."""
    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(
        prog="lunar_lands.py",
        description=__doc__.splitlines()[0],
        epilog="other commands: one-planet (one agent, one planet, the whole budget), "
        "outcomes (how the final policies' episodes end); each takes --help",
    )
    parser.add_argument("presets", nargs="*", metavar="PRESET.toml")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--from", dest="from_json", type=Path, metavar="COMPARISON.json")
    parser.add_argument("--runs", nargs="+", metavar="NAME:SEED=RUN_DIR")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if sum(map(bool, (args.presets, args.from_json, args.runs))) != 1:
        parser.error("give one of: PRESET.toml files, --from COMPARISON.json, --runs")
    source = args.from_json
    if args.presets:
        seeds = [str(s) for s in args.seeds]
        comparison.main([*args.presets, "--seeds", *seeds, "--out", str(args.out)])
        source = args.out / "comparison.json"
    try:
        if args.runs:
            runs = comparison.parse_runs(args.runs)
        else:
            runs, _ = comparison.read_comparison_json(source)
    except StudyError as err:
        raise SystemExit(f"lunar_lands: {err}") from None
    return analyse(runs, args.out)


# --- one-planet: one agent with the whole budget ---------------------------------


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


def one_planet_main(argv: Sequence[str] | None = None) -> None:
    """How far PPO gets on one planet alone with the whole env-step budget."""
    parser = argparse.ArgumentParser(
        prog="lunar_lands.py one-planet",
        description="How far does PPO get on one planet alone with the whole budget?",
    )
    parser.add_argument("preset", type=Path, help="take the ppo.* settings from this preset")
    parser.add_argument("--planet", choices=tuple(PLANETS), default="moon")
    parser.add_argument("--steps", type=int, default=1_572_864, help="env steps in all")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--print-every", type=int, default=4, help="chunks between lines")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
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


# --- outcomes: how the final policies' episodes end -------------------------------

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


def outcomes_main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """How the final policies' episodes end, per planet and policy."""
    parser = argparse.ArgumentParser(
        prog="lunar_lands.py outcomes", description="How do the final policies' episodes end?"
    )
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
        raise SystemExit(f"lunar_lands outcomes: {err}") from None
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


COMMANDS = {"one-planet": one_planet_main, "outcomes": outcomes_main}


def main(argv: Sequence[str] | None = None) -> object:
    """``one-planet`` or ``outcomes`` with their arguments, else the study's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    return study_main(args)


if __name__ == "__main__":
    main()
