"""Sweeps: a grid of run-configs x seeds, each an in-process run, run concurrently.

    python -m lab.sweep --out runs/sweep-eps --base "privacy='dp-fedavg-adaptive' ..." \
        --grid "dp.target-epsilon=1,2,4,8,16" --seeds 0 1 2 \
        --federation-config "num-supernodes=100" --workers 2

Every grid point x seed is one run of :func:`lab.engine.run` in a worker process (a
``concurrent.futures.ProcessPoolExecutor`` over ``--workers`` local processes; 0: one
after another in this process; ``--backend ray [--address auto]``: a Ray task per run on
an existing cluster, or ``RAY_ADDRESS``'s), its output-dir ``<out>/<point>/seed-<s>``. A
point whose directory already holds a run with ``outcome.json`` status ``completed`` is not run
again (resume). A line per finished run shows done / running / failed and the ETA; a
failed run is reported in the table, not fatal. At the end: ``runs.csv`` (one row per
run, ε on every row: the ledger's, or ``inf`` without DP), ``summary.csv`` /
``summary.md`` (per point: the metric's mean and 95 % confidence interval over seeds,
Student's t) and ``privacy-utility.png`` (the metric against ε with those intervals).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

METRIC = "eval-accuracy"  # the last central evaluation's, by default
BACKENDS = ("processes", "ray")


@dataclass(frozen=True)
class Job:
    """One run of the sweep."""

    point: dict
    seed: int
    out: Path
    base: str
    federation: str

    @property
    def name(self) -> str:
        return point_name(self.point)

    @property
    def output_dir(self) -> Path:
        return self.out / self.name / f"seed-{self.seed}"

    def run_config(self) -> str:
        given = " ".join(f"{k}={v}" for k, v in self.point.items())
        return f"{self.base} {given} seed={self.seed} output-dir='{self.output_dir}'".strip()


def point_name(point: dict) -> str:
    """A directory name for a grid point (``key=value`` joined by ``,``)."""
    if not point:
        return "base"
    text = ",".join(f"{k}={v}" for k, v in point.items())
    return "".join(c if c.isalnum() or c in "=,.-_" else "_" for c in text)


def parse_grid(specs: list[str]) -> list[dict]:
    """``["a=1,2", "b='x','y'"]`` -> every combination, values kept as TOML text."""
    axes = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--grid {spec!r}: expected KEY=V1,V2,... (TOML values)")
        axes.append([(key.strip(), v.strip()) for v in values.split(",") if v.strip()])
    return [dict(combo) for combo in itertools.product(*axes)]


def completed_run(output_dir: Path) -> Path | None:
    """A run directory under ``output_dir`` whose outcome is ``completed``, if any."""
    if not output_dir.is_dir():
        return None
    for run_dir in sorted(output_dir.iterdir()):
        try:
            outcome = json.loads((run_dir / "outcome.json").read_text())
        except (OSError, ValueError):
            continue
        if outcome.get("status") == "completed":
            return run_dir
    return None


def result_row(job: Job, run_dir: Path | None, status: str, seconds: float, error: str = ""):
    """The table's row of one run: the point, seed, status, ε, the final metrics."""
    row = {**job.point, "seed": job.seed, "status": status, "seconds": round(seconds, 2)}
    row |= {"epsilon": math.inf, METRIC: math.nan, "eval-loss": math.nan}
    if run_dir is not None:
        row["run-dir"] = str(run_dir)
        ledger = run_dir / "ledger.json"
        if ledger.exists():
            epsilon = json.loads(ledger.read_text())["summary"]["epsilon"]
            row["epsilon"] = math.nan if epsilon is None else float(epsilon)
        metrics_file = run_dir / "metrics.csv"
        if metrics_file.exists():
            metrics = pd.read_csv(metrics_file)
            central = metrics[metrics["scope"] == "central-eval"].sort_values("round")
            for key in (METRIC, "eval-loss"):
                if key in central and len(central):
                    row[key] = float(central[key].iloc[-1])
    if error:
        row["error"] = error.strip().splitlines()[-1][:300]
    return row


def run_job(job: Job) -> dict:
    """One run in this process (a worker's task)."""
    from lab.engine import Federation, run

    started = time.monotonic()
    try:
        result = run(job.run_config(), Federation.parse(job.federation))
    except Exception as err:  # a run that cannot start: reported, not fatal
        return result_row(job, None, "failed", time.monotonic() - started, repr(err))
    status = "completed" if result.returncode == 0 else "failed"
    outcome = result.run_dir / "outcome.json" if result.run_dir else None
    if outcome is not None and outcome.exists():
        status = json.loads(outcome.read_text()).get("status", status)
    return result_row(job, result.run_dir, status, result.seconds, result.error)


def _eta(done: int, total: int, elapsed: float) -> str:
    if not done:
        return "?"
    left = elapsed / done * (total - done)
    return f"{int(left // 60)}:{int(left % 60):02d}"


def ray_runtime_env() -> dict:
    """The Ray job's environment: this checkout on the workers' ``PYTHONPATH`` (the
    cluster's nodes share this filesystem, as the Ray-simulation docs' cluster does)."""
    return {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}}


def _run_on_ray(todo: list[Job], address: str | None, workers: int, report) -> None:
    """Each job a Ray task (one CPU) on the cluster at ``address`` (None: ``RAY_ADDRESS``
    if set, else a local instance of ``workers`` CPUs); Ray is joined here unless the
    caller already has, and left after."""
    import ray

    joined_here = not ray.is_initialized()
    if joined_here:
        address = address or os.environ.get("RAY_ADDRESS")
        # "local": a fresh instance, never a cluster that `ray start` left on this machine
        options = (
            {"address": address} if address else {"address": "local", "num_cpus": max(workers, 1)}
        )
        ray.init(**options, runtime_env=ray_runtime_env(), log_to_driver=False)
    try:
        slots = max(int(ray.cluster_resources().get("CPU", 1)), 1)
        task = ray.remote(num_cpus=1, max_retries=0)(run_job)
        pending = {task.remote(job): job for job in todo}
        while pending:
            finished_now, _ = ray.wait(list(pending), num_returns=1)
            for ref in finished_now:
                job = pending.pop(ref)
                try:
                    row = ray.get(ref)
                except Exception as err:  # the task or its worker died: reported, not fatal
                    row = result_row(job, None, "failed", 0.0, repr(err))
                report(row, min(len(pending), slots))
    finally:
        if joined_here:
            ray.shutdown()


def run_sweep(
    jobs: list[Job],
    workers: int,
    log=print,
    *,
    backend: str = "processes",
    address: str | None = None,
) -> pd.DataFrame:
    """Run ``jobs`` (skipping completed ones) on ``workers`` local processes, or as Ray
    tasks (``backend="ray"``, on the cluster at ``address``); the runs' table."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    rows, todo = [], []
    for job in jobs:
        done = completed_run(job.output_dir)
        if done is not None:
            rows.append(result_row(job, done, "completed", 0.0) | {"resumed": True})
        else:
            todo.append(job)
    log(f"[sweep] {len(jobs)} runs: {len(rows)} already completed, {len(todo)} to run")
    started, failed, finished = time.monotonic(), 0, 0

    def report(row: dict, running: int) -> None:
        nonlocal failed, finished
        finished += 1
        failed += row["status"] != "completed"
        rows.append(row)
        elapsed = time.monotonic() - started
        log(
            f"[sweep] done {finished}/{len(todo)} | running {running} | failed {failed} | "
            f"ETA {_eta(finished, len(todo), elapsed)} | {row['status']}: "
            f"{point_name({k: row[k] for k in jobs[0].point})} seed {row['seed']}"
        )

    if backend == "ray":
        _run_on_ray(todo, address, workers, report)
    elif workers <= 0:
        for job in todo:
            report(run_job(job), 0)
    else:
        # Spawned, not forked: a fork of a process whose torch/BLAS threads hold a lock
        # can hang in the child (it did under pytest-xdist).
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
            pending: dict[Future, Job] = {pool.submit(run_job, job): job for job in todo}
            while pending:
                finished_now, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished_now:
                    job = pending.pop(future)
                    try:
                        row = future.result()
                    except Exception as err:  # the worker died: reported, not fatal
                        row = result_row(job, None, "failed", 0.0, repr(err))
                    report(row, min(len(pending), workers))
    return pd.DataFrame(rows)


def summarise(runs: pd.DataFrame, keys: list[str], metric: str = METRIC) -> pd.DataFrame:
    """Per grid point: completed runs, ε (mean, max), the metric's mean and 95 % CI."""
    from scipy import stats

    out = []
    groups = runs.groupby(keys, sort=False, dropna=False) if keys else [((), runs)]
    for key, group in groups:
        ok = group[group["status"] == "completed"]
        values = ok[metric].dropna().to_numpy(dtype=float)
        n = len(values)
        mean = float(values.mean()) if n else math.nan
        half = math.nan
        if n >= 2:
            sem = float(values.std(ddof=1)) / math.sqrt(n)
            half = float(stats.t.ppf(0.975, n - 1)) * sem
        key = key if isinstance(key, tuple) else (key,)
        out.append(
            {
                **dict(zip(keys, key, strict=True)),
                "runs": len(group),
                "completed": len(ok),
                "epsilon": float(ok["epsilon"].mean()) if len(ok) else math.nan,
                "epsilon-max": float(ok["epsilon"].max()) if len(ok) else math.nan,
                metric: mean,
                "ci95": half,
            }
        )
    return pd.DataFrame(out)


def plot(summary: pd.DataFrame, path: Path, metric: str = METRIC) -> None:
    """The metric against ε (log scale) with 95 % intervals; runs without DP as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    private = summary[summary["epsilon"] < math.inf]
    if len(private):
        ordered = private.sort_values("epsilon")
        ax.errorbar(ordered["epsilon"], ordered[metric], yerr=ordered["ci95"], marker="o",
                    capsize=3, label="DP")  # fmt: skip
        ax.set_xscale("log")
    for _, row in summary[summary["epsilon"] == math.inf].iterrows():
        ax.axhline(row[metric], linestyle="--", color="grey", label="no DP")
    ax.set_xlabel("epsilon (ledger)")
    ax.set_ylabel(f"{metric} (mean, 95 % CI over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(table: pd.DataFrame) -> list[str]:
    """``table`` as Markdown lines, floats to 4 significant digits."""

    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + " --- |" * len(table.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in table.itertuples(index=False)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.sweep", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the sweep's directory")
    parser.add_argument("--base", default="", help="run-config every run gets (key=value)")
    parser.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,...")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--federation-config", default="", help="e.g. 'num-supernodes=100'")
    parser.add_argument("--workers", type=int, default=2, help="processes; 0: this one")
    parser.add_argument("--backend", choices=BACKENDS, default="processes",
                        help="local processes, or Ray tasks on a cluster")  # fmt: skip
    parser.add_argument("--address", default=None,
                        help="Ray cluster (e.g. 'auto'; default: RAY_ADDRESS, else a "
                        "local instance of --workers CPUs)")  # fmt: skip
    parser.add_argument("--metric", default=METRIC, help="central-eval column to summarise")
    args = parser.parse_args(argv)
    try:
        points = parse_grid(args.grid)
    except ValueError as err:
        parser.error(str(err))
    jobs = [
        Job(point, seed, args.out, args.base, args.federation_config)
        for point in points
        for seed in args.seeds
    ]
    runs = run_sweep(
        jobs,
        args.workers,
        log=lambda line: print(line, flush=True),
        backend=args.backend,
        address=args.address,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    runs.to_csv(args.out / "runs.csv", index=False)
    keys = list(points[0]) if points else []
    summary = summarise(runs, keys, args.metric)
    summary.to_csv(args.out / "summary.csv", index=False)
    table = markdown(summary)
    (args.out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    plot(summary, args.out / "privacy-utility.png", args.metric)
    failed = runs[runs["status"] != "completed"]
    for _, row in failed.iterrows():
        print(f"[sweep] FAILED seed {row['seed']}: {row.get('error', row['status'])}")
    return 1 if len(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
