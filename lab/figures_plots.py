"""The figures of :mod:`lab.figures` (Subspace-DP-FL): utility against
ε, per-group accuracy, the ledger stacked by release kind, SPI(k).

Each function takes the numbers :mod:`lab.figures` computed (its ``figures.csv``
table, ledger stacks, SPI series) and returns a Matplotlib figure, or None when there
is nothing to draw; the command saves them.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator
from matplotlib.transforms import offset_copy

from server_app.plots import colours, save_figure

SCOPE = "central-eval"  # the global model on the central test set
GROUP_PREFIX = "eval-accuracy-"  # eval-accuracy-<group> columns of the SCOPE rows
GAP = "fairness-gap"
MARKERS = "osD^vPX*<>"
DODGE_PX = 8  # pixels between configurations at (nearly) the same ε
LEDGER_CAPTION = (
    "band of kind j at round r = ε(releases of kinds 1..j up to r) − ε(kinds 1..j−1 up to r), "
    "each from a fresh ledger of the run's config (ε does not add); top = the run's ε"
)
TOP_LABEL, FINAL_LABEL = "top: the run's ε", "ledger.json's final ε"
SPI_TITLE = (
    "SPI(k): noise-to-signal floor of the most exposed k-dimensional inversion of one "
    "client's update from one release (mean ± std over seeds); an index, not a DP guarantee"
)
SpiSeries = tuple[np.ndarray, np.ndarray, np.ndarray]  # k, mean, std


@dataclass(frozen=True)
class LedgerStack:
    """A run's ε over rounds, stacked by release kind (see the module docstring)."""

    rounds: np.ndarray
    kinds: tuple[str, ...]
    """Release kinds, bottom band first."""
    cumulative: np.ndarray
    """``[j, i]``: ε of the releases of ``kinds[:j + 1]`` up to ``rounds[i]``."""
    epsilon: float
    """The ledger's own ε over all its releases."""
    delta: float

    @property
    def bands(self) -> np.ndarray:
        """``[j, i]``: the ε that kind j adds on top of the kinds below it."""
        return np.diff(self.cumulative, axis=0, prepend=np.zeros((1, self.rounds.size)))


def save_or_skip(
    figure: Figure | None,
    path: Path,
    why: str,
    echo: Callable[[str], None] = print,
    fmt: str | None = None,
) -> None:
    """Save ``figure`` as ``path`` (its suffix replaced by ``fmt``) and say so, or say
    why it was skipped (None)."""
    if figure is None:
        echo(f"skipped {path.name}: {why}")
        return
    echo(f"wrote {save_figure(figure, path, fmt)}")


def wrap(text: str, width: int = 60) -> str:
    """``text`` on lines of at most ``width`` characters (keys stay whole)."""
    return textwrap.fill(text, width, break_on_hyphens=False)


def _pm(mean: float, std: float) -> str:
    return f"{mean:.3f}" if math.isnan(std) else f"{mean:.3f} ± {std:.3f}"


def _zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def dodges(epsilons: np.ndarray, log: bool = False, tol: float = 0.01) -> np.ndarray:
    """Pixel shifts that set apart points whose ε are within ``tol`` of the span of the
    finite ε (on a log axis, of log ε), in ε order; 0 for the others and non-finite ε."""
    shifts = np.zeros(len(epsilons))
    finite = np.flatnonzero(np.isfinite(epsilons))
    values = np.log(epsilons[finite]) if log else epsilons[finite]
    order = finite[np.argsort(values, kind="stable")]
    ranked = np.sort(values)
    span = np.ptp(ranked) if ranked.size else 0.0
    breaks = np.flatnonzero(np.diff(ranked) > tol * span) + 1 if span > 0 else []
    for cluster in np.split(order, breaks):
        shifts[cluster] = DODGE_PX * (np.arange(cluster.size) - (cluster.size - 1) / 2)
    return shifts


def relations(summary: pd.DataFrame) -> list[str]:
    """The neighbouring relations of the rows with a finite ε (more than one: their ε
    values are not one quantity)."""
    finite = summary[np.isfinite(summary["epsilon"].to_numpy(float))]
    column = finite["relation"] if "relation" in finite else pd.Series(dtype=str)
    return sorted({r for r in column if isinstance(r, str) and r})


def _label(row, mixed: bool) -> str:
    """A configuration's legend entry: its relation when the plot mixes relations, and a
    warning when its noise came from the seed."""
    label = f"{row.configuration} (n={row.n_runs})"
    failed = int(getattr(row, "n_failed", 0) or 0)
    if failed:
        label += f" [{failed} failed run(s) left out]"
    if mixed and getattr(row, "relation", ""):
        label += f" [{row.relation}]"
    if getattr(row, "noise_from_seed", False):
        label += " [noise from seed: no ε against seed holders]"
    return wrap(label, 90)


def _draw_points(left, right, summary: pd.DataFrame, log: bool) -> None:
    """Finite ε on ``left`` (± std both ways), ε = ∞ on ``right`` plus a dashed line."""
    colour = colours(list(summary["configuration"]))
    shifts = dodges(summary["epsilon"].to_numpy(float), log)
    mixed = len(relations(summary)) > 1
    for k, row in enumerate(summary.itertuples()):
        if math.isnan(row.utility_mean):  # every run failed: no point (the title says so)
            continue
        style = {
            "color": colour[row.configuration],
            "fmt": MARKERS[k % len(MARKERS)],
            "capsize": 4,
            "ms": 8,
            "label": _label(row, mixed),
        }
        if math.isinf(row.epsilon):
            right.errorbar(0, row.utility_mean, yerr=_zero(row.utility_std), **style)
            left.axhline(row.utility_mean, color=style["color"], ls="--", lw=1, alpha=0.7)
        elif math.isfinite(row.epsilon):
            bars = left.errorbar(
                row.epsilon,
                row.utility_mean,
                yerr=_zero(row.utility_std),
                xerr=_zero(row.epsilon_std),
                **style,
            )
            # Dodge after the data limits are set, so configurations at one ε stay apart.
            dodged = offset_copy(left.transData, fig=left.figure, x=shifts[k], units="dots")
            for artist in bars.get_children():
                artist.set_transform(dodged)


def plot_utility_vs_epsilon(summary: pd.DataFrame, metric: str) -> Figure:
    """Final utility (mean ± std over seeds) against final ε; ε = ∞ (no DP) in a narrow
    right panel, with a dashed reference line across the ε panel."""
    eps = summary["epsilon"].to_numpy(float)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10, 6.5), sharey=True, width_ratios=(5, 1), layout="constrained"
    )
    finite = eps[np.isfinite(eps)]
    log = bool(finite.size and finite.min() > 0 and finite.max() / finite.min() > 10)
    if log:
        left.set_xscale("log")
    _draw_points(left, right, summary, log)
    if not finite.size:
        left.text(0.5, 0.5, "no run with a finite ε", transform=left.transAxes, ha="center")
    delta = summary["delta"].max()
    mixed = relations(summary)
    left.set(
        xlabel=(f"final ε (δ = {delta:g})" if delta == delta else "final ε")
        + f"; points at nearly one ε set {DODGE_PX} px apart"
        + (
            f"\nneighbouring relations differ ({', '.join(mixed)}): ε under one is not ε "
            "under the other"
            if len(mixed) > 1
            else (f"; neighbouring relation {mixed[0]}" if mixed else "")
        ),
        ylabel=f"final {metric} ({SCOPE}), mean ± std over seeds",
    )
    right.set(xlim=(-1, 1), xticks=[0], xticklabels=["ε = ∞\n(no DP)"])
    right.set_visible(bool(np.isinf(eps).any()))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    missing = summary.loc[np.isnan(eps), "configuration"]
    utility = summary["utility_mean"].to_numpy(float)
    failed = summary["n_failed"].to_numpy(int) if "n_failed" in summary else 0 * utility
    every_failed = summary.loc[np.isnan(utility) & (failed > 0), "configuration"]
    title = f"Utility vs privacy: final {metric} against final ε"
    if np.isinf(eps).any():
        title += " (dashed: no-DP level)"
    if len(missing):
        title += "\nnot drawn, no ledger.json: " + wrap(", ".join(missing), 100)
    if len(every_failed):
        title += "\nnot drawn, every run failed or diverged: " + wrap(", ".join(every_failed), 100)
    if "n_failed" in summary and summary["n_failed"].sum():
        title += f"\n{int(summary['n_failed'].sum())} failed/diverged run(s) left out of the means"
    fig.suptitle(title)
    fig.legend(loc="outside lower center", fontsize=8)
    return fig


def group_columns(summary: pd.DataFrame) -> list[str]:
    """The ``eval-accuracy-<group>`` columns of the table (from ``<column>_mean``)."""
    return [
        c.removesuffix("_mean")
        for c in summary.columns
        if c.startswith(GROUP_PREFIX) and c.endswith("_mean")
    ]


def plot_fairness(summary: pd.DataFrame) -> Figure | None:
    """Per configuration, grouped bars of final accuracy per group (± std), the fairness
    gap annotated; None when no configuration reports groups."""
    groups = group_columns(summary)
    means = summary[[f"{g}_mean" for g in groups]]
    shown = summary[means.notna().any(axis=1)] if groups else summary[:0]
    if shown.empty:
        return None
    means = shown[[f"{g}_mean" for g in groups]].to_numpy(float)
    stds = np.nan_to_num(shown[[f"{g}_std" for g in groups]].to_numpy(float))
    x, width = np.arange(len(shown)), 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(max(7.0, 2.4 * len(shown)), 5.5), layout="constrained")
    for i, group in enumerate(groups):
        offset = (i - (len(groups) - 1) / 2) * width
        label = group.removeprefix(GROUP_PREFIX)
        ax.bar(x + offset, means[:, i], width, yerr=stds[:, i], capsize=3, label=label)
    tops = np.nanmax(means + stds, axis=1)
    for j, row in enumerate(shown.itertuples()):
        text = f"gap {_pm(row.fairness_gap_mean, row.fairness_gap_std)}"
        ax.annotate(text, (x[j], tops[j]), xytext=(0, 6), textcoords="offset points", ha="center")
    names = [f"{c} (n={n})" for c, n in zip(shown["configuration"], shown["n_runs"], strict=True)]
    ax.set_xticks(x, [wrap(name, 32) for name in names], fontsize=7)
    top = max(1.0, float(np.nanmax(tops))) * 1.15
    ax.set(ylabel=f"final accuracy per group ({SCOPE})", ylim=(0, top))
    ax.set_title(f"Per-group accuracy, mean ± std over seeds; gap = {GAP} (else max − min)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(title="group", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _draw_stack(ax, stack: LedgerStack, colour: Mapping[str, str], title: str) -> None:
    band_colours = [colour[k] for k in stack.kinds]
    ax.stackplot(stack.rounds, stack.bands, labels=stack.kinds, colors=band_colours, alpha=0.8)
    ax.plot(stack.rounds, stack.cumulative[-1], "k.-", lw=0.8, ms=3, label=TOP_LABEL)
    ax.plot(stack.rounds[-1], stack.epsilon, "rx", ms=9, mew=2, label=FINAL_LABEL)
    ax.set(xlabel="server round", ylabel=f"ε (δ = {stack.delta:g})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(wrap(title, 60), fontsize=8)
    ax.grid(alpha=0.3)


def plot_ledgers(stacks: Mapping[str, tuple[LedgerStack, Any]]) -> Figure:
    """One panel per configuration ``{label: (stack, seed)}``: ε over rounds, stacked by
    release kind (one colour per kind across panels)."""
    colour = colours(list(dict.fromkeys(k for s, _ in stacks.values() for k in s.kinds)))
    cols = min(3, len(stacks))
    rows = -(-len(stacks) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.6 * cols, 4.2 * rows + 0.8), squeeze=False, layout="constrained"
    )
    for ax, (label, (stack, seed)) in zip(axes.flat, stacks.items(), strict=False):
        _draw_stack(ax, stack, colour, f"{label} (seed {seed})")
    for ax in axes.flat[len(stacks) :]:
        ax.set_visible(False)
    legend: dict[str, Any] = {}  # one legend for all panels: the colours are shared
    for ax in axes.flat[: len(stacks)]:
        legend |= {label: h for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    keys = sorted(legend, key=lambda label: label in (TOP_LABEL, FINAL_LABEL))  # kinds first
    handles = [legend[key] for key in keys]
    fig.legend(handles, keys, loc="outside lower center", ncols=4, fontsize=8)
    title = "ε over rounds, stacked by release kind (first seed of each configuration)"
    fig.suptitle(f"{title}\n{wrap(LEDGER_CAPTION, 50 * cols)}", fontsize=9)
    return fig


def spi_series(certificates: Sequence[Mapping[str, Any] | None]) -> SpiSeries | None:
    """``(k, mean, std)`` of SPI(k) over the runs' ``certificates.json`` that have one (the
    runs on the first one's k grid); None when none has."""
    series = [c["spi"] for c in certificates if c and c.get("spi") and c["spi"].get("k")]
    if not series:
        return None
    k = np.asarray(series[0]["k"], float)
    same = [s["value"] for s in series if np.array_equal(np.asarray(s["k"], float), k)]
    values = np.asarray(same, float)
    std = values.std(axis=0, ddof=1) if len(same) > 1 else np.zeros(k.size)
    return k, values.mean(axis=0), std


def plot_spi(series: Mapping[str, SpiSeries]) -> Figure | None:
    """SPI(k) against k per configuration ``{label: (k, mean, std)}`` (log-log), ± std
    band; None when no series has a positive value."""
    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
    colour = colours(list(series))
    for label, (k, mean, std) in series.items():
        keep = mean > 0  # a log axis shows positive values only
        ax.plot(k[keep], mean[keep], "o-", color=colour[label], label=wrap(label, 90))
        low = np.maximum(mean - std, mean * 1e-3)[keep]
        ax.fill_between(k[keep], low, (mean + std)[keep], color=colour[label], alpha=0.2, lw=0)
    if not ax.has_data():
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    if high / low < 10:  # within a decade the minor ticks are the only labels
        ax.yaxis.set_minor_formatter(plain)
    ax.set(xlabel="subspace dimension k", ylabel="SPI(k)  (higher = more private)")
    ax.set_title(wrap(SPI_TITLE, 100), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.legend(loc="outside lower center", fontsize=8)
    return fig
