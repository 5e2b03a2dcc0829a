"""Learning-curve plots from metrics frames (one run, or many runs compared)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# One colour per scope, the same on every panel.
_COLOURS = {"central-eval": "tab:blue", "federated-eval": "tab:orange", "train": "tab:green"}

# (scope, metric, label) drawn on the accuracy and loss panels.
_ACCURACY = (
    ("central-eval", "eval-accuracy", "global model, central test set"),
    ("federated-eval", "eval-accuracy", "clients' local test splits"),
)
_REWARD = (
    ("central-eval", "eval-reward", "global model, central environments"),
    ("federated-eval", "eval-reward", "clients' own environments"),
    ("train", "train-reward", "local training episodes (clients)"),
)
_LOSS = (
    ("train", "train-loss", "local training (clients)"),
    ("federated-eval", "eval-loss", "clients' local test splits"),
    ("central-eval", "eval-loss", "global model, central test set"),
)


def _draw(ax, frame: pd.DataFrame, series, prefix: str = "") -> None:
    for scope, metric, label in series:
        rows = frame[frame["scope"] == scope]
        if metric in rows and rows[metric].notna().any():
            ax.plot(
                rows["round"],
                rows[metric],
                marker="o",
                ms=3,
                label=prefix + label,
                color=_COLOURS[scope],
            )


def _has(frame: pd.DataFrame, metric: str) -> bool:
    return metric in frame and frame[metric].notna().any()


def plot_learning_curve(frame: pd.DataFrame, title: str, caption: str = "") -> Figure:
    """Accuracy (or, for RL tasks, episode reward) and loss per round of one run;
    ``caption`` (the run's ε, δ and threat model: :mod:`server_app.run_status`) is the
    title's second line."""
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    if not _has(frame, "eval-accuracy") and (
        _has(frame, "eval-reward") or _has(frame, "train-reward")
    ):
        _draw(acc, frame, _REWARD)
        acc.set(xlabel="server round", ylabel="mean episode reward", title="Reward")
    else:
        _draw(acc, frame, _ACCURACY)
        acc.set(xlabel="server round", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    _draw(loss, frame, _LOSS)
    loss.set(xlabel="server round", ylabel="training / evaluation loss", title="Loss")
    for ax in (acc, loss):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    shown = textwrap.fill(caption, 100, break_on_hyphens=False) if caption else ""
    fig.suptitle(f"{title}\n{shown}" if caption else title)
    return fig


def plot_comparison(
    frame: pd.DataFrame,
    metric: str = "eval-accuracy",
    scope: str = "federated-eval",
    captions: Mapping[str, str] | None = None,
) -> Figure:
    """One line per run (label: strategy/privacy/seed, and ``captions[run]``: its ε or
    status) of ``metric`` in ``scope``."""
    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    rows = frame[frame["scope"] == scope]
    for run, group in rows.groupby("run", sort=True):
        first = group.iloc[0]
        label = f"{first['strategy']} / {first['privacy']} / seed {first['seed']}"
        if captions and captions.get(run):
            label += "\n" + textwrap.fill(captions[run], 70, break_on_hyphens=False)
        ax.plot(group["round"], group[metric], marker="o", ms=3, label=label)
    ax.set(xlabel="server round", ylabel=metric, title=f"{metric} ({scope})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)
    return fig


def comparison_scope(frame: pd.DataFrame, metric: str = "eval-accuracy") -> tuple[str, list[str]]:
    """The evaluation scope to compare runs on, and the runs it leaves out: the scope
    that most runs report ``metric`` in, central evaluation on a tie. Under a privacy
    mechanism federated evaluation is off (it is not covered by the ε), so a comparison
    on it would silently drop the private runs."""
    runs = sorted(frame["run"].unique())
    have = {}
    for scope in ("central-eval", "federated-eval"):
        rows = frame[(frame["scope"] == scope)]
        have[scope] = set(rows.loc[rows[metric].notna(), "run"]) if metric in rows else set()
    scope = max(("central-eval", "federated-eval"), key=lambda s: len(have[s]))
    return scope, [run for run in runs if run not in have[scope]]


def colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per name, in order (Matplotlib's cycle), the same on every figure."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


FORMATS = ("png", "svg", "pdf")


def figure_title(figure: Figure) -> str:
    """The figure's title (suptitle, else the axes' titles joined by " | ")."""
    suptitle = getattr(figure, "_suptitle", None)
    if suptitle is not None and suptitle.get_text():
        return suptitle.get_text()
    return " | ".join(t for ax in figure.axes if (t := ax.get_title()))


def save_figure(figure, path: Path, fmt: str | None = None) -> Path:
    """Save ``figure`` as ``path`` (parents created, 120 dpi) and close it; ``fmt`` (one
    of :data:`FORMATS`) replaces the suffix. The title (with the ε a caption gives it) is
    also the file's ``Title`` metadata, so tools read it back without the image."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt!r}: valid formats are {', '.join(FORMATS)}")
        path = path.with_suffix(f".{fmt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    title = figure_title(figure)
    metadata = {"Title": title} if title else {}
    figure.savefig(path, dpi=120, metadata=metadata)
    plt.close(figure)
    return path
