"""Study plots and tables of federated PPO on LunarLander (the PPO study, "Results and
Visualization"): learning curves per client, experiment comparisons, t-SNE / UMAP of
the policy-weight snapshots, and the final-reward table.

Everything here reads the client logs of ``tasks.lunar_lander.logs`` (``<run
dir>/clients/*.npz``) and the run directory's ``config.json`` / ``metrics.csv``, and
returns matplotlib Figures or pandas DataFrames; ``lab.study`` saves them. No
Flower import.

The x axis of every curve is the PPO study's "local epochs": a client's cumulative env
steps / its PPO rollout size (``local_epoch`` in ``load_episodes``). The y axis is
the rolling mean of the last ``WINDOW`` = 100 episode rewards of one client.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from tasks.lunar_lander.logs import clients_dir, load_episodes, load_snapshots

WINDOW = 100  # episodes in the rolling mean (the PPO study) and in the final training reward
MIN_EPISODES = 10  # a client's curve starts at its 10th episode (fewer: too noisy to read)
PLANETS = ("moon", "earth", "mars")
PLANET_COLOURS = {"moon": "tab:gray", "earth": "tab:blue", "mars": "tab:red"}
PLANET_STYLES = {"moon": ":", "earth": "-", "mars": "--"}
PLANET_MARKERS = {"moon": "o", "earth": "s", "mars": "^"}
TIME_CMAP = "viridis_r"  # weight snapshots: darker = later (the PPO study)
# Run-config keys that must agree for "same env steps per client" (see compare_to_single_agent).
COMPARABLE_KEYS = (
    "num-server-rounds", "ppo.local-steps", "ppo.local-steps-moon", "ppo.local-steps-earth",
    "ppo.local-steps-mars", "fraction-train",
)  # fmt: skip
SINGLE_AGENT_STRATEGY = "local"
EPOCH_LABEL = "local epochs (client env steps / rollout size)"
REWARD_LABEL = f"episode reward (rolling mean of {WINDOW})"


def planets_in(frame: pd.DataFrame) -> list[str]:
    """The planets of ``frame`` in the fixed order moon, earth, mars (others after)."""
    present = set(frame["planet"])
    return [p for p in PLANETS if p in present] + sorted(present - set(PLANETS))


def _colour(planet: str) -> str:
    return PLANET_COLOURS.get(planet, "tab:green")


def _style(planet: str) -> str:
    return PLANET_STYLES.get(planet, "-.")


def _marker(planet: str) -> str:
    return PLANET_MARKERS.get(planet, "D")


def rolling_rewards(
    episodes: pd.DataFrame, window: int = WINDOW, min_periods: int = MIN_EPISODES
) -> pd.DataFrame:
    """``episodes`` (label, planet, local_epoch, reward, ...) sorted by client and
    step, with ``rolling_reward``: the mean of each client's last ``window`` episode
    rewards; until its ``window``-th episode, of all its episodes so far (NaN before
    its ``min_periods``-th)."""
    frame = episodes.sort_values(["label", "end_step"], ignore_index=True)
    grouped = frame.groupby("label", sort=False)["reward"]
    frame["rolling_reward"] = grouped.transform(
        lambda r: r.rolling(window, min_periods=min_periods).mean()
    )
    return frame


def learning_curves(episodes: pd.DataFrame, title: str) -> Figure:
    """One line per client: rolling-100 episode reward over its local epochs, coloured
    by planet (the PPO study's ``plot_learning_curves``)."""
    frame = rolling_rewards(episodes)
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    planets = planets_in(frame)
    for _, client in frame.groupby("label", sort=True):
        colour = _colour(client["planet"].iloc[0])
        ax.plot(client["local_epoch"], client["rolling_reward"], color=colour, lw=1, alpha=0.7)
    handles = [
        Line2D([], [], color=_colour(p), lw=2, label=_client_count(frame, p)) for p in planets
    ]
    ax.legend(handles=handles, title="planet", fontsize=9)
    ax.set(xlabel=EPOCH_LABEL, ylabel=REWARD_LABEL, title=title)
    ax.grid(alpha=0.3)
    return fig


def _client_count(frame: pd.DataFrame, planet: str) -> str:
    n = frame.loc[frame["planet"] == planet, "label"].nunique()
    return f"{planet} ({n} client{'s' if n != 1 else ''})"


def epoch_grid(experiments: Mapping[str, pd.DataFrame], points: int = 200) -> np.ndarray:
    """A common local-epoch grid from 0 to the largest local epoch of any experiment."""
    last = max(float(e["local_epoch"].max()) for e in experiments.values())
    return np.linspace(0.0, last, points)


def planet_curves(episodes: pd.DataFrame, grid: np.ndarray) -> pd.DataFrame:
    """Mean rolling-100 reward of each planet's clients on ``grid``.

    Each client's rolling curve (``rolling_rewards``, from its ``MIN_EPISODES``-th
    episode on) is interpolated linearly on the grid points within its own range of
    local epochs (NaN outside); a planet's curve is the mean over
    the clients that have data at that point. Columns: planet, local_epoch, reward,
    clients (how many clients the point averages).
    """
    frame = rolling_rewards(episodes)
    rows = []
    for planet in planets_in(frame):
        curves = [np.full(len(grid), np.nan)]  # a planet whose clients have no point yet
        mine = frame[(frame["planet"] == planet) & frame["rolling_reward"].notna()]
        for _, client in mine.groupby("label", sort=True):
            x, y = client["local_epoch"].to_numpy(), client["rolling_reward"].to_numpy()
            inside = (grid >= x[0]) & (grid <= x[-1])
            curves.append(np.where(inside, np.interp(grid, x, y), np.nan))
        stacked = np.vstack(curves)
        counts = np.isfinite(stacked).sum(axis=0)
        with warnings.catch_warnings():  # grid points no client reaches: NaN, no warning
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(stacked, axis=0)
        rows.append(
            pd.DataFrame(
                {"planet": planet, "local_epoch": grid, "reward": mean, "clients": counts}
            )
        )
    return pd.concat(rows, ignore_index=True)


def _experiment_curves(experiments: Mapping[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    if not experiments:
        raise ValueError("no experiments to compare")
    grid = epoch_grid(experiments)
    return {name: planet_curves(episodes, grid) for name, episodes in experiments.items()}


def _all_planets(curves: Mapping[str, pd.DataFrame]) -> list[str]:
    return planets_in(pd.concat(list(curves.values()), ignore_index=True))


def comparison_combined(
    experiments: Mapping[str, pd.DataFrame], title: str = "Experiments compared"
) -> Figure:
    """All experiments on one axis: colour = experiment, line style = planet; each
    line is ``planet_curves`` (mean over the planet's clients)."""
    curves = _experiment_curves(experiments)
    planets = _all_planets(curves)
    fig, ax = plt.subplots(figsize=(10, 5.5), constrained_layout=True)
    colours = {name: f"C{i % 10}" for i, name in enumerate(curves)}
    for name, frame in curves.items():
        for planet, curve in frame.groupby("planet", sort=False):
            style = _style(planet)
            ax.plot(curve["local_epoch"], curve["reward"], color=colours[name], ls=style, lw=1.5)
    by_experiment = [Line2D([], [], color=c, lw=2, label=n) for n, c in colours.items()]
    by_planet = [Line2D([], [], color="black", lw=1.5, ls=_style(p), label=p) for p in planets]
    first = ax.legend(handles=by_experiment, title="experiment", fontsize=8, loc="upper left")
    ax.add_artist(first)
    ax.legend(handles=by_planet, title="planet", fontsize=8, loc="lower right")
    ax.set(xlabel=EPOCH_LABEL, ylabel=f"mean over the planet's clients of the\n{REWARD_LABEL}")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig


def comparison_side_by_side(
    experiments: Mapping[str, pd.DataFrame], title: str = "Experiments compared, per planet"
) -> Figure:
    """One panel per planet, one line per experiment (same curves as the combined plot)."""
    curves = _experiment_curves(experiments)
    planets = _all_planets(curves)
    fig, axes = plt.subplots(
        1, len(planets), figsize=(4.5 * len(planets) + 1, 4.5), sharey=True, squeeze=False
    )
    fig.set_layout_engine("constrained")
    for ax, planet in zip(axes[0], planets, strict=True):
        for i, (name, frame) in enumerate(curves.items()):
            curve = frame[frame["planet"] == planet]
            ax.plot(curve["local_epoch"], curve["reward"], color=f"C{i % 10}", lw=1.5, label=name)
        ax.set(title=planet, xlabel=EPOCH_LABEL)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(REWARD_LABEL + "\n(mean over the planet's clients)")
    handles = [Line2D([], [], color=f"C{i % 10}", lw=2, label=n) for i, n in enumerate(curves)]
    fig.legend(handles=handles, title="experiment", loc="outside right center", fontsize=8)
    fig.suptitle(title)
    return fig


UMAP_EXACT_KNN = 4096  # below this many points UMAP takes exact neighbours, not NN-descent


def _umap_exact_knn(weights: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The neighbours UMAP computes itself below ``UMAP_EXACT_KNN`` points (its
    euclidean over all pairs, a stable sort of each row), in NumPy: the same graph
    without compiling UMAP's parallel numba sort (see docs/notes.md)."""
    from sklearn.metrics import pairwise_distances
    from umap.distances import euclidean

    distances = pairwise_distances(weights, metric=euclidean)
    indices = np.argsort(distances, axis=1, kind="stable")[:, :k].astype(np.int32)
    return indices, np.take_along_axis(distances, indices, axis=1)


def _embed(weights: np.ndarray, method: str, seed: int) -> np.ndarray:
    n = len(weights)
    if method == "tsne":
        from sklearn.manifold import TSNE

        # sklearn needs perplexity < n_samples; 30 (its default) for large sets.
        perplexity = min(30.0, max(1.0, (n - 1) / 3))
        return TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(weights)
    if method == "umap":
        with warnings.catch_warnings():  # "n_jobs overridden by random_state": intended
            warnings.simplefilter("ignore", UserWarning)
            import umap

            # n_neighbors < n_samples; spectral init needs more points than 2 + 1.
            k = min(15, n - 1)
            reducer = umap.UMAP(
                n_neighbors=k,
                init="spectral" if n >= 10 else "pca",
                random_state=seed,
                precomputed_knn=_umap_exact_knn(weights, k) if n < UMAP_EXACT_KNN else None,
            )
            return reducer.fit_transform(weights)
    raise ValueError(f"method {method!r} is not one of 'tsne', 'umap'")


def weight_embedding(
    snapshots: pd.DataFrame,
    weights: np.ndarray,
    method: str = "tsne",
    title: str = "",
    seed: int = 0,
) -> Figure:
    """2-D t-SNE or UMAP of the weight snapshots (``load_snapshots``): colour = the
    client's cumulative env step (darker = later), marker = planet.

    Raises
    ------
    ValueError
        With fewer than 3 snapshots (nothing to embed), or an unknown ``method``.
    """
    if method not in ("tsne", "umap"):
        raise ValueError(f"method {method!r} is not one of 'tsne', 'umap'")
    if len(snapshots) != len(weights):
        raise ValueError(f"{len(snapshots)} snapshot rows but {len(weights)} weight vectors")
    if len(weights) < 3:
        raise ValueError(
            f"a {method} embedding needs at least 3 weight snapshots, got {len(weights)} "
            "(train longer or lower ppo.check-freq)"
        )
    points = _embed(np.asarray(weights, dtype=np.float32), method, seed)
    fig, ax = plt.subplots(figsize=(7.5, 6), constrained_layout=True)
    steps = snapshots["step"].to_numpy()
    norm = plt.Normalize(steps.min(), steps.max())
    planets = planets_in(snapshots)
    for planet in planets:
        mask = (snapshots["planet"] == planet).to_numpy()
        marker = _marker(planet)
        ax.scatter(
            points[mask, 0],
            points[mask, 1],
            c=steps[mask],
            cmap=TIME_CMAP,
            norm=norm,
            marker=marker,
            s=28,
            edgecolors="black",
            linewidths=0.3,
        )
    fig.colorbar(
        plt.cm.ScalarMappable(norm=norm, cmap=TIME_CMAP),
        ax=ax,
        label="client env steps (darker = later)",
    )
    ax.legend(
        handles=[
            Line2D(
                [],
                [],
                ls="",
                marker=_marker(p),
                color="lightgray",
                markeredgecolor="black",
                label=p,
            )
            for p in planets
        ],
        title="planet",
        fontsize=8,
    )
    name = {"tsne": "t-SNE", "umap": "UMAP"}[method]
    ax.set(xlabel=f"{name} 1", ylabel=f"{name} 2")
    ax.set_title(title or f"{name} of policy weight snapshots ({len(weights)})")
    return fig


def load_run_config(run_dir: str | Path) -> dict:
    """The resolved run-config a run directory's ``config.json`` holds."""
    return json.loads((Path(run_dir) / "config.json").read_text())["run-config"]


def client_summary(log_dir: str | Path, window: int = WINDOW) -> pd.DataFrame:
    """One row per client of a run's logs: label, planet, episodes, final-reward (mean
    of its last ``window`` training episodes; NaN without one), env-steps.

    ``env-steps`` is the last cumulative step the client's logs record (its last
    finished episode or weight snapshot): exact when ``ppo.check-freq`` divides the
    steps of a round, a lower bound otherwise.
    """
    episodes = load_episodes(log_dir)
    seen = episodes[["label", "planet", "end_step"]].rename(columns={"end_step": "step"})
    try:
        snapshots, _ = load_snapshots(log_dir)
        seen = pd.concat([seen, snapshots[["label", "planet", "step"]]], ignore_index=True)
    except ValueError:  # no snapshots: episodes only
        pass
    summary = seen.groupby(["label", "planet"], as_index=False)["step"].max()
    summary = summary.rename(columns={"step": "env-steps"})
    last = episodes.groupby("label", sort=False).tail(window).groupby("label")["reward"]
    summary["episodes"] = summary["label"].map(episodes.groupby("label").size()).fillna(0)
    summary["final-reward"] = summary["label"].map(last.mean())
    return summary.astype({"episodes": int, "env-steps": int})


def final_central_eval(run_dir: str | Path) -> pd.Series:
    """The last ``central-eval`` row of ``metrics.csv`` (empty when the run has none,
    e.g. ``strategy = 'local'``, which keeps no global model)."""
    path = Path(run_dir) / "metrics.csv"
    metrics = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["scope", "round"])
    central = metrics[metrics["scope"] == "central-eval"]
    return central.sort_values("round").iloc[-1] if len(central) else pd.Series(dtype=float)


def results_table(runs: Mapping[str, str | Path]) -> pd.DataFrame:
    """One row per (experiment, planet) of the runs ``{name: run_dir}``.

    Columns: experiment, planet, strategy, privacy; clients (with at least one
    episode); train-reward and train-reward-std (mean and sample std over the
    planet's clients of each one's mean reward over its last 100 training
    episodes); eval-reward and eval-reward-std (the global model's
    ``eval-reward-<planet>`` in the last central evaluation, NaN without one; for
    clustered FedAvg the best of the K models); planet-env-steps (the planet's
    clients together) and run-env-steps (all clients; see ``client_summary``).
    """
    rows = []
    for name, run_dir in runs.items():
        config = load_run_config(run_dir)
        clients = client_summary(clients_dir(run_dir))
        central = final_central_eval(run_dir)
        for planet in planets_in(clients):
            mine = clients[clients["planet"] == planet]
            rewards = mine["final-reward"].dropna()
            rows.append(
                {
                    "experiment": name,
                    "planet": planet,
                    "strategy": config.get("strategy"),
                    "privacy": config.get("privacy"),
                    "clients": len(rewards),
                    "train-reward": rewards.mean(),
                    "train-reward-std": rewards.std(),
                    "eval-reward": float(central.get(f"eval-reward-{planet}", np.nan)),
                    "eval-reward-std": float(central.get(f"eval-reward-std-{planet}", np.nan)),
                    "planet-env-steps": int(mine["env-steps"].sum()),
                    "run-env-steps": int(clients["env-steps"].sum()),
                }
            )
    return pd.DataFrame(rows)


def single_agent_baseline(configs: Mapping[str, Mapping]) -> str:
    """The one experiment whose run-config has ``strategy = 'local'``."""
    singles = [n for n, c in configs.items() if c.get("strategy") == SINGLE_AGENT_STRATEGY]
    if len(singles) != 1:
        raise ValueError(
            f"need exactly one Single Agent experiment (strategy = 'local') to compare "
            f"with, found {len(singles)}: {singles}"
        )
    return singles[0]


def compare_to_single_agent(
    table: pd.DataFrame, configs: Mapping[str, Mapping], baseline: str | None = None
) -> pd.DataFrame:
    """Per federated experiment and planet: does its final training reward beat the
    Single Agent experiment's?

    Only runs with equal ``num-server-rounds``, ``ppo.local-steps`` and
    ``fraction-train`` take the same env steps (in expectation per client); a run that
    differs in one is flagged (``comparable`` False, ``differs-in``) and warned about.

    Parameters
    ----------
    table : DataFrame
        ``results_table``.
    configs : mapping
        ``{experiment: run-config}`` (``load_run_config``).
    baseline : str, optional
        The Single Agent experiment; default ``single_agent_baseline``.

    Returns
    -------
    DataFrame
        experiment, planet, train-reward, single-agent, difference,
        beats-single-agent (False where either reward is missing), comparable,
        differs-in.
    """
    baseline = baseline or single_agent_baseline(configs)
    if baseline not in configs:
        raise ValueError(f"baseline {baseline!r} is not one of the experiments {list(configs)}")
    reference = configs[baseline]
    single = table[table["experiment"] == baseline].set_index("planet")["train-reward"]
    rows = []
    for name, config in configs.items():
        if name == baseline or config.get("strategy") == SINGLE_AGENT_STRATEGY:
            continue
        differs = [
            f"{key}: {config.get(key)} vs {reference.get(key)}"
            for key in COMPARABLE_KEYS
            if config.get(key) != reference.get(key)
        ]
        if differs:
            warnings.warn(
                f"{name!r} and the Single Agent run {baseline!r} differ in "
                f"{'; '.join(differs)}: their clients took different env steps",
                stacklevel=2,
            )
        for _, row in table[table["experiment"] == name].iterrows():
            theirs = float(single.get(row["planet"], np.nan))
            rows.append(
                {
                    "experiment": name,
                    "planet": row["planet"],
                    "train-reward": row["train-reward"],
                    "single-agent": theirs,
                    "difference": row["train-reward"] - theirs,
                    "beats-single-agent": bool(row["train-reward"] > theirs),
                    "comparable": not differs,
                    "differs-in": "; ".join(differs),
                }
            )
    return pd.DataFrame(rows, columns=_COMPARISON_COLUMNS)


_COMPARISON_COLUMNS = (
    "experiment",
    "planet",
    "train-reward",
    "single-agent",
    "difference",
    "beats-single-agent",
    "comparable",
    "differs-in",
)


def _cell(value, digits: int) -> str:
    if isinstance(value, bool | np.bool_):
        return "yes" if value else "no"
    if isinstance(value, int | np.integer):
        return str(value)
    if isinstance(value, float | np.floating):
        return "–" if np.isnan(value) else f"{value:.{digits}f}"
    if value is None or value is pd.NA:
        return "–"
    return str(value).replace("|", "\\|")


def to_markdown(frame: pd.DataFrame, digits: int = 1) -> str:
    """A GitHub-flavoured markdown table of ``frame`` (floats with ``digits``
    decimals, NaN as "–", booleans as yes/no; numbers right-aligned). Needs no
    ``tabulate``, unlike ``DataFrame.to_markdown``."""
    numeric = [
        pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
        for c in frame.columns
    ]
    lines = [
        "| " + " | ".join(str(c) for c in frame.columns) + " |",
        "| " + " | ".join("---:" if n else "---" for n in numeric) + " |",
    ]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v, digits) for v in row) + " |")
    return "\n".join(lines)
