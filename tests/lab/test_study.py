"""The study CLI: presets validated and grouped by size, runs launched (faked here),
every plot and table written. No `flwr run`: tests/e2e runs the real thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

import tasks
from config.options import ConfigError
from lab import study
from lab.launcher import RunOutcome
from lab.study import Preset, StudyError
from tests.tasks.test_lunar_lander_plots import FEDAVG_CLIENTS, SINGLE_CLIENTS, make_run

REPO = Path(__file__).resolve().parents[2]
OUTPUTS = (
    "learning_curves/{name}.png",
    "tsne/{name}.png",
    "umap/{name}.png",
)
STUDY_FILES = (
    "comparison_combined.png",
    "comparison_side_by_side.png",
    "results.csv",
    "results.md",
    "study.json",
)


def preset(name: str, size: int | None, **overrides) -> Preset:
    return Preset(name, Path(f"{name}.toml"), overrides, overrides, size)


def write_preset(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.xdist_group("umap")  # UMAP compiles once per worker: see test_lunar_lander_plots
def test_analysing_existing_runs_writes_every_file(tmp_path, capsys):
    fedavg = make_run(tmp_path, "fedavg", FEDAVG_CLIENTS)
    single = make_run(tmp_path, "local", SINGLE_CLIENTS)
    out = tmp_path / "study"

    table = study.main(["--runs", f"fl={fedavg}", f"single={single}", "--out", str(out)])

    for name in ("fl", "single"):
        for pattern in OUTPUTS:
            assert (out / pattern.format(name=name)).stat().st_size > 10_000
    for file in STUDY_FILES:
        assert (out / file).is_file()
    assert json.loads((out / "study.json").read_text()) == {
        "experiments": {
            "fl": {"run_dir": str(fedavg), "preset": None},
            "single": {"run_dir": str(single), "preset": None},
        }
    }
    assert len(table) == 6  # 2 experiments x 3 planets
    markdown = (out / "results.md").read_text()
    assert "| fl | moon | fedavg |" in markdown and "Baseline: `single`" in markdown
    printed = capsys.readouterr().out
    assert "| experiment | planet |" in printed and str(out.resolve()) in printed


def test_cli_takes_presets_or_runs_but_not_both(tmp_path, capsys):
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        study.main(["a.toml", "--runs", f"a={tmp_path}", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a run directory"):
        study.main(["--runs", f"a={tmp_path}", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"a: no client logs .*lunar-lander run\?"):
        study.main(["--runs", f"a={make_run(tmp_path, 'fedavg', {})}", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="NAME=RUN_DIR"):
        study.main(["--runs", str(tmp_path), "--out", str(tmp_path)])
    assert "PRESET.toml" in capsys.readouterr().err


def test_preset_is_merged_over_the_app_defaults_and_validated(tmp_path):
    path = write_preset(tmp_path / "mine.toml", 'strategy = "fedprox"\nfedprox.mu = 0.3\n')

    loaded = study.load_preset(path, study.app_defaults(), needed=lambda cfg: 7)

    assert loaded.name == "mine" and loaded.num_supernodes == 7
    assert loaded.overrides == {"strategy": "fedprox", "fedprox.mu": 0.3}
    assert loaded.run_config["fedprox.mu"] == 0.3 and loaded.run_config["task"] == "digits"


def test_real_digits_preset_runs_on_any_number_of_supernodes():
    loaded = study.load_preset(REPO / "experiments" / "digits-fedavg.toml", study.app_defaults())
    assert loaded.num_supernodes is None  # the task splits its data among any number


def test_unknown_or_invalid_preset_keys_are_rejected(tmp_path):
    defaults = study.app_defaults()
    typo = write_preset(tmp_path / "typo.toml", "fedprox.muu = 0.3\n")
    with pytest.raises(ConfigError, match=r"typo.toml: unknown .*'fedprox.muu'.*fedprox.mu"):
        study.load_preset(typo, defaults)
    bad = write_preset(tmp_path / "bad.toml", 'strategy = "fedsomething"\n')
    with pytest.raises(ConfigError, match="'strategy' = 'fedsomething' is not valid"):
        study.load_preset(bad, defaults)
    # A key the app declares but pyproject.toml has no default for: `flwr run` rejects it.
    mu = write_preset(tmp_path / "mu.toml", "fedprox.mu = 0.3\n")
    without_mu = {k: v for k, v in defaults.items() if k != "fedprox.mu"}
    with pytest.raises(ConfigError, match=r"'fedprox\.mu' have no default in pyproject"):
        study.load_preset(mu, without_mu)


def test_the_study_refuses_other_tasks():
    with pytest.raises(StudyError, match=r"task 'lunar-lander' runs.*'digits'"):
        study.load_presets([str(REPO / "experiments" / "digits-fedavg.toml")])


@pytest.mark.skipif("lunar-lander" not in tasks.REGISTRY, reason="lunar-lander not registered")
@pytest.mark.parametrize(
    ("study_name", "clients", "base_clients"),
    [("lunar-laptop", 9, 0), ("lunar-lands", 9, 13), ("lunar-full-size", 33, 0)],
)
def test_lunar_presets_need_one_supernode_per_client(study_name, clients, base_clients):
    # The base-clients presets federate the three planets' base clients alone, the
    # pairs presets (lunar-fl-lands among them) one derived client per planet beside them.
    paths = sorted(str(p) for p in (REPO / "studies" / study_name / "presets").glob("*.toml"))
    if study_name == "lunar-lands":
        paths += sorted(str(p) for p in (REPO / "experiments").glob("lunar-*.toml"))
    presets = study.load_presets(paths)
    base_only = [p for p in presets if p.name.startswith("lunar-fl-lands-base-clients")]
    pairs = [p for p in presets if p.name.startswith("lunar-fl-lands-pairs")]
    pairs += [p for p in presets if p.name == "lunar-fl-lands"]  # the pairs that landed
    others = [p for p in presets if p not in base_only + pairs]
    expected = {clients: others, 3: base_only, 6: pairs} if base_only else {clients: others}
    assert study.group_by_size(presets, 10) == expected
    assert len(base_only) == base_clients


def test_a_study_preset_is_its_base_with_its_own_keys_replacing_the_bases(tmp_path):
    (tmp_path / "presets").mkdir()
    base = 'task = "digits"\nnum-server-rounds = 3\n[fedprox]\nmu = 0.5\n'
    (tmp_path / "base.toml").write_text(base)
    overlay = tmp_path / "presets" / "fedprox.toml"
    overlay.write_text('strategy = "fedprox"\nnum-server-rounds = 5\n')
    preset = study.load_preset(overlay, study.app_defaults(), needed=lambda _: None)
    assert preset.name == "fedprox"
    assert preset.overrides == {
        "task": "digits",
        "num-server-rounds": 5,
        "fedprox.mu": 0.5,
        "strategy": "fedprox",
    }
    assert preset.run_config["num-server-rounds"] == 5
    # base.toml itself, or a file outside a presets/ folder, is read as it is
    plain = tmp_path / "fedprox.toml"
    plain.write_text(overlay.read_text())
    assert study.load_preset(plain, study.app_defaults(), needed=lambda _: None).overrides == {
        "strategy": "fedprox",
        "num-server-rounds": 5,
    }


def test_presets_are_grouped_by_the_supernodes_they_need():
    a, b, c, d = preset("a", 9), preset("b", None), preset("c", 33), preset("d", 9)

    groups = study.group_by_size([a, b, c, d], default_size=10)

    assert groups == {9: [a, d], 10: [b], 33: [c]}
    assert list(groups) == [9, 10, 33]  # in order of first appearance


def test_run_config_text_round_trips_through_flwr():
    overrides = {"task": "lunar-lander", "ppo.local-steps": 8192, "fraction-train": 0.485}
    overrides |= {"central-eval": False, "dp.target-delta": 1e-05, "output-dir": "/tmp/a b"}

    assert parse_config_args([study.run_config_arg(overrides)]) == overrides


class FakeLauncher:
    """Stands in for LocalSimulation: ``FakeLauncher()(num_supernodes=n)`` is a
    context whose ``run`` makes a synthetic run directory (or fails, for the
    strategies in ``fail``); records the sizes opened and the run-configs given."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.fail = fail
        self.opened: list[int] = []
        self.configs: list[str] = []

    def __call__(self, num_supernodes: int) -> FakeLauncher:
        self.opened.append(num_supernodes)
        return self

    def __enter__(self) -> FakeLauncher:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, run_config: str, timeout: float) -> RunOutcome:
        self.configs.append(run_config)
        cfg = parse_config_args([run_config])
        if cfg["strategy"] in self.fail:
            return RunOutcome(1, "lots of output\nTraceback: boom", None, 1.0)
        clients = SINGLE_CLIENTS if cfg["strategy"] == "local" else FEDAVG_CLIENTS
        run_dir = make_run(Path(cfg["output-dir"]), cfg["strategy"], clients)
        return RunOutcome(0, f"Run directory: {run_dir}", run_dir, 2.0)


def test_presets_run_on_one_simulation_per_size(tmp_path):
    fake = FakeLauncher()
    presets = [
        preset("fl", 9, strategy="fedavg"),
        preset("other", None, strategy="fedprox"),
        preset("single", 9, strategy="local"),
    ]
    lines, seen = [], []

    runs = study.run_presets(
        presets,
        runs_dir=tmp_path / "runs",
        default_size=4,
        simulation=fake,
        on_run=lambda name, run_dir: seen.append(name),
        echo=lines.append,
    )

    assert fake.opened == [9, 4]
    assert list(runs) == ["fl", "single", "other"] == seen
    assert all(path.parent == tmp_path / "runs" for path in runs.values())
    assert f'output-dir="{tmp_path / "runs"}"' in fake.configs[0]
    assert lines[0].startswith("[1/3] fl: flwr run on 9 SuperNodes")
    assert lines[-1].startswith("[3/3] other: done in 2 s") and str(runs["other"]) in lines[-1]


def test_a_failed_run_stops_the_study_with_its_output(tmp_path):
    fake = FakeLauncher(fail=("local",))
    presets = [preset("fl", 3, strategy="fedavg"), preset("single", 3, strategy="local")]

    with pytest.raises(StudyError, match=r"(?s)\[2/2\] single failed \(exit code 1.*boom"):
        study.run_presets(presets, runs_dir=tmp_path, simulation=fake, echo=lambda _: None)


def test_main_runs_presets_then_analyses_them(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "LocalSimulation", FakeLauncher())
    presets = [preset("fl", 9, strategy="fedavg"), preset("single", 9, strategy="local")]
    monkeypatch.setattr(study, "load_presets", lambda paths: presets)
    # The t-SNE and UMAP files are the analysis's (the test above writes them); here
    # only that each run made is handed to them: UMAP's numba compile is ~7 s of CPU
    # in every process that fits one.
    embedded = []
    monkeypatch.setattr(study, "_embeddings", lambda *args: embedded.append(args))
    out = tmp_path / "study"

    study.main(["fl.toml", "single.toml", "--out", str(out)])

    experiments = json.loads((out / "study.json").read_text())["experiments"]
    assert experiments["fl"]["preset"] == "fl.toml"
    assert Path(experiments["single"]["run_dir"]).parent == out / "runs"
    for file in STUDY_FILES:
        assert (out / file).is_file()
    assert [(name, Path(run), where) for name, run, where, _ in embedded] == [
        (name, Path(experiments[name]["run_dir"]), out) for name in ("fl", "single")
    ]
