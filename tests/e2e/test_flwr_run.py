"""`flwr run . local-simulation` end to end on digits: fedavg, fedprox, local.

One tiny run per strategy (4 SuperNodes, 3 rounds): FedAvg is the session's plain
digits run through `flwr run` (tests/e2e/conftest.py), FedProx and local training the
same runs made in process; the tests read the run directories the ServerApp wrote, and
the analysis notebook is executed on them. One more `flwr run` tests what the runtime
does with a key the SuperLink refuses; a run that fails its first start-up check
through the runtime (Flower's status, the exit code) is made on the Ray cluster's
SuperLink (tests/e2e/test_ray_cluster.py); a config the app refuses and a federation
the task cannot fill are the same kind of run made in process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from lab.launcher import APP_DIR as REPO
from tests.inprocess import run_like_flwr

pytestmark = pytest.mark.e2e

TINY = "num-server-rounds=3 fraction-train=1.0 vision.local-epochs=2"


@dataclass
class Run:
    stdout: str
    path: Path
    printed: Path  # the run directory the output names (FedAvg's was moved after)
    metrics: pd.DataFrame
    config: dict


def _run(result, path: Path, printed: Path | None = None) -> Run:
    return Run(
        stdout=result.output,
        path=path,
        printed=printed or path,
        metrics=pd.read_csv(path / "metrics.csv"),
        config=json.loads((path / "config.json").read_text())["run-config"],
    )


@pytest.fixture(scope="module")
def runs(digits_run, tmp_path_factory) -> dict[str, Run]:
    """One tiny run per strategy, each in its own output directory: FedAvg is the
    session's `flwr run` (tests/e2e/conftest.py, seed 7), the others in process."""
    root = tmp_path_factory.mktemp("runs")
    fedavg = digits_run.run
    assert fedavg.returncode == 0 and fedavg.run_dir is not None, fedavg.output
    (path,) = list(fedavg.run_dir.parent.iterdir())
    assert fedavg.run_dir == path
    made = {"fedavg": _run(fedavg, path, digits_run.printed_run_dir)}
    for strategy, extra in (("fedprox", "fedprox.mu=0.5"), ("local", "")):
        out = root / strategy
        result = run_like_flwr(f"{TINY} strategy='{strategy}' output-dir='{out}' {extra}")
        assert result.returncode == 0, result.output
        (path,) = list(out.iterdir())
        assert result.run_dir == path
        made[strategy] = _run(result, path)
    # `flwr run` must not rewrite tracked files (e.g. migrate pyproject.toml).
    assert digits_run.git[0] == digits_run.git[1]
    return made


def test_fedavg_writes_run_directory_and_learns(runs):
    run = runs["fedavg"]
    # The path is printed at the start and at the end of the run.
    assert run.stdout.count(str(run.printed)) >= 2, run.stdout
    assert "[round 3/3]" in run.stdout and "ETA" in run.stdout
    assert set(run.metrics["scope"]) == {"train", "federated-eval", "central-eval"}
    central = run.metrics[run.metrics["scope"] == "central-eval"].set_index("round")
    assert list(central.index) == [0, 1, 2, 3]
    assert central.loc[3, "eval-accuracy"] > central.loc[0, "eval-accuracy"] + 0.3
    assert run.config["strategy"] == "fedavg" and run.config["num-server-rounds"] == 3
    assert (run.path / "model.pt").stat().st_size > 0
    assert (run.path / "plots" / "learning_curve.png").stat().st_size > 10_000
    assert (run.path / "checkpoint" / "global.pt").is_file()


def test_fedprox_sends_mu_and_completes(runs):
    run = runs["fedprox"]
    assert run.config["fedprox.mu"] == 0.5
    train = run.metrics[run.metrics["scope"] == "train"]
    assert list(train["round"]) == [1, 2, 3]
    assert train["train-loss"].iloc[-1] < train["train-loss"].iloc[0]


def test_local_trains_each_client_alone(runs):
    metrics = runs["local"].metrics
    assert "central-eval" not in set(metrics["scope"])
    fed = metrics[metrics["scope"] == "federated-eval"]
    assert list(fed["round"]) == [1, 2, 3]
    # Each client keeps improving its own model across rounds (state persists).
    assert fed["eval-accuracy"].iloc[-1] > fed["eval-accuracy"].iloc[0]


def test_notebook_executes_on_the_runs(runs, tmp_path):
    runs_dir = tmp_path / "all"
    runs_dir.mkdir()
    for run in runs.values():
        (runs_dir / run.path.name).symlink_to(run.path)
    notebook = nbformat.read(REPO / "notebooks" / "analyze_runs.ipynb", as_version=4)
    os.environ["RUNS_DIR"] = str(runs_dir)
    try:
        NotebookClient(
            notebook,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(REPO / "notebooks")}},
        ).execute()
    finally:
        del os.environ["RUNS_DIR"]
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert "3 run directories" in "".join(o.get("text", "") for o in outputs)
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4  # comparison + 3 curves


def test_default_output_dir_is_the_app_directory(digits_run):
    # The session's digits run had no output-dir: it made one run directory in the app
    # directory's runs/ (moved out of the repository after the run).
    result = digits_run.run
    assert result.returncode == 0, result.output
    assert len(digits_run.created_in_app_dir) == 1
    assert result.run_dir is not None and result.run_dir.name == digits_run.created_in_app_dir[0]
    assert digits_run.printed_run_dir is not None
    assert digits_run.printed_run_dir.parent.name == "runs"
    assert (result.run_dir / "metrics.csv").is_file()


def test_an_unknown_key_is_refused_by_the_superlink_and_named(flower):
    # Flower refuses keys not in pyproject.toml before the app runs and prints only
    # "[code: 15] Invalid run configuration."; the launcher adds the SuperLink's reason.
    result = flower.run("num-server-round=3")
    assert result.returncode != 0 and result.run_dir is None
    assert "[code: 15] Invalid run configuration." in result.output
    assert "num-server-round" in result.output.split("The SuperLink's reason")[1]


def test_invalid_config_fails_before_training(tmp_path):
    # The app's own check, made in process; Flower's status and exit code of a failed
    # run through the runtime: tests/e2e/test_ray_cluster.py.
    result = run_like_flwr(f"strategy='fedsgd' output-dir='{tmp_path}'")
    assert "'strategy' = 'fedsgd' is not valid; valid values: 'fedavg'" in result.output
    assert result.run_dir is None and not any(tmp_path.iterdir())  # nothing was trained
    assert result.returncode == 1 and result.status.endswith("failed")


def test_a_federation_the_task_cannot_fill_fails_before_training(tmp_path):
    # lunar-lander defines 3 clients here, the federation has 4: the start-up check on
    # the partitions the nodes report stops the run before round 1. Made in process (the
    # runtime's failed status and exit code: tests/e2e/test_ray_cluster.py).
    result = run_like_flwr(f"task='lunar-lander' ppo.derived-per-base=0 output-dir='{tmp_path}'")
    assert result.returncode == 1 and result.status == "finished:failed", result.output
    (run_dir,) = list(tmp_path.iterdir())
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["last-round"] == 0
    assert "lunar-lander defines 3 clients" in outcome["reason"]
    assert "num-partitions=4" in outcome["reason"]
    assert "Run failed after round 0: start-up check" in result.output
    assert (
        not (run_dir / "metrics.csv").exists()
        or "train" not in (run_dir / "metrics.csv").read_text()
    )
