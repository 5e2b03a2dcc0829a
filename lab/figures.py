"""Paper figures over finished run directories: utility against ε, per-group fairness,
the privacy ledger stacked by release kind, and SPI(k).

Subspace-DP-FL claims
utility-privacy trade-offs, group fairness, rigorous client-level accounting and an
SPI(k) "Subspace Privacy Index"; these figures show each of them for any set of runs::

    python -m lab.figures PATH [PATH ...] --out DIR [--metric eval-accuracy]

Design notes: ``docs/notes.md``, ``lab.figures``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config.renamed import current_keys
from lab.checks import failed_runs
from privacy.accounting import PrivacyLedger
from server_app import run_status

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from lab.figures_plots import LedgerStack

# matplotlib, pandas and the run loader (PyTorch) are imported by the functions that use
# them, so that ``--help`` answers at once; the names below are those modules' own
# (``lab.figures_plots``, ``server_app.plots.FORMATS``, ``server_app.results``
# ``TIMING_COLUMNS``), kept equal by tests/lab/test_lazy_imports.py.
SCOPE = "central-eval"  # the global model on the central test set
GROUP_PREFIX = "eval-accuracy-"  # eval-accuracy-<group> columns of the SCOPE rows
GAP = "fairness-gap"
FORMATS = ("png", "svg", "pdf")
TIMING_COLUMNS = ("elapsed-s", "round-seconds", "train-seconds")

DEFAULT_METRICS = ("eval-accuracy", "eval-auc", "eval-r2", "eval-reward")
NOT_CONFIGURATION = ("seed", "output-dir")  # run-config keys that leave the configuration
NOT_METRICS = ("round", "scope", *TIMING_COLUMNS, "task", "strategy", "privacy", "seed", "run")
MAX_LEDGER_POINTS = 50
TAGS = ("task", "strategy", "privacy")  # run-config keys copied into figures.csv
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Keys of the privacy mechanisms: a run without one (privacy = none) is not labelled by them.
PRIVACY_PREFIXES = ("dp.", "subspace.", "audit.")


class FiguresError(ValueError):
    """Bad input: a PATH without run directories, an unknown --metric, an unreadable run."""


@dataclass(frozen=True)
class Run:
    """One run directory, read."""

    path: Path
    config: dict[str, Any]
    """The resolved run-config (``config.json["run-config"]``)."""
    metrics: pd.DataFrame
    """``metrics.csv``, metric columns numeric (non-finite → NaN)."""
    ledger: dict | None
    """``ledger.json`` (``summary`` and ``state``), or None."""
    certificates: dict | None
    """``certificates.json``, or None."""
    status: run_status.RunStatus | None = None
    """ε, δ, threat model and outcome (``outcome.json``)."""


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Every run directory in ``paths`` (each a run directory or holds some), in order."""
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise FiguresError(f"PATH {str(path)!r} is not a directory")
        runs = [path] if _is_run_dir(path) else sorted(_nested_runs(path))
        if not runs:
            raise FiguresError(
                f"PATH {str(path)!r} holds no run directory (a directory with config.json "
                "and metrics.csv), at any depth"
            )
        found.update(dict.fromkeys(run.resolve() for run in runs))
    return list(found)


def _is_run_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "metrics.csv").is_file()


def _nested_runs(path: Path) -> list[Path]:
    return [c.parent for c in path.rglob("config.json") if _is_run_dir(c.parent)]


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FiguresError(f"cannot read {path}: {err}") from None


def load_run(path: Path) -> Run:
    """Read one run directory (``ledger.json`` and ``certificates.json`` optional)."""
    import numpy as np
    import pandas as pd

    from server_app.results import load_metrics

    try:
        metrics = load_metrics(path)
        config = current_keys(json.loads((path / "config.json").read_text())["run-config"])
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise FiguresError(f"cannot read the run {path}: {err!r}") from None
    for column in [c for c in metrics.columns if c not in NOT_METRICS or c == "round"]:
        metrics[column] = pd.to_numeric(metrics[column], errors="coerce")
    metrics = metrics.replace([np.inf, -np.inf], np.nan)
    ledger, certificates = _read_json(path / "ledger.json"), _read_json(path / "certificates.json")
    return Run(path, config, metrics, ledger, certificates, run_status.read(path))


def available_metrics(runs: Sequence[Run]) -> list[str]:
    """Metric columns some run reports in its ``SCOPE`` rows."""
    found: dict[str, None] = {}
    for run in runs:
        rows = run.metrics[run.metrics["scope"] == SCOPE]
        for column in rows.columns:
            skip = column in NOT_METRICS or column.startswith("num-examples")
            if not skip and rows[column].notna().any():
                found[column] = None
    return list(found)


def choose_metric(runs: Sequence[Run], metric: str | None) -> str:
    """``metric`` if reported, else (None) the first of ``DEFAULT_METRICS`` reported."""
    valid = available_metrics(runs)
    if metric is None:
        metric = next((m for m in DEFAULT_METRICS if m in valid), None)
        if metric is None:
            raise FiguresError(
                f"--metric: none of {list(DEFAULT_METRICS)} is reported in the runs' {SCOPE} "
                f"rows; give one of {valid}"
            )
    elif metric not in valid:
        raise FiguresError(f"--metric {metric!r} is not in the runs' {SCOPE} rows; valid: {valid}")
    return metric


def app_defaults(pyproject: Path = PYPROJECT) -> dict[str, Any]:
    """Run-config defaults (``[tool.flwr.app.config]``, flattened); {} if unreadable."""
    try:
        doc = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return {}

    def flat(table: Mapping, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in table.items():
            nested = isinstance(value, dict)
            out |= flat(value, f"{prefix}{key}.") if nested else {prefix + key: value}
        return out

    return flat(doc)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def configuration_labels(
    configs: Sequence[Mapping[str, Any]], defaults: Mapping[str, Any] | None = None
) -> list[str]:
    """``privacy / strategy`` (``/ task`` if tasks differ), then ``key=value`` of every key
    that differs between ``configs`` where this config's value is not the default (the
    privacy mechanism's keys only where privacy is on)."""
    defaults = app_defaults() if defaults is None else defaults
    skip = {*NOT_CONFIGURATION, "task", "strategy", "privacy"}
    keys = sorted({key for config in configs for key in config} - skip)
    differ = [k for k in keys if len({json.dumps(c.get(k), default=str) for c in configs}) > 1]
    tasks = len({c.get("task") for c in configs}) > 1
    labels: list[str] = []
    for config in configs:
        head = f"{config.get('privacy')} / {config.get('strategy')}"
        head += f" / {config.get('task')}" if tasks else ""
        keep = [k for k in differ if k not in defaults or config.get(k) != defaults[k]]
        if config.get("privacy", "none") == "none":
            keep = [k for k in keep if not k.startswith(PRIVACY_PREFIXES)]
        label = head + (
            ": " + ", ".join(f"{k}={_text(config.get(k))}" for k in keep) if keep else ""
        )
        labels.append(label if label not in labels else f"{label} #{len(labels) + 1}")
    return labels


def _seed_order(seed: Any) -> tuple[int, float, str]:
    return (0, seed, "") if isinstance(seed, int | float) else (1, 0.0, str(seed))


def configurations(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by run-config without ``NOT_CONFIGURATION`` keys; label → runs by seed."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        kept = {k: v for k, v in run.config.items() if k not in NOT_CONFIGURATION}
        groups.setdefault(json.dumps(kept, sort_keys=True, default=str), []).append(run)
    members = list(groups.values())
    labels = configuration_labels([group[0].config for group in members])
    ordered = sorted(zip(labels, members, strict=True), key=lambda pair: pair[0])
    return {
        label: sorted(group, key=lambda r: (_seed_order(r.config.get("seed")), str(r.path)))
        for label, group in ordered
    }


def final_value(rows: pd.DataFrame, column: str) -> float:
    """``column`` in the highest-round row that reports it; NaN when none does."""
    if column not in rows:
        return math.nan
    values = rows.dropna(subset=[column]).sort_values("round", kind="stable")[column]
    return float(values.iloc[-1]) if len(values) else math.nan


def final_epsilon(run: Run) -> float:
    """The ledger summary's ε; ∞ without a client-level ε (privacy none and no ledger, or
    a null summary ε); NaN for a private run without ``ledger.json``."""
    if run.ledger is None:
        return math.inf if run.config.get("privacy") == "none" else math.nan
    epsilon = run.ledger.get("summary", {}).get("epsilon")
    return math.inf if epsilon is None else float(epsilon)


def run_values(run: Run, metric: str) -> dict[str, Any]:
    """One run's final numbers: utility, ε, δ, per-group accuracy, fairness gap, μ-GDP."""
    rows = run.metrics[run.metrics["scope"] == SCOPE]
    groups = {c: final_value(rows, c) for c in rows.columns if c.startswith(GROUP_PREFIX)}
    groups = {c: v for c, v in groups.items() if not math.isnan(v)}
    gap = final_value(rows, GAP)
    if math.isnan(gap) and len(groups) > 1:
        gap = max(groups.values()) - min(groups.values())
    summary = (run.ledger or {}).get("summary", {})
    mu = (run.certificates or {}).get("gdp-mu")
    status = run.status or run_status.RunStatus(str(run.config.get("privacy", "none")))
    return {
        "status": status.status,
        "failed": status.failed,
        "holds_against": status.columns()["holds-against"],
        "seed": run.config.get("seed"),
        "run": str(run.path),
        "utility": final_value(rows, metric),
        "epsilon": final_epsilon(run),
        "delta": summary.get("target-delta", math.nan),
        # ε under different neighbouring relations (or from seed-derived noise) is not
        # one quantity: the figure says so when a plot mixes them.
        "relation": summary.get("neighboring-relation") or "",
        "noise_from_seed": bool(summary.get("noise-from-seed", False)),
        "fairness_gap": gap,
        "gdp_mu": math.nan if mu is None else float(mu),
        **groups,
    }


def _mean_std(name: str, values: pd.Series) -> dict[str, float]:
    return {f"{name}_mean": values.mean(), f"{name}_std": values.std()}


def summarise(configs: Mapping[str, Sequence[Run]], metric: str) -> pd.DataFrame:
    """``figures.csv``: one row per configuration, mean ± std (ddof 1) over its runs that
    did not fail (failed or diverged runs are counted in ``n_failed`` and left out: their
    numbers are no result); ε is the mean (∞ without DP) and its std over runs with a
    finite ε only. A configuration whose every run failed keeps NaN utility."""
    import numpy as np
    import pandas as pd

    rows = []
    for label, runs in configs.items():
        every = pd.DataFrame([run_values(run, metric) for run in runs])
        kept = every[~every["failed"].astype(bool)]
        values = kept if len(kept) else every
        eps = values["epsilon"].astype(float)
        row = {"configuration": label} | {k: runs[0].config.get(k) for k in TAGS}
        row |= {"n_seeds": values["seed"].nunique(), "n_runs": len(values), "metric": metric}
        row |= {"seeds": " ".join(sorted({str(seed) for seed in values["seed"]}))}
        row |= _mean_std("utility", kept["utility"])
        row |= {
            "n_failed": int(every["failed"].sum()),
            "status": run_status.count_outcomes(every["status"]),
            "holds_against": "/".join(sorted({h for h in every["holds_against"] if h})),
        }
        row |= {
            "epsilon": eps.mean(),
            "epsilon_std": eps.std() if np.isfinite(eps).all() else math.nan,
        }
        row |= {"delta": values["delta"].max(), "gdp_mu": values["gdp_mu"].mean()}
        row |= {
            "relation": "/".join(sorted({r for r in values["relation"] if r})),
            "noise_from_seed": bool(values["noise_from_seed"].any()),
        }
        row |= _mean_std("fairness_gap", values["fairness_gap"])
        for group in [c for c in values.columns if c.startswith(GROUP_PREFIX)]:
            row |= _mean_std(group, values[group])
        rows.append(row | {"runs": ";".join(every["run"])})
    return pd.DataFrame(rows)


def evaluation_rounds(first: int, last: int, max_points: int = MAX_LEDGER_POINTS) -> np.ndarray:
    """At most ``max_points`` rounds evenly spaced from ``first`` to ``last`` (both in)."""
    import numpy as np

    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
        raise ValueError(f"max_points must be an integer >= 2, got {max_points!r}")
    count = min(max_points, last - first + 1)
    return np.unique(np.rint(np.linspace(first, last, count)).astype(int))


def stack_ledger(state: Mapping[str, Any], *, max_points: int = MAX_LEDGER_POINTS) -> LedgerStack:
    """ε of a ledger state over rounds, stacked by release kind (most releases first).

    Each point charges the filtered releases into a fresh ledger of the same config
    (no ``max_epsilon``: only ε is read), so the top equals the ledger's ε.
    """
    import numpy as np

    from lab.figures_plots import LedgerStack

    ledger = PrivacyLedger.from_state_dict(dict(state))
    releases = ledger.releases
    if not releases:
        raise FiguresError("the ledger holds no accounted release")
    counts, first = Counter(), {}
    for index, release in enumerate(releases):
        counts[release.kind] += release.count
        first.setdefault(release.kind, index)
    kinds = tuple(sorted(counts, key=lambda kind: (-counts[kind], first[kind])))
    rounds = [r.server_round for r in releases]
    at = evaluation_rounds(min(rounds), max(rounds), max_points)
    config = asdict(ledger.config) | {"max_epsilon": None}
    cumulative = np.zeros((len(kinds), at.size))
    for j in range(len(kinds)):
        for i, server_round in enumerate(at):
            chosen = [
                r for r in releases if r.kind in kinds[: j + 1] and r.server_round <= server_round
            ]
            fresh = PrivacyLedger(**config)
            fresh.charge(chosen)
            cumulative[j, i] = fresh.epsilon()
    return LedgerStack(at, kinds, cumulative, ledger.epsilon(), ledger.target_delta)


def ledger_stacks(
    configs: Mapping[str, Sequence[Run]], echo: Callable[[str], None] = print
) -> dict[str, tuple[LedgerStack, Any]]:
    """``{label: (stack, seed)}`` of each configuration's first run with accounted releases;
    a stack whose top differs from the ledger's ε is reported through ``echo``."""
    stacks = {}
    for label, runs in configs.items():
        states = [r for r in runs if r.ledger and r.ledger.get("state", {}).get("releases")]
        if not states:
            continue
        run = states[0]
        try:
            stack = stack_ledger(run.ledger["state"])
        except ValueError as err:  # AccountingError: a state this code cannot replay
            echo(f"skipped the ledger of {run.path}: {err}")
            continue
        top = stack.cumulative[-1, -1]
        if not math.isclose(top, stack.epsilon, rel_tol=1e-9, abs_tol=1e-12):
            echo(f"warning: {run.path}: stacked ε {top:.6g} != the ledger's {stack.epsilon:.6g}")
        stacks[label] = (stack, run.config.get("seed"))
    return stacks


def build_figures(
    paths: Sequence[str | Path],
    out: Path,
    *,
    metric: str | None = None,
    echo: Callable[[str], None] = print,
    fmt: str = "png",
) -> pd.DataFrame:
    """Write every figure (as ``fmt``: png, svg or pdf) and ``figures.csv`` of the runs
    under ``paths`` into ``out``; return the ``figures.csv`` table.

    Raises
    ------
    FiguresError
        A PATH without run directories, an unreadable run, or an unreported ``metric``.
    """
    from lab import figures_plots as fplots

    runs = [load_run(path) for path in find_run_dirs(paths)]
    metric = choose_metric(runs, metric)
    configs = configurations(runs)
    summary = summarise(configs, metric)
    out.mkdir(parents=True, exist_ok=True)
    figure = fplots.plot_utility_vs_epsilon(summary, metric)
    fplots.save_or_skip(figure, out / "utility_vs_epsilon.png", "", echo, fmt)
    why = f"no run reports {GROUP_PREFIX}<group> columns in its {SCOPE} rows"
    fplots.save_or_skip(fplots.plot_fairness(summary), out / "fairness.png", why, echo, fmt)
    stacks = ledger_stacks(configs, echo)
    figure = fplots.plot_ledgers(stacks) if stacks else None
    fplots.save_or_skip(
        figure, out / "ledger.png", "no run has a ledger.json with accounted releases", echo, fmt
    )
    series = {k: fplots.spi_series([r.certificates for r in v]) for k, v in configs.items()}
    figure = fplots.plot_spi({k: v for k, v in series.items() if v is not None})
    fplots.save_or_skip(
        figure, out / "spi.png", "no run has a certificates.json with a positive SPI", echo, fmt
    )
    summary.to_csv(out / "figures.csv", index=False)
    echo(f"wrote {out / 'figures.csv'} ({len(summary)} configurations, {len(runs)} runs)")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command; returns the exit status (2 on bad input, message on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m lab.figures", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", help="run directories, or directories holding them"
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="where the figures go"
    )
    parser.add_argument(
        "--metric",
        default=None,
        help=f"{SCOPE} utility metric (default: first of {', '.join(DEFAULT_METRICS)})",
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default="png",
        help="image format of the figures (svg, pdf: vector; default png)",
    )
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # files only, display or not
    try:
        build_figures(args.paths, args.out, metric=args.metric, fmt=args.fmt)
    except FiguresError as err:
        print(f"figures: error: {err}", file=sys.stderr)
        return 2
    failed = failed_runs(find_run_dirs(args.paths))
    for line in failed:
        print(f"figures: run failed (outcome.json): {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
