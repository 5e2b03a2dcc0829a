"""Figures of a multi-seed strategy comparison (the SmartFedProx study's ``run_comparison.py``):
per-round curves as the mean over seeds with a ± std band, one line per experiment,
and how often each client was selected.

:func:`load_trials` reads the run directories into two long frames: every run's
``metrics.csv`` rows (columns ``round``, ``scope``, metric columns) and ``participation.csv``
rows (``round``, ``node-id``, …), each tagged with ``experiment`` and ``seed``; the
figures draw from those, and :func:`save_figures` writes them all. A panel whose metric
no run reports says so instead of failing; the experiment names and metric columns are
whatever the runs have. :mod:`lab.comparison` is the command.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lab.study import StudyError
from server_app.plots import colours, save_figure
from server_app.results import SCOPES, TIMING_COLUMNS, load_metrics, table_path

SELECTION = "selection"  # Panel.scope of the per-client selection counts (participation.csv:
# one row per client sent a train message, whatever the strategy)
# The client column of participation.csv: a partition id when a run records one (stable
# across runs); else Flower's node id, which a simulation draws anew for every run.
CLIENT_COLUMNS = ("partition-id", "node-id")


@dataclass(frozen=True)
class Panel:
    """One panel: ``metric`` of the rows of ``scope`` (or selection counts)."""

    scope: str
    """``metrics.csv`` scope (train, federated-eval, central-eval) or ``SELECTION``."""
    metric: str
    """Metric column; for ``SELECTION`` unused (the client column is found)."""
    title: str
    ylabel: str


# The six panels of the SmartFedProx study's comparison_results.png.
PANELS: tuple[Panel, ...] = (
    Panel("central-eval", "eval-r2", "R² score (global model, central test set)", "R²"),
    Panel("central-eval", "eval-mse", "MSE (global model, central test set)", "MSE"),
    Panel("train", "train-loss", "Training loss (mean over clients)", "train loss"),
    Panel("train", "divergence", "Model divergence ‖w_local − w_global‖", "divergence"),
    Panel("train", "effective-mu", "Effective proximal μ (mean over clients)", "μ"),
    Panel(SELECTION, "times-selected", "Client selection (mean over seeds)", "times selected"),
)
# Single-panel figures next to comparison_results.png.
FIGURES: dict[str, Panel] = {
    "r2_comparison.png": PANELS[0],
    "mse_comparison.png": PANELS[1],
}
# Classification runs (no eval-r2, an eval-accuracy): the first two panels and figures.
CLASSIFICATION_PANELS: tuple[Panel, ...] = (
    Panel("central-eval", "eval-accuracy", "Accuracy (global model, central test set)", "acc."),
    Panel("central-eval", "eval-loss", "Loss (global model, central test set)", "loss"),
)
CLASSIFICATION_FIGURES = ("accuracy_comparison.png", "loss_comparison.png")


def panels_for(metrics: pd.DataFrame) -> tuple[tuple[Panel, ...], dict[str, Panel]]:
    """The six panels and the single-panel figures for what the runs report: the
    SmartFedProx study's regression panels, or accuracy and loss in their place for
    classification runs."""
    if "eval-r2" in metrics or "eval-accuracy" not in metrics:
        return PANELS, FIGURES
    panels = (*CLASSIFICATION_PANELS, *PANELS[2:])
    return panels, dict(zip(CLASSIFICATION_FIGURES, CLASSIFICATION_PANELS, strict=True))


# metrics.csv / load_metrics columns that are not metrics, and metrics not worth a curve.
TAGS = ("round", "scope", "experiment", "seed", "task", "strategy", "privacy", "run")
NO_CURVE = (*TIMING_COLUMNS, "num-examples")


def metric_curve(metrics: pd.DataFrame, scope: str, metric: str) -> pd.DataFrame:
    """Per experiment and round: ``mean``, ``std`` (ddof 1) and ``seeds`` (count) of
    ``metric`` over the seeds whose ``scope`` row of that round reports it.

    A run with several rows of one round and scope counts its last one; NaN values are
    left out. Empty (with those columns) when no run reports the metric.
    """
    columns = ["experiment", "round", "mean", "std", "seeds"]
    if metric not in metrics:
        return pd.DataFrame(columns=columns)
    rows = metrics.loc[metrics["scope"] == scope, ["experiment", "seed", "round", metric]]
    rows = rows.dropna(subset=[metric, "round"])
    per_run = rows.groupby(["experiment", "seed", "round"], sort=False)[metric].last()
    curve = per_run.groupby(level=["experiment", "round"]).agg(["mean", "std", "count"])
    curve = curve.reset_index().rename(columns={"count": "seeds"})
    return curve.sort_values(["experiment", "round"], kind="stable")[columns]


def client_column(selection: pd.DataFrame) -> str | None:
    """The column of ``selection`` that names the client, or None."""
    return next((c for c in CLIENT_COLUMNS if c in selection), None)


def selection_ranks(selection: pd.DataFrame, num_clients: int | None = None) -> pd.DataFrame:
    """How often the clients were selected, ranked within each run (1 = most often),
    then per experiment and rank the ``mean`` and ``std`` over its seeds.

    Ranking inside a run makes runs comparable even where client ids differ between
    runs (simulation node ids). A client never selected in a run counts 0 there, up to
    ``num_clients`` clients (default: the most distinct clients any run selected).
    """
    columns = ["experiment", "rank", "mean", "std", "seeds"]
    client = client_column(selection)
    if client is None or selection.empty:
        return pd.DataFrame(columns=columns)
    counts = selection.groupby(["experiment", "seed", client], sort=False).size()
    runs = counts.groupby(level=["experiment", "seed"], sort=False)
    size = num_clients or int(runs.size().max())
    ranked = []
    for (experiment, seed), run in runs:
        top = np.sort(run.to_numpy())[::-1][:size]
        padded = np.pad(top, (0, size - len(top)))
        ranked += [(experiment, seed, r + 1, n) for r, n in enumerate(padded)]
    frame = pd.DataFrame(ranked, columns=["experiment", "seed", "rank", "count"])
    table = frame.groupby(["experiment", "rank"], sort=False)["count"].agg(
        ["mean", "std", "count"]
    )
    return table.reset_index().rename(columns={"count": "seeds"})[columns]


def _not_reported(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _note(ax: Axes, text: str) -> None:
    ax.text(0.01, 0.01, text, transform=ax.transAxes, fontsize=7, color="0.4", va="bottom")


MAX_BARS = 8  # ranks shown as grouped bars; more: one step line per experiment (legible)


def draw_curves(
    ax: Axes,
    curve: pd.DataFrame,
    panel: Panel,
    palette: Mapping[str, str],
    labels: Mapping[str, str] | None = None,
) -> None:
    """One line per experiment of ``palette`` (mean) with a ± std band; ``labels``: the
    legend entry per experiment (its ε, failed runs), default the name."""
    missing = []
    for name, colour in palette.items():
        rows = curve[curve["experiment"] == name]
        if rows.empty:
            missing.append(name)
            continue
        x, mean = rows["round"].to_numpy(float), rows["mean"].to_numpy(float)
        std = rows["std"].fillna(0.0).to_numpy(float)  # one seed: no band
        label = (labels or {}).get(name, name)
        ax.plot(x, mean, marker="o", ms=3, color=colour, label=label)
        ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.2, lw=0)
    ax.set(xlabel="server round", ylabel=panel.ylabel, title=panel.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not ax.has_data():
        _not_reported(ax, f"{panel.metric} not reported ({panel.scope})")
        return
    ax.legend(fontsize=8)
    if missing:
        _note(ax, "not reported: " + ", ".join(missing))


def _missing_selection(selection: pd.DataFrame, runs: Mapping[str, Collection[int]]) -> list[str]:
    """Experiments (or ``experiment:seed`` runs) without selection rows."""
    have = set(zip(selection.get("experiment", []), selection.get("seed", []), strict=True))
    missing = []
    for name, seeds in runs.items():
        lacking = [seed for seed in seeds if (name, seed) not in have]
        if len(lacking) == len(seeds):
            missing.append(name)
        else:
            missing += [f"{name}:{seed}" for seed in lacking]
    return missing


def draw_selection(
    ax: Axes,
    selection: pd.DataFrame,
    runs: Mapping[str, Collection[int]],
    palette: Mapping[str, str],
    panel: Panel = PANELS[-1],
    labels: Mapping[str, str] | None = None,
) -> None:
    """Per experiment, mean times selected of the rank-r client (± std over seeds):
    grouped bars up to ``MAX_BARS`` ranks, else one step line per experiment with a
    ± std band (bars of dozens of clients cannot be read). Runs without
    ``participation.csv`` are named in a note."""
    ranks = selection_ranks(selection)
    shown = [name for name in palette if (ranks["experiment"] == name).any()]
    width = 0.8 / max(len(shown), 1)
    many = bool(len(ranks)) and ranks["rank"].max() > MAX_BARS
    for i, name in enumerate(shown):
        rows = ranks[ranks["experiment"] == name]
        std = rows["std"].fillna(0.0).to_numpy(float)
        label = (labels or {}).get(name, name)
        if many:
            x, mean = rows["rank"].to_numpy(float), rows["mean"].to_numpy(float)
            ax.step(x, mean, where="mid", color=palette[name], lw=1.8, label=label)
            ax.fill_between(
                x, mean - std, mean + std, step="mid", color=palette[name], alpha=0.2, lw=0
            )
            continue
        x = rows["rank"].to_numpy(float) + (i - (len(shown) - 1) / 2) * width
        ax.bar(x, rows["mean"], width, yerr=std, color=palette[name], label=label, capsize=2)
    ax.set(
        xlabel="clients ranked by times selected (1 = most)",
        ylabel=panel.ylabel,
        title=panel.title,
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, axis="y")
    if not shown:
        _not_reported(ax, "selection not reported (no participation.csv)")
        return
    ax.legend(fontsize=8)
    missing = _missing_selection(selection, {k: runs[k] for k in palette if k in runs})
    if missing:
        _note(ax, "no participation.csv: " + ", ".join(missing))


def draw_panel(
    ax: Axes,
    panel: Panel,
    metrics: pd.DataFrame,
    selection: pd.DataFrame,
    runs: Mapping[str, Collection[int]],
    labels: Mapping[str, str] | None = None,
) -> None:
    """Draw ``panel`` of the runs ``{experiment: seeds}`` on ``ax`` (``labels``: legend
    entries by experiment)."""
    palette = colours(list(runs))
    if panel.scope == SELECTION:
        draw_selection(ax, selection, runs, palette, panel, labels)
    else:
        curve = metric_curve(metrics, panel.scope, panel.metric)
        draw_curves(ax, curve, panel, palette, labels)


def comparison_figure(
    metrics: pd.DataFrame,
    selection: pd.DataFrame,
    runs: Mapping[str, Collection[int]],
    panels: Sequence[Panel] = PANELS,
    labels: Mapping[str, str] | None = None,
) -> Figure:
    """``comparison_results.png``: the panels in a grid of three columns."""
    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(17, 4.6 * rows), constrained_layout=True)
    flat = np.atleast_1d(axes).ravel()
    for ax, panel in zip(flat, panels, strict=False):
        draw_panel(ax, panel, metrics, selection, runs, labels)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    seeds = sorted({seed for run_seeds in runs.values() for seed in run_seeds})
    fig.suptitle(
        f"{len(runs)} experiments, seeds {', '.join(map(str, seeds))}: mean ± std over seeds"
    )
    return fig


def metric_figure(
    metrics: pd.DataFrame,
    selection: pd.DataFrame,
    runs: Mapping[str, Collection[int]],
    panel: Panel,
    labels: Mapping[str, str] | None = None,
) -> Figure:
    """One panel on its own (``r2_comparison.png``, ``mse_comparison.png``)."""
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    draw_panel(ax, panel, metrics, selection, runs, labels)
    return fig


def _read_run(name: str, seed: int, run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """One run's metrics (numeric, non-finite → NaN) and selection rows, tagged."""
    try:
        metrics = load_metrics(run_dir)
    except (OSError, ValueError, KeyError) as err:  # no/garbled metrics.csv or config.json
        raise StudyError(f"{name}:{seed}: cannot read the run {run_dir}: {err!r}") from None
    if not {"round", "scope"} <= set(metrics):
        raise StudyError(f"{name}:{seed}: {run_dir}/metrics.csv has no round/scope columns")
    for column in [c for c in metrics.columns if c == "round" or c not in TAGS]:
        metrics[column] = pd.to_numeric(metrics[column], errors="coerce")
    metrics = metrics.replace([np.inf, -np.inf], np.nan)
    selection = None
    table = table_path(run_dir, "participation.csv")  # privacy runs: under curator/
    if table is not None:
        try:
            selection = pd.read_csv(table)
        except pd.errors.EmptyDataError:  # written before any round finished
            selection = None
        except (OSError, ValueError) as err:
            raise StudyError(f"{name}:{seed}: cannot read {table}: {err!r}") from None
    for frame in (metrics, selection):
        if frame is not None:
            frame["experiment"], frame["seed"] = name, seed
    return metrics, selection


def load_trials(runs: Mapping[str, Mapping[int, Path]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every run's ``metrics.csv`` and ``participation.csv`` rows (where a run has one),
    with columns ``experiment`` and ``seed`` added."""
    metrics, selection = [], []
    for name, seeds in runs.items():
        for seed, run_dir in seeds.items():
            run_metrics, run_selection = _read_run(name, seed, Path(run_dir))
            metrics.append(run_metrics)
            if run_selection is not None:
                selection.append(run_selection)
    if not metrics:
        raise StudyError("no runs to compare")
    if selection:
        return pd.concat(metrics, ignore_index=True), pd.concat(selection, ignore_index=True)
    return pd.concat(metrics, ignore_index=True), pd.DataFrame(columns=["experiment", "seed"])


def reported_metrics(metrics: pd.DataFrame) -> list[tuple[str, str]]:
    """``(scope, metric)`` of every metric column some run reports in a scope."""
    columns = [c for c in metrics.columns if c not in TAGS and c not in NO_CURVE]
    return [
        (scope, column)
        for scope in SCOPES
        for column in columns
        if metrics.loc[metrics["scope"] == scope, column].notna().any()
    ]


def save_figures(
    metrics: pd.DataFrame,
    selection: pd.DataFrame,
    runs: Mapping[str, Collection[int]],
    out: Path,
    labels: Mapping[str, str] | None = None,
    fmt: str = "png",
) -> list[Path]:
    """``comparison_results.png``, the ``FIGURES`` and ``curves/<scope>/<metric>.png`` for
    every reported metric (as ``fmt``: png, svg or pdf; ``labels``: legend entries by
    experiment, e.g. with its ε); returns the paths."""
    panels, figures = panels_for(metrics)
    comparison = comparison_figure(metrics, selection, runs, panels, labels)
    saved = [save_figure(comparison, out / "comparison_results.png", fmt)]
    for file, panel in figures.items():
        figure = metric_figure(metrics, selection, runs, panel, labels)
        saved.append(save_figure(figure, out / file, fmt))
    for scope, metric in reported_metrics(metrics):
        panel = Panel(scope, metric, f"{metric} ({scope}), mean ± std over seeds", metric)
        figure = metric_figure(metrics, selection, runs, panel, labels)
        saved.append(save_figure(figure, out / "curves" / scope / f"{metric}.png", fmt))
    return saved
