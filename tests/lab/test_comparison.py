"""The comparison CLI: presets × seeds launched (faked here), synthetic run directories
of known numbers reduced to mean ± std, every figure written. No `flwr run`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest.mock import ANY

import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import pandas as pd
import pytest
from flwr.common.config import parse_config_args

from config.options import ConfigError
from lab import comparison, study
from lab import comparison_plots as cplots
from lab.launcher import RunOutcome
from lab.study import Preset, StudyError
from server_app.results import RunDirectory

NAN = math.nan
# Central-eval eval-r2 / eval-mse of rounds 0, 1, 2 per (experiment, seed).
R2 = {
    ("fedavg", 0): [0.0, 0.93, 0.90],
    ("fedavg", 1): [0.0, 0.50, 0.91],
    ("fedavg", 2): [0.99, 0.60, 0.95],  # round 0 (before training) is never the best
    ("smart", 0): [0.0, 0.70, 0.80],
    ("smart", 1): [0.0, NAN, 0.84],  # a NaN row
    ("smart", 2): [0.0, 0.90, 0.88],
}
MSE = {
    ("fedavg", 0): [1.0, 0.20, 0.10],
    ("fedavg", 1): [1.0, 0.30, 0.12],
    ("fedavg", 2): [1.0, 0.40, 0.14],
    ("smart", 0): [1.0, 0.30, 0.20],
    ("smart", 1): [1.0, 0.30, 0.20],
    ("smart", 2): [1.0, 0.30, 0.20],
}
# participation.csv of the smart runs: node-id per selection (ids differ between runs).
SELECTED = {
    0: [11, 11, 11, 12, 13, 13],  # counts 3, 1, 2 -> ranked 3, 2, 1
    1: [21, 21, 22, 22],  # 2, 2 (+ one client never selected) -> 2, 2, 0
    2: [31, 32, 33],  # 1, 1, 1
}
FILES = (
    "comparison_results.png",
    "r2_comparison.png",
    "mse_comparison.png",
    "curves/central-eval/eval-r2.png",
    "curves/train/train-loss.png",
    "results.csv",
    "results.md",
    "comparison.json",
)


def make_run(root: Path, experiment: str, seed: int) -> Path:
    """A run directory as the ServerApp writes it; smart runs report divergence, μ and
    participation.csv, fedavg runs only the train loss."""
    smart = experiment == "smart"
    run = RunDirectory.create(root, "finance", experiment, "none")
    run.write_config({"task": "finance", "strategy": experiment, "privacy": "none", "seed": seed})
    for rnd, (r2, mse) in enumerate(zip(R2[experiment, seed], MSE[experiment, seed], strict=True)):
        if rnd > 0:
            train = {"train-loss": 1.0 / rnd, "num-examples": 100}
            if smart:
                train |= {"divergence": 0.1 * rnd + seed, "effective-mu": 0.01 * rnd}
            run.record(rnd, "train", train)
        run.record(rnd, "central-eval", {"eval-r2": r2, "eval-mse": mse, "eval-loss": mse})
    if smart:
        rows = [{"round": 1, "node-id": n, "mode": "random", "group": ""} for n in SELECTED[seed]]
        run.write_rows("participation.csv", [row | {"replied-ok": True} for row in rows])
    return run.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> comparison.Runs:
    root = tmp_path_factory.mktemp("runs")
    return {
        name: {seed: make_run(root, name, seed) for seed in range(3)}
        for name in ("fedavg", "smart")
    }


@pytest.fixture(scope="module")
def loaded(runs):
    return cplots.load_trials(runs)


def is_image(path: Path) -> bool:
    image = mpimg.imread(path)
    return path.stat().st_size > 0 and image.ndim == 3 and min(image.shape[:2]) > 100


# --- the table ---------------------------------------------------------------------------


def test_results_table_is_mean_and_std_over_seeds(loaded, runs):
    metrics, _ = loaded

    table = comparison.results_table(comparison.run_values(metrics, runs)).set_index("experiment")

    fedavg, smart = table.loc["fedavg"], table.loc["smart"]
    # fedavg final R² 0.90, 0.91, 0.95: mean 0.92, var (4+1+9)e-4 / 2 = 7e-4.
    assert fedavg["final-eval-r2-mean"] == pytest.approx(0.92)
    assert fedavg["final-eval-r2-std"] == pytest.approx(math.sqrt(7e-4))
    # best over rounds >= 1: 0.93, 0.91, 0.95 (not round 0's 0.99): mean 0.93, std 0.02.
    assert fedavg["best-eval-r2-mean"] == pytest.approx(0.93)
    assert fedavg["best-eval-r2-std"] == pytest.approx(0.02)
    assert fedavg["final-eval-mse-mean"] == pytest.approx(0.12)
    assert fedavg["final-eval-mse-std"] == pytest.approx(0.02)
    # smart final R² 0.80, 0.84, 0.88: mean 0.84, std 0.04; best 0.80, 0.84 (NaN round
    # left out), 0.90: mean 2.54 / 3, var (0.14² + 0.02² + 0.16²) / 9 / 2.
    assert smart["final-eval-r2-mean"] == pytest.approx(0.84)
    assert smart["final-eval-r2-std"] == pytest.approx(0.04)
    assert smart["best-eval-r2-mean"] == pytest.approx(2.54 / 3)
    assert smart["best-eval-r2-std"] == pytest.approx(math.sqrt(0.0456 / 18))
    assert smart["final-eval-mse-std"] == pytest.approx(0.0, abs=1e-12)
    assert list(table["seeds"]) == [3, 3] and list(table["rounds"]) == [2, 2]
    assert fedavg["final-eval-r2-seed-2"] == pytest.approx(0.95)
    assert smart["best-eval-r2-seed-1"] == pytest.approx(0.84)


def test_markdown_table_reads_mean_plus_minus_std(loaded, runs):
    table = comparison.results_table(comparison.run_values(loaded[0], runs))

    lines = comparison.to_markdown(table).splitlines()

    assert lines[0] == "| experiment | final R² | final MSE | best R² | seeds | rounds |"
    assert lines[2] == "| fedavg | 0.920 ± 0.026 | 0.120 ± 0.020 | 0.930 ± 0.020 | 3 | 2 |"
    assert lines[3] == "| smart | 0.840 ± 0.040 | 0.200 ± 0.000 | 0.847 ± 0.050 | 3 | 2 |"


def test_numbers_without_std_or_value_and_of_any_magnitude():
    assert comparison.mean_std(0.91234, NAN) == "0.912"  # one seed
    assert comparison.mean_std(NAN, NAN) == "–"  # not reported
    assert comparison.mean_std(123456.0, 789.0) == "1.23e+05 ± 789"
    assert comparison.mean_std(2e-5, 1e-6) == "2e-05 ± 1e-06"


def test_a_metric_no_run_reports_gives_empty_cells():
    frame = pd.DataFrame({"round": [0, 1], "scope": "central-eval", "eval-accuracy": [0.1, 0.9]})
    frame["experiment"], frame["seed"] = "digits", 0

    table = comparison.results_table(comparison.run_values(frame, {"digits": [0]}))
    lines = comparison.to_markdown(table).splitlines()

    # a classification run: its columns, not the regression ones; no loss reported
    assert lines[0] == (
        "| experiment | final accuracy | final loss | best accuracy | seeds | rounds |"
    )
    assert lines[2] == "| digits | 0.900 | – | 0.900 | 1 | 1 |"


# --- the figures ---------------------------------------------------------------------------


def test_curve_is_mean_and_std_per_round(loaded):
    metrics, _ = loaded

    curve = cplots.metric_curve(metrics, "central-eval", "eval-r2").set_index(
        ["experiment", "round"]
    )

    assert curve.loc[("fedavg", 2), "mean"] == pytest.approx(0.92)
    assert curve.loc[("fedavg", 2), "std"] == pytest.approx(math.sqrt(7e-4))
    assert curve.loc[("smart", 1), "mean"] == pytest.approx(0.8)  # 0.7, 0.9; NaN left out
    assert curve.loc[("smart", 1), "seeds"] == 2
    assert cplots.metric_curve(metrics, "train", "no-such-metric").empty


def test_selection_counts_are_ranked_within_runs_then_averaged(loaded):
    _, selection = loaded

    ranks = cplots.selection_ranks(selection)

    assert list(ranks["experiment"]) == ["smart"] * 3
    assert list(ranks["rank"]) == [1, 2, 3]
    # rank 1: 3, 2, 1; rank 2: 2, 2, 1; rank 3: 1, 0 (never selected), 1
    assert list(ranks["mean"]) == pytest.approx([2.0, 5 / 3, 2 / 3])
    assert ranks["std"].iloc[0] == pytest.approx(1.0)


def test_missing_metrics_and_selection_are_noted_not_fatal(loaded):
    metrics, selection = loaded
    metrics = metrics.drop(columns=["divergence", "effective-mu"])
    runs = {"fedavg": [0, 1, 2], "smart": [0, 1, 2]}
    fig, (div, sel) = plt.subplots(1, 2)

    cplots.draw_panel(div, cplots.PANELS[3], metrics, selection, runs)
    cplots.draw_panel(sel, cplots.PANELS[5], metrics, selection.iloc[:0], runs)

    assert [t.get_text() for t in div.texts] == ["divergence not reported (train)"]
    assert "no participation.csv" in sel.texts[0].get_text()
    plt.close(fig)


def test_some_runs_without_a_metric_are_named(loaded):
    metrics, selection = loaded
    runs = {"fedavg": [0, 1, 2], "smart": [0, 1, 2]}
    fig, (div, sel) = plt.subplots(1, 2)

    cplots.draw_panel(div, cplots.PANELS[3], metrics, selection, runs)
    cplots.draw_panel(sel, cplots.PANELS[5], metrics, selection[selection["seed"] != 1], runs)

    assert [t.get_text() for t in div.texts] == ["not reported: fedavg"]
    assert [t.get_text() for t in sel.texts] == ["no participation.csv: fedavg, smart:1"]
    plt.close(fig)


def test_analysing_existing_runs_writes_every_file(runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    pairs = [
        f"{name}:{seed}={path}" for name, seeds in runs.items() for seed, path in seeds.items()
    ]

    table = comparison.main(["--runs", *pairs, "--out", str(out)])

    for file in FILES:
        assert (out / file).stat().st_size > 0, file
    for png in out.rglob("*.png"):
        assert is_image(png), png
    assert not (out / "curves" / "train" / "num-examples.png").exists()
    assert list(table["experiment"]) == ["fedavg", "smart"]
    doc = json.loads((out / "comparison.json").read_text())
    assert doc["seeds"] == [0, 1, 2]
    assert doc["experiments"]["smart"] == {
        "preset": None,
        "runs": {str(seed): str(path) for seed, path in runs["smart"].items()},
    }
    csv = pd.read_csv(out / "results.csv")
    assert csv["final-eval-r2-seed-1"].tolist() == pytest.approx([0.91, 0.84])
    printed = capsys.readouterr().out
    assert "| fedavg | 0.920 ± 0.026 |" in printed and str(out.resolve()) in printed
    assert "| fedavg | 0.920 ± 0.026 |" in (out / "results.md").read_text()

    # The analysis can be redone from comparison.json alone (figures skipped: time).
    monkeypatch.setattr(cplots, "save_figures", lambda *args: [])
    again = comparison.main(["--from", str(out / "comparison.json"), "--out", str(tmp_path / "b")])
    pd.testing.assert_frame_equal(again, table)


# --- --runs and the command line -----------------------------------------------------------


def test_runs_are_parsed_by_name_and_seed(runs):
    smart = runs["smart"]

    parsed = comparison.parse_runs([f"smart:2={smart[2]}", f"smart:0={smart[0]}"])

    assert parsed == {"smart": {2: smart[2], 0: smart[0]}}


@pytest.mark.parametrize(
    ("pair", "error"),
    [
        ("smart={run}", r"--runs takes NAME:SEED=RUN_DIR, got 'smart=.*'"),
        ("{run}", "--runs takes NAME:SEED=RUN_DIR"),
        ("smart:x={run}", "SEED must be an integer, got 'x'"),
        ("smart:1={run}", r"was run with seed 0"),
        ("smart:0=/no/such/dir", "not a run directory"),
    ],
)
def test_bad_runs_are_rejected(runs, pair, error):
    with pytest.raises(StudyError, match=error):
        comparison.parse_runs([pair.format(run=runs["smart"][0])])


def test_a_run_given_twice_is_rejected(runs):
    run = runs["smart"][0]
    with pytest.raises(StudyError, match="smart seed 0 twice"):
        comparison.parse_runs([f"smart:0={run}", f"smart:00={run}"])


def test_cli_takes_one_source_and_seeds_only_with_presets(runs, tmp_path, capsys):
    run = runs["smart"][0]
    for argv in (
        [],
        ["a.toml"],  # presets need --seeds
        ["a.toml", "--seeds"],  # ... at least one
        ["--runs", f"smart:0={run}", "--seeds", "0"],
        ["a.toml", "--seeds", "0", "--runs", f"smart:0={run}"],
    ):
        with pytest.raises(SystemExit):
            comparison.main([*argv, "--out", str(tmp_path)])
    assert "--seeds" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cannot read the preset"):
        comparison.main(["missing.toml", "--seeds", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"not a comparison\.json"):
        comparison.main(["--from", str(run / "config.json"), "--out", str(tmp_path)])


def test_seeds_are_checked():
    assert comparison.check_seeds([2, 0]) == [2, 0]
    with pytest.raises(StudyError, match="no seeds"):
        comparison.check_seeds([])
    with pytest.raises(StudyError, match="duplicates"):
        comparison.check_seeds([1, 1])
    with pytest.raises(ConfigError, match=r"'seed' = -1 is out of range"):
        comparison.check_seeds([-1])


# --- orchestration -------------------------------------------------------------------------


class FakeSimulation:
    """Stands in for LocalSimulation: ``run`` makes a synthetic run of the strategy and
    seed it is given (or fails, for the strategies in ``fail``)."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.fail = fail
        self.opened: list[int] = []
        self.configs: list[dict] = []

    def __call__(self, num_supernodes: int) -> FakeSimulation:
        self.opened.append(num_supernodes)
        return self

    def __enter__(self) -> FakeSimulation:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, run_config: str, timeout: float) -> RunOutcome:
        cfg = parse_config_args([run_config])
        self.configs.append(cfg)
        if cfg["strategy"] in self.fail:
            return RunOutcome(1, "lots of output\nTraceback: boom", None, 1.0)
        experiment = "fedavg" if cfg["strategy"] == "fedavg" else "smart"
        run_dir = make_run(Path(cfg["output-dir"]), experiment, cfg["seed"])
        return RunOutcome(0, f"Run directory: {run_dir}", run_dir, 2.0)


def preset(name: str, **overrides) -> Preset:
    return Preset(name, Path(f"{name}.toml"), overrides, overrides, None)


def test_each_preset_runs_once_per_seed_with_its_seed(tmp_path):
    fake, lines, seen = FakeSimulation(), [], []
    presets = [preset("fedavg", strategy="fedavg", seed=7), preset("smart", strategy="smart")]

    runs = comparison.run_trials(
        presets,
        [0, 2],
        runs_dir=tmp_path / "runs",
        default_size=4,
        simulation=fake,
        on_run=lambda name, seed, run_dir: seen.append((name, seed)),
        echo=lines.append,
    )

    order = [("fedavg", 0), ("smart", 0), ("fedavg", 2), ("smart", 2)]  # seed-major
    assert [(c["strategy"], c["seed"]) for c in fake.configs] == order == seen
    assert {c["output-dir"] for c in fake.configs} == {str(tmp_path / "runs")}
    assert fake.opened == [4]  # one simulation for all trials of one size
    assert list(runs) == ["fedavg", "smart"] and list(runs["smart"]) == [0, 2]
    config = json.loads((runs["smart"][2] / "config.json").read_text())["run-config"]
    assert config["seed"] == 2
    assert lines[0].startswith("[1/4] fedavg:0: flwr run on 4 SuperNodes")
    assert sum(line.startswith("ETA ") for line in lines) == 3  # none after the last run


def test_a_failed_run_stops_the_comparison_with_its_output(tmp_path):
    fake = FakeSimulation(fail=("smart",))
    presets = [preset("fedavg", strategy="fedavg"), preset("smart", strategy="smart")]

    with pytest.raises(StudyError, match=r"(?s)\[2/4\] smart:0 failed \(exit code 1.*boom"):
        comparison.run_trials(
            presets, [0, 1], runs_dir=tmp_path, simulation=fake, echo=lambda _: None
        )


def test_main_validates_runs_and_analyses_presets(tmp_path, monkeypatch):
    fake = FakeSimulation()
    monkeypatch.setattr(study, "LocalSimulation", fake)
    drawn = []  # the figures are tested above; here only that they are asked for
    monkeypatch.setattr(cplots, "save_figures", lambda *args: drawn.append(args[2]))
    for name, strategy in (("fedavg", "fedavg"), ("smart", "fedprox")):  # real presets
        (tmp_path / f"{name}.toml").write_text(f'task = "digits"\nstrategy = "{strategy}"\n')
    out = tmp_path / "cmp"
    paths = [str(tmp_path / "fedavg.toml"), str(tmp_path / "smart.toml")]

    comparison.main([*paths, "--seeds", "0", "1", "2", "--out", str(out)])

    assert [(c["strategy"], c["seed"]) for c in fake.configs][:3] == [
        ("fedavg", 0),
        ("fedprox", 0),
        ("fedavg", 1),
    ]
    doc = json.loads((out / "comparison.json").read_text())
    assert doc["seeds"] == [0, 1, 2]
    assert doc["experiments"]["smart"]["preset"] == paths[1]
    assert Path(doc["experiments"]["smart"]["runs"]["2"]).parent == out / "runs"
    assert drawn == [{name: {0: ANY, 1: ANY, 2: ANY} for name in ("fedavg", "smart")}]
    for file in ("results.csv", "results.md"):
        assert (out / file).is_file(), file
    assert "| smart | 0.840 ± 0.040 |" in (out / "results.md").read_text()


def test_presets_of_different_tasks_are_refused(tmp_path):
    (tmp_path / "a.toml").write_text('task = "digits"\n')
    (tmp_path / "b.toml").write_text('task = "mnist"\n')
    argv = [str(tmp_path / "a.toml"), str(tmp_path / "b.toml"), "--seeds", "0"]

    with pytest.raises(SystemExit, match=r"one task.*'a': 'digits', 'b': 'mnist'"):
        comparison.main([*argv, "--out", str(tmp_path / "out")])


def test_classification_runs_get_accuracy_and_loss_panels():
    frame = pd.DataFrame({"round": [0, 1], "scope": "central-eval", "eval-accuracy": [0.1, 0.9]})

    panels, figures = cplots.panels_for(frame)

    assert [p.metric for p in panels[:2]] == ["eval-accuracy", "eval-loss"]
    assert list(figures) == ["accuracy_comparison.png", "loss_comparison.png"]
    assert cplots.panels_for(frame.assign(**{"eval-r2": 0.5}))[0] == cplots.PANELS
