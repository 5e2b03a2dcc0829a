"""``python -m lab.sweep``: the grid, runs as Ray tasks and in worker processes, resume, a
failed run reported, the summary's confidence intervals (hand-computed)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from lab import sweep

BASE = (
    "num-server-rounds=1 min-available-nodes=3 min-train-nodes=2 "
    "dp.noise-multiplier=1.0 dp.clip-norm=0.5 dp.num-sampled-clients=2 round-timeout=30.0"
)


def test_the_grid_is_every_combination():
    assert sweep.parse_grid(["a=1,2", "b='x','y'"]) == [
        {"a": "1", "b": "'x'"},
        {"a": "1", "b": "'y'"},
        {"a": "2", "b": "'x'"},
        {"a": "2", "b": "'y'"},
    ]
    assert sweep.point_name({"privacy": "'dp-fedavg-fixed'", "a": "1"}) == (
        "privacy=_dp-fedavg-fixed_,a=1"
    )
    with pytest.raises(ValueError, match="expected KEY=V1,V2"):
        sweep.parse_grid(["seed"])


def test_summary_has_the_t_interval_over_seeds_and_epsilon():
    runs = pd.DataFrame(
        {
            "p": ["a", "a", "b", "b", "b"],
            "status": ["completed", "completed", "completed", "completed", "failed"],
            "epsilon": [2.0, 2.0, math.inf, math.inf, math.inf],
            "eval-accuracy": [0.5, 0.7, 0.9, 0.9, math.nan],
        }
    )
    summary = sweep.summarise(runs, ["p"]).set_index("p")
    # Two seeds: mean 0.6, sd 0.1414, sem 0.1, t(0.975, 1) = 12.7062.
    assert summary.loc["a", "eval-accuracy"] == pytest.approx(0.6)
    assert summary.loc["a", "ci95"] == pytest.approx(1.270620, rel=1e-5)
    assert summary.loc["a", "epsilon"] == 2.0
    assert summary.loc["b", "ci95"] == 0.0 and summary.loc["b", "epsilon"] == math.inf
    assert (summary.loc["b", "runs"], summary.loc["b", "completed"]) == (3, 2)


@pytest.mark.slow
def test_a_sweep_runs_as_ray_tasks_then_resumes_in_processes_and_reports_a_failure(
    tmp_path, capsys, monkeypatch
):
    # One sweep directory for both backends: Ray tasks make the two runs, worker
    # processes then resume them and make the point that fails (each backend's first run
    # imports the whole app in a fresh process: the two runs are made once, not twice).
    import ray

    # The spawned workers import torch afresh: one thread each, as this process runs
    # (tests/conftest.py), not one per core on 2 cores already busy with the other tests.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    common = ["--out", str(tmp_path), "--base", BASE, "--federation-config", "num-supernodes=3"]

    # Ray tasks, on a fresh local instance: never a Ray cluster another test started here.
    # No dashboard: nothing here reads it, and its server costs CPU the whole test long.
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        runtime_env=sweep.ray_runtime_env(),
        log_to_driver=False,
    )
    try:
        on_ray = [*common, "--grid", "privacy='none','dp-fedavg-fixed'", "--backend", "ray"]
        assert sweep.main(on_ray) == 0
        out = capsys.readouterr().out
        assert "[sweep] 2 runs: 0 already completed, 2 to run" in out
        assert "done 2/2 | running 0 | failed 0" in out
        runs = pd.read_csv(tmp_path / "runs.csv").set_index("privacy")
        assert (runs["status"] == "completed").all()
        assert runs.loc["'none'", "epsilon"] == math.inf
        assert 0 < runs.loc["'dp-fedavg-fixed'", "epsilon"] < math.inf
        assert sweep.main(on_ray) == 0  # resumed: nothing is run again
        assert "2 already completed, 0 to run" in capsys.readouterr().out
    finally:
        ray.shutdown()
    assert not ray.is_initialized()

    # Worker processes: the grid grows by a point whose run fails; the Ray runs resume.
    for written in ("runs.csv", "summary.md", "privacy-utility.png"):
        (tmp_path / written).unlink()
    args = [
        *common, "--grid", "privacy='none','dp-fedavg-fixed','no-such-mechanism'",
        "--workers", "2",
    ]  # fmt: skip
    assert sweep.main(args) == 1  # one run failed; the others ran
    out = capsys.readouterr().out
    assert "[sweep] 3 runs: 2 already completed, 1 to run" in out
    assert "failed 1" in out and "ETA" in out
    runs = pd.read_csv(tmp_path / "runs.csv").set_index("privacy")
    assert runs.loc["'none'", "status"] == "completed"
    assert runs.loc["'none'", "epsilon"] == math.inf
    assert runs.loc["'dp-fedavg-fixed'", "status"] == "completed"
    assert 0 < runs.loc["'dp-fedavg-fixed'", "epsilon"] < math.inf
    assert runs.loc["'no-such-mechanism'", "status"] == "failed"
    assert "privacy" in runs.loc["'no-such-mechanism'", "error"]
    assert (tmp_path / "privacy-utility.png").stat().st_size > 0
    assert "epsilon" in (tmp_path / "summary.md").read_text()
    # Again, in this process: the completed runs are not run again.
    assert sweep.main([*args[:-2], "--workers", "0"]) == 1
    out = capsys.readouterr().out
    assert "[sweep] 3 runs: 2 already completed, 1 to run" in out
    again = pd.read_csv(tmp_path / "runs.csv")
    assert again["resumed"].fillna(False).astype(bool).sum() == 2


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend must be one of \['processes', 'ray'\]"):
        sweep.run_sweep([], 1, backend="dask")
