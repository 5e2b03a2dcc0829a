"""The SmartFedProx study's ``run_comparison.py`` on this app: run every preset once per seed, then
compare the experiments as mean ± std over the seeds.

::

    python -m lab.comparison experiments/finance-{fedavg,fedprox,smart-fedprox}.toml \\
        --seeds 0 1 2 --out results/finance-comparison
    python -m lab.comparison --runs fedavg:0=runs/A fedavg:1=runs/B ... --out x
    python -m lab.comparison --from results/finance-comparison/comparison.json --out x

Design notes: ``docs/notes.md``, ``lab.comparison``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab import figures, study
from lab.checks import audit_markdown, exit_on_failed
from lab.figures import FORMATS
from lab.study import Preset, StudyError
from server_app import run_status

if TYPE_CHECKING:
    import pandas as pd

# matplotlib, pandas, the plots and the tasks (PyTorch) are imported by the functions
# that use them, so that ``--help`` answers at once (tests/lab/test_lazy_imports.py).

Runs = dict[str, dict[int, Path]]  # experiment -> seed -> run directory

TABLE_SCOPE = "central-eval"


@dataclass(frozen=True)
class Statistic:
    """One column of the results table: a per-run number, then mean ± std over seeds."""

    column: str
    """Column stem in ``results.csv`` (``<column>-mean``, ``-std``, ``-seed-<s>``)."""
    reduce: str
    """``final`` (value of the last round that reports it), ``max`` or ``min`` (over the
    rounds after training started, round ≥ 1)."""
    metric: str
    """Metric column of the ``TABLE_SCOPE`` rows."""
    label: str
    """Column header in ``results.md``."""


TABLE: tuple[Statistic, ...] = (
    Statistic("final-eval-r2", "final", "eval-r2", "final R²"),
    Statistic("final-eval-mse", "final", "eval-mse", "final MSE"),
    Statistic("best-eval-r2", "max", "eval-r2", "best R²"),
    Statistic("final-eval-accuracy", "final", "eval-accuracy", "final accuracy"),
    Statistic("final-eval-loss", "final", "eval-loss", "final loss"),
    Statistic("best-eval-accuracy", "max", "eval-accuracy", "best accuracy"),
)  # regression (finance) and classification (vision) runs: the Markdown shows those reported


def check_seeds(seeds: Sequence[int]) -> list[int]:
    """The seeds, validated as the run-config key ``seed``; unique, at least one."""
    from tasks.base import SEED

    if not seeds:
        raise StudyError("no seeds: give at least one with --seeds, e.g. --seeds 0 1 2")
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"--seeds has duplicates: {list(seeds)}")
    return [int(SEED.parse(seed)) for seed in seeds]


def trial_preset(preset: Preset, seed: int) -> Preset:
    """``preset`` with ``seed`` overridden, named ``<name>:<seed>``."""
    return replace(
        preset,
        name=f"{preset.name}:{seed}",
        overrides={**preset.overrides, "seed": seed},
        run_config={**preset.run_config, "seed": seed},
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def run_trials(
    presets: Sequence[Preset],
    seeds: Sequence[int],
    *,
    runs_dir: Path,
    default_size: int = study.DEFAULT_SUPERNODES,
    timeout: float = study.DEFAULT_TIMEOUT,
    simulation: Callable[..., Any] | None = None,
    on_run: Callable[[str, int, Path], None] | None = None,
    echo: Callable[[str], None] = print,
) -> Runs:
    """Run every preset once per seed (seed-major) with :func:`study.run_presets`;
    ``on_run(name, seed, run_dir)`` after each run. Returns ``{name: {seed: run_dir}}``
    in preset and seed order.

    Raises
    ------
    StudyError
        On no or duplicate seeds (before anything runs) and when a run fails.
    ConfigError
        On a seed the run-config rejects (before anything runs).
    """
    seeds = check_seeds(seeds)
    trials = {f"{preset.name}:{seed}": (preset.name, seed) for seed in seeds for preset in presets}
    done: Runs = {}
    started = time.monotonic()

    def record(key: str, run_dir: Path) -> None:
        name, seed = trials[key]
        done.setdefault(name, {})[seed] = run_dir
        if on_run is not None:
            on_run(name, seed, run_dir)
        finished = sum(map(len, done.values()))
        left = len(trials) - finished
        if left:
            eta = (time.monotonic() - started) / finished * left
            echo(f"ETA {_duration(eta)} for {left} more run(s)")

    study.run_presets(
        [trial_preset(preset, seed) for seed in seeds for preset in presets],
        runs_dir=runs_dir,
        default_size=default_size,
        timeout=timeout,
        simulation=simulation,
        on_run=record,
        echo=echo,
    )
    return {p.name: {seed: done[p.name][seed] for seed in seeds} for p in presets}


def write_comparison_json(
    out: Path, runs: Mapping[str, Mapping[int, Path]], presets: Mapping[str, Path]
) -> Path:
    """``comparison.json``: ``{"seeds", "experiments": {name: {"preset", "runs": {seed:
    run_dir}}}}``; ``--from`` reads it back."""
    doc = {
        "seeds": sorted({seed for seeds in runs.values() for seed in seeds}),
        "experiments": {
            name: {
                "preset": str(presets[name]) if name in presets else None,
                "runs": {str(seed): str(run_dir) for seed, run_dir in seeds.items()},
            }
            for name, seeds in runs.items()
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "comparison.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def read_comparison_json(path: Path) -> tuple[Runs, dict[str, Path]]:
    """``(runs, presets)`` of a ``comparison.json``, its run directories checked."""
    try:
        experiments = json.loads(Path(path).read_text())["experiments"]
        pairs = [
            f"{name}:{seed}={run_dir}"
            for name, entry in experiments.items()
            for seed, run_dir in entry["runs"].items()
        ]
        presets = {n: Path(e["preset"]) for n, e in experiments.items() if e.get("preset")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise StudyError(f"{path} is not a comparison.json: {err!r}") from None
    return parse_runs(pairs), presets


def parse_runs(pairs: Sequence[str]) -> Runs:
    """``{name: {seed: run_dir}}`` from ``NAME:SEED=RUN_DIR`` pairs; the run's
    ``config.json`` must agree on the seed."""
    form = "NAME:SEED=RUN_DIR"
    runs: Runs = {}
    for key, run_dir in study.named_runs(pairs, form=form).items():
        name, sep, text = key.rpartition(":")
        if not sep or not name:
            raise StudyError(f"--runs takes {form}, got {f'{key}={run_dir}'!r}")
        try:
            seed = int(text)
        except ValueError:
            raise StudyError(f"--runs {key}: SEED must be an integer, got {text!r}") from None
        if seed in runs.get(name, {}):
            raise StudyError(f"--runs gives {name} seed {seed} twice")
        try:
            recorded = json.loads((run_dir / "config.json").read_text())["run-config"]
        except (OSError, ValueError, KeyError) as err:
            raise StudyError(f"--runs {key}: cannot read {run_dir}/config.json: {err!r}") from None
        if "seed" in recorded and recorded["seed"] != seed:
            raise StudyError(f"--runs {key}: {run_dir} was run with seed {recorded['seed']}")
        runs.setdefault(name, {})[seed] = run_dir
    return runs


def reduce_metric(rows: pd.DataFrame, stat: Statistic) -> float:
    """``stat`` of one run's ``TABLE_SCOPE`` rows; NaN when the run does not report it."""
    if stat.metric not in rows:
        return math.nan
    rows = rows.dropna(subset=[stat.metric, "round"]).sort_values("round", kind="stable")
    if rows.empty:
        return math.nan
    if stat.reduce == "final":
        return float(rows[stat.metric].iloc[-1])
    trained = rows[rows["round"] >= 1]
    values = (rows if trained.empty else trained)[stat.metric]
    return float(values.max() if stat.reduce == "max" else values.min())


def run_values(metrics: pd.DataFrame, runs: Mapping[str, Collection[int]]) -> pd.DataFrame:
    """One row per run: experiment, seed, rounds (the last round recorded), ``TABLE``."""
    import pandas as pd

    rows = []
    for name, seeds in runs.items():
        for seed in seeds:
            run = metrics[(metrics["experiment"] == name) & (metrics["seed"] == seed)]
            row = {"experiment": name, "seed": seed, "rounds": run["round"].max()}
            evals = run[run["scope"] == TABLE_SCOPE]
            row |= {stat.column: reduce_metric(evals, stat) for stat in TABLE}
            rows.append(row)
    return pd.DataFrame(rows)


def _rounds(values: pd.Series) -> int | str | None:
    rounds = sorted({int(v) for v in values.dropna()})
    if not rounds:
        return None
    return rounds[0] if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"


def privacy_columns(runs: Mapping[str, Mapping[int, Path]]) -> dict[str, dict[str, Any]]:
    """Per experiment (:func:`server_app.run_status.summarise` of its runs): ``epsilon``
    (mean over seeds, ∞ without DP), ``delta``, ``holds-against``, ``status`` (outcomes
    counted) and ``failed-runs``."""
    return {
        name: run_status.summarise([run_status.read(path) for path in seeds.values()])
        for name, seeds in runs.items()
    }


def legend_labels(privacy: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Legend entries: the experiment, its ε (or "no DP") and its failed runs."""
    labels = {}
    for name, columns in privacy.items():
        text = f"{name} (ε = {run_status.epsilon_text(columns['epsilon'], columns['delta'])}"
        if columns["failed-runs"]:
            text += f"; {columns['failed-runs']} run(s) FAILED"
        labels[name] = text + ")"
    return labels


def results_table(
    values: pd.DataFrame, privacy: Mapping[str, Mapping[str, Any]] | None = None
) -> pd.DataFrame:
    """Per experiment: seeds, rounds, ``<stat>-mean`` / ``-std`` (ddof 1, over the seeds
    that report it), the per-seed values ``<stat>-seed-<s>`` and, given ``privacy``
    (:func:`privacy_columns`), its ε, δ, threat model and run outcomes."""
    import pandas as pd

    rows = []
    for name, group in values.groupby("experiment", sort=False):
        row: dict[str, Any] = {
            "experiment": name,
            "seeds": len(group),
            "rounds": _rounds(group["rounds"]),
        }
        if privacy is not None:
            row |= dict(privacy[name])
        for stat in TABLE:
            row[f"{stat.column}-mean"] = group[stat.column].mean()
            row[f"{stat.column}-std"] = group[stat.column].std()
        for stat in TABLE:
            for seed, value in zip(group["seed"], group[stat.column], strict=True):
                row[f"{stat.column}-seed-{seed}"] = value
        rows.append(row)
    return pd.DataFrame(rows)


def mean_std(mean: float, std: float) -> str:
    """``0.912 ± 0.004`` (three decimals; three significant digits for a mean outside
    [0.001, 10⁴)); ``0.912`` without a std (one seed); ``–`` without a mean."""
    if mean is None or not math.isfinite(mean):
        return "–"
    spec = ".3f" if mean == 0 or 1e-3 <= abs(mean) < 1e4 else ".3g"
    if std is None or not math.isfinite(std):
        return format(mean, spec)
    return f"{mean:{spec}} ± {std:{spec}}"


def to_markdown(table: pd.DataFrame) -> str:
    """The results table as a Markdown table (experiment, the ``TABLE`` columns some
    run reports, seeds, rounds)."""
    groups = [TABLE[:3], TABLE[3:]]  # regression, classification: shown when reported
    shown = [g for g in groups if table[f"{g[0].column}-mean"].notna().any()]
    stats = [s for g in shown for s in g] or list(TABLE[:3])
    header = ["experiment", *(stat.label for stat in stats), "seeds", "rounds"]
    private = "epsilon" in table  # the privacy columns (results_table given privacy)
    if private:
        header += ["ε (δ)", "ε holds against", "runs"]
    lines = [
        "| " + " | ".join(header) + " |",
        "| --- |" + " ---: |" * (len(header) - 1 - 2 * private) + " --- |" * (2 * private),
    ]
    for row in table.to_dict("records"):
        cells = [str(row["experiment"])]
        cells += [mean_std(row[f"{s.column}-mean"], row[f"{s.column}-std"]) for s in stats]
        rounds = row["rounds"]
        cells += [str(row["seeds"]), "–" if rounds is None or rounds != rounds else str(rounds)]
        if private:
            failed = " **(FAILED runs included)**" if row["failed-runs"] else ""
            against = row["holds-against"] or ("–" if math.isinf(row["epsilon"]) else "nobody")
            cells += [
                run_status.epsilon_text(row["epsilon"], row["delta"]),
                against,
                str(row["status"]) + failed,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def analyse(runs: Mapping[str, Mapping[int, Path]], out: Path, fmt: str = "png") -> pd.DataFrame:
    """Write the figures (as ``fmt``), ``results.csv`` and ``results.md`` of ``runs``
    into ``out``; return the results table."""
    from lab import comparison_plots as cplots

    metrics, selection = cplots.load_trials(runs)
    out.mkdir(parents=True, exist_ok=True)
    privacy = privacy_columns(runs)
    cplots.save_figures(metrics, selection, runs, out, legend_labels(privacy), fmt)
    privacy_figures(runs, out / "plots", fmt)
    table = results_table(run_values(metrics, runs), privacy)
    table.to_csv(out / "results.csv", index=False)
    (out / "results.md").write_text(
        "# Strategy comparison\n\n"
        f"Mean ± std (ddof 1) over seeds of the global model's `{TABLE_SCOPE}` metrics: "
        "`final` is the last round that reports the metric, `best` the highest over "
        "rounds ≥ 1. Per-seed values: `results.csv`; run directories: "
        "`comparison.json`. ε is the mean over seeds of each run's ε (δ the largest) "
        "against the party named (`ledger.json`); ∞: no privacy mechanism. `runs` counts "
        "the outcomes (`outcome.json`): the means include failed or diverged runs, which "
        "are marked.\n\n"
        f"{to_markdown(table)}\n" + _audit_section(runs)
    )
    return table


def _audit_section(runs: Mapping[str, Mapping[int, Path]]) -> str:
    """``results.md``'s privacy-audit table, when the runs were audited."""
    table = audit_markdown({name: seeds.values() for name, seeds in runs.items()})
    if table is None:
        return ""
    return (
        "\n## Privacy audit (`audit.json`)\n\nAn audit fails when its lower bound, valid "
        "at its confidence, exceeds the accountant's epsilon; the command then exits "
        f"non-zero.\n\n{table}\n"
    )


def privacy_figures(runs: Mapping[str, Mapping[int, Path]], out: Path, fmt: str = "png") -> None:
    """When the runs are private (a ``ledger.json``), the privacy-utility curve (final
    utility against the printed ε, mean ± std over seeds, ``utility_vs_epsilon.png``) and
    the other figures of :mod:`lab.figures` into ``out``."""
    dirs = [path for seeds in runs.values() for path in seeds.values()]
    if not any((Path(d) / "ledger.json").is_file() for d in dirs):
        return
    figures.build_figures(dirs, out, echo=lambda _line: None, fmt=fmt)


def one_task(presets: Sequence[Preset]) -> None:
    """Refuse presets of different tasks: their metrics and test sets differ."""
    found = {p.name: p.run_config["task"] for p in presets}
    if len(set(found.values())) > 1:
        raise StudyError(f"a comparison is of one task; the presets' tasks: {found}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lab.comparison",
        description=__doc__.split("\n\n")[0],
        epilog=(
            "Writes into --out: comparison_results.png, r2_comparison.png, "
            "mse_comparison.png, curves/<scope>/<metric>.png, results.csv, results.md, "
            "comparison.json (presets, seeds, run directories) and, for private runs, "
            "plots/utility_vs_epsilon.png (the privacy-utility curve) with the figures of "
            "python -m lab.figures."
        ),
    )
    parser.add_argument("presets", nargs="*", metavar="PRESET.toml", help="presets to run")
    parser.add_argument(
        "--seeds", nargs="+", type=int, metavar="SEED", help="run every preset once per seed"
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        metavar="NAME:SEED=RUN_DIR",
        help="analyse these existing run directories instead of running presets",
    )
    parser.add_argument(
        "--from",
        dest="from_json",
        type=Path,
        metavar="COMPARISON.json",
        help="analyse the runs of an earlier comparison.json",
    )
    study.add_run_arguments(parser)
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default="png",
        help="image format of the figures (svg, pdf: vector; default png)",
    )
    args = parser.parse_args(argv)
    if sum(map(bool, (args.presets, args.runs, args.from_json))) != 1:
        parser.error("give one of: PRESET.toml files, --runs NAME:SEED=RUN_DIR, --from FILE")
    if bool(args.presets) != (args.seeds is not None):
        parser.error("--seeds goes with PRESET.toml files (and they need it)")
    return args


def _run(args: argparse.Namespace) -> tuple[Runs, dict[str, Path]]:
    """Validate and run the presets × seeds; comparison.json after each run."""
    out: Path = args.out
    presets = study.load_presets(args.presets, task=None)
    one_task(presets)
    preset_paths = {p.name: p.path for p in presets}
    done: Runs = {}

    def record(name: str, seed: int, run_dir: Path) -> None:
        done.setdefault(name, {})[seed] = run_dir
        write_comparison_json(out, done, preset_paths)

    runs = run_trials(
        presets,
        args.seeds,
        runs_dir=args.runs_dir or out / "runs",
        default_size=args.num_supernodes,
        timeout=args.timeout,
        on_run=record,
    )
    return runs, preset_paths


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """Run (or read) the trials, write the comparison into ``--out``; return the table."""
    args = parse_args(argv)
    import matplotlib

    from config.options import ConfigError

    matplotlib.use("Agg")  # files only, display or not
    out: Path = args.out
    try:
        if args.runs:
            runs, preset_paths = parse_runs(args.runs), {}
        elif args.from_json:
            runs, preset_paths = read_comparison_json(args.from_json)
        else:
            runs, preset_paths = _run(args)
        write_comparison_json(out, runs, preset_paths)
        table = analyse(runs, out, args.fmt)
    except (ConfigError, StudyError) as err:
        raise SystemExit(f"comparison: {err}") from None
    print(to_markdown(table))
    print(f"Comparison written to {out.resolve()}")
    exit_on_failed("comparison", [d for seeds in runs.values() for d in seeds.values()])
    return table


if __name__ == "__main__":
    main()
