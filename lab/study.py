"""The federated PPO study from the command line: run each preset as one `flwr run`, then draw
the learning curves, comparisons, t-SNE / UMAP plots and the final-reward table.

::

    python -m lab.study \\
        experiments/lunar-{standard-fl,clustered-fl,single-agent,dp-fl-eps*}.toml \\
        --out results/lunar-study
    python -m lab.study --runs standard-fl=runs/A single-agent=runs/B --out results/x

Design notes: ``docs/notes.md``, ``lab.study``.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.checks import exit_on_failed
from lab.launcher import APP_DIR, LocalSimulation
from server_app import run_status

if TYPE_CHECKING:
    import pandas as pd

    from config.options import Scalar

# PyTorch, matplotlib, Flower and the tasks are imported by the functions that use them,
# so that ``--help`` answers at once (tests/lab/test_lazy_imports.py).

STUDY_TASK = "lunar-lander"
DEFAULT_SUPERNODES = 10
DEFAULT_TIMEOUT = 24 * 3600.0
OUTPUT_TAIL = 4000  # characters of a failed run's output shown in the error


class StudyError(RuntimeError):
    """A preset could not run, or a run failed."""


@dataclass(frozen=True)
class Preset:
    """One experiment of the study: a preset file and what it needs to run.

    Attributes
    ----------
    name : str
        The experiment name (the file stem).
    path : Path
        The preset file.
    overrides : dict
        Its flat run-config keys (what ``flwr run --run-config`` receives).
    run_config : dict
        The overrides merged over the app's defaults (what the ServerApp sees).
    num_supernodes : int or None
        Clients the task's configuration defines; None: any number.
    """

    name: str
    path: Path
    overrides: dict[str, Scalar]
    run_config: dict[str, Scalar]
    num_supernodes: int | None


def app_defaults(pyproject: Path = APP_DIR / "pyproject.toml") -> dict[str, Scalar]:
    """The run-config defaults of ``[tool.flwr.app.config]`` (what Flower merges over)."""
    from flwr.common.config import flatten_dict

    doc = tomllib.loads(pyproject.read_text())
    return flatten_dict(doc["tool"]["flwr"]["app"]["config"])


def supernodes_needed(run_config: Mapping[str, Scalar]) -> int | None:
    """``tasks.build(run_config).num_partitions()``: clients the task defines, or None."""
    import tasks

    return tasks.build(run_config).num_partitions()


def study_base(path: Path) -> Path | None:
    """The ``base.toml`` a study preset is merged over: ``studies/<study>/base.toml`` for
    ``studies/<study>/presets/<name>.toml``; None for any other file."""
    base = path.parent.parent / "base.toml"
    return base if path.parent.name == "presets" and base.is_file() else None


def read_preset(
    path: Path, flatten: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Scalar]:
    """A preset's flat run-config keys. A study preset (``studies/<study>/presets/*.toml``)
    is its study's ``base.toml`` with the preset's own keys replacing the base's: TOML
    has no inheritance, so a study keeps its shared keys once and each preset the keys
    it varies. Any other file is read as it is."""
    base = study_base(path)
    shared = flatten(tomllib.loads(base.read_text())) if base else {}
    return {**shared, **flatten(tomllib.loads(path.read_text()))}


def load_preset(
    path: str | Path,
    defaults: Mapping[str, Scalar],
    needed: Callable[[Mapping[str, Scalar]], int | None] = supernodes_needed,
) -> Preset:
    """Read and validate one preset.

    Raises
    ------
    ConfigError
        On an unknown key or invalid value (the app's validation, as at start-up),
        or a key ``pyproject.toml`` has no default for (``flwr run`` rejects those).
    """
    from flwr.common.config import flatten_dict

    from config.options import ConfigError
    from server_app import config

    path = Path(path)
    try:
        overrides = read_preset(path, flatten_dict)
    except (OSError, tomllib.TOMLDecodeError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read the preset: {err}") from None
    run_config = {**defaults, **overrides}
    try:
        config.load(run_config)
        undeclared = sorted(set(overrides) - set(defaults))
        if undeclared:
            raise ConfigError(
                f"key(s) {', '.join(map(repr, undeclared))} have no default in "
                "pyproject.toml [tool.flwr.app.config], so `flwr run` would reject them"
            )
        size = needed(run_config)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return Preset(path.stem, path, overrides, run_config, size)


def group_by_size(presets: Sequence[Preset], default_size: int) -> dict[int, list[Preset]]:
    """``{num_supernodes: presets}``, sizes in order of first appearance; presets whose
    task takes any number of clients run on ``default_size``."""
    groups: dict[int, list[Preset]] = {}
    for preset in presets:
        groups.setdefault(preset.num_supernodes or default_size, []).append(preset)
    return groups


def _toml_value(value: Scalar) -> str:
    from config.options import ConfigError

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if '"' in value:
            raise ConfigError(f"run-config value {value!r} contains a double quote")
        return f'"{value}"'
    return repr(value)


def run_config_arg(overrides: Mapping[str, Scalar]) -> str:
    """``flwr run --run-config`` text for ``overrides``: ``key=value`` pairs, TOML values."""
    return " ".join(f"{key}={_toml_value(value)}" for key, value in overrides.items())


def run_presets(
    presets: Sequence[Preset],
    *,
    runs_dir: Path,
    default_size: int = DEFAULT_SUPERNODES,
    timeout: float = DEFAULT_TIMEOUT,
    simulation: Callable[..., Any] | None = None,
    on_run: Callable[[str, Path], None] | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Run every preset (``output-dir`` = ``runs_dir``), one ``simulation(num_supernodes
    =n)`` (default :class:`LocalSimulation`) per size; return ``{name: run_dir}`` in
    the order they ran. ``on_run(name, run_dir)`` is called after each run.

    Raises
    ------
    StudyError
        When a run exits non-zero, times out or prints no run directory; the
        message holds the tail of its output.
    """
    simulation = simulation or LocalSimulation
    total, done, started = len(presets), {}, time.monotonic()
    for size, group in group_by_size(presets, default_size).items():
        with simulation(num_supernodes=size) as sim:
            for preset in group:
                index = f"[{len(done) + 1}/{total}] {preset.name}"
                echo(f"{index}: flwr run on {size} SuperNodes ({preset.path})")
                overrides = {**preset.overrides, "output-dir": str(runs_dir.resolve())}
                try:
                    outcome = sim.run(run_config=run_config_arg(overrides), timeout=timeout)
                except Exception as err:  # e.g. subprocess.TimeoutExpired
                    raise StudyError(f"{index} failed: {err}") from err
                if outcome.returncode != 0 or outcome.run_dir is None:
                    raise StudyError(
                        f"{index} failed (exit code {outcome.returncode}, run directory "
                        f"{outcome.run_dir}); last output:\n{outcome.output[-OUTPUT_TAIL:]}"
                    )
                done[preset.name] = outcome.run_dir
                elapsed = time.monotonic() - started
                echo(
                    f"{index}: done in {outcome.seconds:.0f} s "
                    f"(study {elapsed:.0f} s): {outcome.run_dir}"
                )
                if on_run is not None:
                    on_run(preset.name, outcome.run_dir)
    return done


def _embeddings(name: str, run_dir: Path, out: Path, echo: Callable[[str], None]) -> None:
    import numpy as np

    from server_app.plots import save_figure
    from tasks.lunar_lander import plots
    from tasks.lunar_lander.logs import clients_dir, load_snapshots

    try:
        snapshots, weights = load_snapshots(clients_dir(run_dir))
        for method, label in (("tsne", "t-SNE"), ("umap", "UMAP")):
            distinct = len(np.unique(weights, axis=0))  # PPO updates once per rollout
            title = f"{name}: {label} of {len(weights)} policy snapshots ({distinct} distinct)"
            figure = plots.weight_embedding(snapshots, weights, method=method, title=title)
            save_figure(figure, out / method / f"{name}.png")
    except ValueError as err:  # too few snapshots: the other plots still stand
        echo(f"{name}: no weight embedding: {err}")


def _comparison_text(table: pd.DataFrame, runs: Mapping[str, Path], baseline: str | None) -> str:
    """The FL-vs-Single-Agent section of ``results.md``."""
    from tasks.lunar_lander import plots

    configs = {name: plots.load_run_config(run_dir) for name, run_dir in runs.items()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comparison = plots.compare_to_single_agent(table, configs, baseline)
    except ValueError as err:
        return f"No comparison with a Single Agent run: {err}."
    base = baseline or plots.single_agent_baseline(configs)
    lines = [
        f"Baseline: `{base}`. Single Agent samples clients as FedAvg does, so the runs "
        "take the same env steps (each client in expectation) only when "
        "`num-server-rounds`, `ppo.local-steps` and `fraction-train` agree "
        "(`comparable`); `planet-env-steps` above shows the steps actually taken.",
        "",
        plots.to_markdown(comparison),
    ]
    lines += [f"\n**Warning:** {w.message}" for w in caught]
    return "\n".join(lines)


def analyse(
    runs: Mapping[str, Path],
    out: Path,
    baseline: str | None = None,
    echo: Callable[[str], None] = print,
) -> pd.DataFrame:
    """Write every plot and table of the study of ``runs`` into ``out``; return the
    results table."""
    from server_app.plots import save_figure
    from tasks.lunar_lander import plots
    from tasks.lunar_lander.logs import clients_dir, load_episodes

    out.mkdir(parents=True, exist_ok=True)
    episodes = {}
    for name, run_dir in runs.items():
        try:
            episodes[name] = load_episodes(clients_dir(run_dir))
        except (FileNotFoundError, ValueError) as err:
            raise StudyError(f"{name}: {err} (is {run_dir} a {STUDY_TASK} run?)") from None
        status = run_status.read(run_dir)
        title = f"{name}: rolling reward of each client\n{status.caption()}"
        save_figure(
            plots.learning_curves(episodes[name], title), out / "learning_curves" / f"{name}.png"
        )
        _embeddings(name, run_dir, out, echo)
    save_figure(plots.comparison_combined(episodes), out / "comparison_combined.png")
    save_figure(plots.comparison_side_by_side(episodes), out / "comparison_side_by_side.png")
    table = with_privacy(plots.results_table(runs), runs)
    table.to_csv(out / "results.csv", index=False)
    comparison_text = _comparison_text(table, runs, baseline)
    (out / "results.md").write_text(
        "# LunarLander study\n\n"
        "`train-reward`: mean over the planet's clients of each client's mean reward over "
        "its last 100 training episodes (`train-reward-std`: std over those clients). "
        "`eval-reward`: the global model's mean episode reward on the planet in the run's "
        "last central evaluation (the best of the K models for clustered FedAvg; – without "
        "a global model, as under Single Agent). `planet-env-steps`, `run-env-steps`: env "
        "steps the planet's clients, and all clients, took. `epsilon` (∞: no privacy "
        "mechanism; NaN: no ε holds), `delta` and `holds-against`: the run's ε and whom it "
        "holds against (`ledger.json`); `status`: how the run ended (`outcome.json`; a "
        "failed or diverged run's numbers are no result).\n\n"
        f"{plots.to_markdown(table)}\n\n## Federated vs Single Agent\n\n{comparison_text}\n"
    )
    return table


def with_privacy(table: pd.DataFrame, runs: Mapping[str, Path]) -> pd.DataFrame:
    """``table`` (a row per experiment and planet) with each experiment's ``epsilon``,
    ``delta``, ``holds-against`` and ``status`` (:mod:`server_app.run_status`)."""
    if "experiment" not in table:  # no rows
        return table
    columns = {name: run_status.read(run_dir).columns() for name, run_dir in runs.items()}
    table = table.copy()
    for key in ("epsilon", "delta", "holds-against", "status"):
        table[key] = [columns[name][key] for name in table["experiment"]]
    return table


def write_study_json(out: Path, runs: Mapping[str, Path], presets: Mapping[str, Path]) -> None:
    """``study.json``: ``{"experiments": {name: {"run_dir", "preset"}}}``."""
    doc = {
        "experiments": {
            name: {
                "run_dir": str(run_dir),
                "preset": str(presets[name]) if name in presets else None,
            }
            for name, run_dir in runs.items()
        }
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(doc, indent=2) + "\n")


def named_runs(pairs: Sequence[str], form: str = "NAME=RUN_DIR") -> dict[str, Path]:
    """``{name: run_dir}`` from ``NAME=RUN_DIR`` pairs (``form`` names them in errors)."""
    runs: dict[str, Path] = {}
    for pair in pairs:
        name, sep, run_dir = pair.partition("=")
        if not sep or not name or not run_dir:
            raise StudyError(f"--runs takes {form}, got {pair!r}")
        if name in runs:
            raise StudyError(f"experiment name {name!r} is given twice")
        if not (Path(run_dir) / "config.json").is_file():
            raise StudyError(f"{run_dir} is not a run directory (no config.json)")
        runs[name] = Path(run_dir)
    return runs


def load_presets(paths: Sequence[str], task: str | None = STUDY_TASK) -> list[Preset]:
    """Validate every preset before running any; each must have task ``task`` (the
    study's lunar-lander by default; None: any task)."""
    defaults = app_defaults()
    presets = [load_preset(path, defaults) for path in paths]
    names = [p.name for p in presets]
    if len(set(names)) != len(names):
        raise StudyError(f"experiment names (file stems) must be unique: {names}")
    for preset in presets:
        if task is not None and preset.run_config["task"] != task:
            raise StudyError(
                f"{preset.path}: the study analyses task {task!r} runs, "
                f"this preset has task {preset.run_config['task']!r}"
            )
    return presets


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every experiment command: --out, --num-supernodes, --runs-dir,
    --timeout."""
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument(
        "--num-supernodes",
        type=int,
        default=DEFAULT_SUPERNODES,
        help="SuperNodes for presets whose task takes any number of clients "
        f"(default {DEFAULT_SUPERNODES})",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        help="output-dir of the runs (default: OUT/runs; overrides the presets' output-dir)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds one run may take (default {DEFAULT_TIMEOUT:.0f})",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lab.study",
        description=__doc__.split("\n\n")[0],
        epilog=(
            "Writes into --out: learning_curves/<name>.png, comparison_combined.png, "
            "comparison_side_by_side.png, tsne/<name>.png, umap/<name>.png, results.csv, "
            "results.md and study.json (name -> run directory and preset)."
        ),
    )
    parser.add_argument("presets", nargs="*", metavar="PRESET.toml", help="presets to run")
    parser.add_argument(
        "--runs",
        nargs="+",
        metavar="NAME=RUN_DIR",
        help="analyse these existing run directories instead of running presets",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--baseline",
        metavar="NAME",
        help="the Single Agent experiment to compare with (default: the one run with "
        "strategy = 'local')",
    )
    args = parser.parse_args(argv)
    if bool(args.presets) == bool(args.runs):
        parser.error("give either PRESET.toml files or --runs NAME=RUN_DIR, not both or neither")
    return args


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """Run (or read) the experiments, write the study into ``--out``; return the table."""
    args = parse_args(argv)
    import matplotlib

    from config.options import ConfigError
    from tasks.lunar_lander import plots

    matplotlib.use("Agg")  # files only, display or not
    out: Path = args.out
    try:
        if args.runs:
            runs, preset_paths = named_runs(args.runs), {}
        else:
            presets = load_presets(args.presets)
            preset_paths = {p.name: p.path for p in presets}
            done: dict[str, Path] = {}

            def record(name: str, run_dir: Path) -> None:  # partial study.json after each run
                done[name] = run_dir
                write_study_json(out, done, preset_paths)

            runs = run_presets(
                presets,
                runs_dir=args.runs_dir or out / "runs",
                default_size=args.num_supernodes,
                timeout=args.timeout,
                on_run=record,
            )
        write_study_json(out, runs, preset_paths)
        table = analyse(runs, out, baseline=args.baseline)
    except (ConfigError, StudyError) as err:
        raise SystemExit(f"study: {err}") from None
    print(plots.to_markdown(table))
    print(f"Study written to {out.resolve()}")
    exit_on_failed("study", runs.values())
    return table


if __name__ == "__main__":
    main()
