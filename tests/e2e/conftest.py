"""End-to-end harness: `flwr run . local-simulation` exactly as the README says.

The session shares one private Flower home (4 virtual SuperNodes, a Ray of one CPU
per simulation); its local SuperLink is stopped by PID at the end, whatever happened.
The plain digits run is made once per session and read by several modules
(:func:`digits_run`), and so are the privacy runs on a two-node Ray cluster
(:func:`cluster_run`): each `flwr run` costs Flower's and Ray's start-up, so one run
serves every check that needs it. The modules that read one are in one xdist group
(``tests/conftest.py``), so they share one session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from lab import engine
from lab.launcher import APP_DIR, LocalSimulation, RunOutcome, superlink_processes

# FedAvg on digits, 3 rounds, half the clients trained and evaluated each round, no
# client momentum, seed 7, the default output-dir (the app directory's runs/, moved out
# after the run). It is compared with the in-process engine's run of the same config
# (test_engine_parity: the same metrics and model bit for bit, so the same seed gives
# the same results through `flwr run`), with an in-process run of another seed
# (test_reproducibility), and read as the FedAvg run by test_flwr_run (output, learning,
# plots, checkpoint, default output-dir). Deterministic torch: the runs are compared bit
# for bit, on CUDA too (docs/testing.md).
DIGITS = (
    "num-server-rounds=3 fraction-train=0.5 fraction-evaluate=0.5 vision.momentum=0.0 "
    "vision.deterministic=true round-timeout=120.0"
)


# What every run's Ray may skip: the workers Ray starts ahead for the first driver (the
# ClientApp actors need the simulation's runtime env, so they never use them), usage
# statistics, the raylets' memory monitor (a poll every 250 ms; these runs use a few
# hundred MB) and the metrics every Ray process records and exports (nothing reads them).
RAY_ENV = {
    "RAY_prestart_worker_first_driver": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_memory_monitor_refresh_ms": "0",
    "RAY_enable_metrics_collection": "0",
}


@pytest.fixture(scope="session")
def flower():
    """The session's local SuperLink, 4 virtual SuperNodes. Its simulations get a Ray of
    one CPU: one ClientApp actor (Flower's pool has one per CPU), so a run starts
    PyTorch and the app in one Ray worker, not one per core; every run's
    ``--federation-config`` merges into this."""
    with LocalSimulation(num_supernodes=4, env=RAY_ENV) as sim:
        sim.configure_simulation(init_args_num_cpus=1)
        yield sim
        kill_local_superlink(sim)


def kill_local_superlink(sim: LocalSimulation) -> None:
    """SIGKILL ``sim``'s local SuperLink and its children (its SuperExec), by PID, and
    wait until they are gone; ``sim`` then finds nothing to stop. Its graceful stop
    (SIGTERM, then SIGKILL after 10 s) took 6 s in the last CI run's teardown and
    15.6 s on a loaded 2-core machine; the state it would save is thrown away."""
    from tests.e2e.ray_cluster import wait_gone

    victims: list[psutil.Process] = []
    for proc in superlink_processes(sim.home):
        with contextlib.suppress(psutil.Error):
            victims += [proc, *proc.children(recursive=True)]
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_gone(victims, 10)  # a zombie counts as gone: its parent may reap it later


def git_status() -> str:
    """Tracked files' changes (`flwr run` must not rewrite any, e.g. pyproject.toml)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=APP_DIR,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def run_once(flower, run_config: str, attempts: int = 3) -> RunOutcome:
    """``flower.run(run_config)``, again (up to ``attempts`` in all) while `flwr run`
    gives up on starting its local SuperLink (it waits 15 s; on a loaded machine that
    start-up can take longer, and a later one is faster): the run itself, once."""
    for _ in range(attempts):
        result = flower.run(run_config)
        if not (result.returncode and "Failed to start local SuperLink" in result.output):
            break
    return result


@dataclass
class DigitsRun:
    run: RunOutcome  # seed 7, default output-dir; its run directory moved out after
    printed_run_dir: Path | None  # where the run wrote it (what its output names)
    created_in_app_dir: list[str]  # what the run created under <app>/runs
    git: tuple[str, str]  # git status before and after the run
    config: str  # its run-config (without seed and output-dir)
    seed: int


@pytest.fixture(scope="session")
def digits_run(flower, tmp_path_factory) -> DigitsRun:
    """The session's one plain digits run through `flwr run` (:data:`DIGITS`, seed 7)."""
    root = tmp_path_factory.mktemp("digits-run")
    before = git_status()
    runs_root = APP_DIR / "runs"
    existing = set(runs_root.iterdir()) if runs_root.exists() else set()
    run = run_once(flower, f"{DIGITS} seed=7")  # no output-dir: the app directory's
    printed = run.run_dir
    if run.run_dir is not None and run.run_dir.parent != runs_root:
        # The app pip-installed from another checkout (a shared environment): a relative
        # output-dir resolves against that one; its runs/ is where the run must be.
        runs_root = run.run_dir.parent
        existing = set(runs_root.iterdir()) - {run.run_dir}
        assert runs_root.name == "runs" and (runs_root.parent / "pyproject.toml").is_file()
    created = sorted(set(runs_root.iterdir()) - existing) if runs_root.exists() else []
    moved = root / "runs"
    moved.mkdir()
    for path in created:  # out of the repository, whatever the tests find
        shutil.move(path, moved / path.name)
    if run.run_dir is not None and run.run_dir.parent == runs_root:
        run = dataclasses.replace(run, run_dir=moved / run.run_dir.name)
    return DigitsRun(
        run=run,
        printed_run_dir=printed,
        created_in_app_dir=[p.name for p in created],
        git=(before, git_status()),
        config=DIGITS,
        seed=7,
    )


@pytest.fixture(scope="session")
def digits_engine_run(digits_run, tmp_path_factory) -> Path:
    """The run directory of :func:`digits_run`'s config and seed made by the in-process
    engine (4 nodes): what the `flwr run` is compared with, bit for bit."""
    root = tmp_path_factory.mktemp("digits-engine")
    ours = engine.run(
        f"{digits_run.config} seed={digits_run.seed} output-dir='{root}'",
        engine.Federation(num_supernodes=4),
    )
    assert ours.returncode == 0 and ours.run_dir is not None, ours.error
    assert engine.engine_of(ours.run_dir) == "inprocess"
    return ours.run_dir


# SecAgg+ with DP-FedAvg (Skellam shares from the clients, 3 of 4 sampled per round, 3
# rounds) on digits, the small MLP. Made once, on a two-node Ray cluster
# (:func:`cluster_run`): the suite's SecAgg+ run (tests/e2e/test_privacy_runs.py) and its
# run on a Ray cluster (tests/e2e/test_ray_cluster.py) are one `flwr run`.
SECAGG = (
    "privacy='dp-fedavg-fixed' secagg.enabled=true dp.noise-site='client' "
    "dp.sampling='fixed' dp.num-sampled-clients=3 dp.noise-multiplier=1.0 "
    "dp.clip-norm=0.5 vision.model='mlp'"
)
SECAGG_ROUNDS = 3

# The audited DP-FedAvg run (tests/e2e/test_privacy_runs.py), on the same cluster's
# SuperLink after the SecAgg+ run: a Ray that is already up, where a run of its own
# would start one. Mechanics, not utility: with 3 of 4 clients, noise that gives a
# useful epsilon swamps the updates (README, "Privacy"). Here the DP that learns:
# Poisson sampling (the default), z calibrated to a target epsilon over the run, Adam on
# the released aggregate, the small MLP; 4 canary clients beside the 4 real ones.
AUDITED = (
    "privacy='dp-fedavg-fixed' dp.target-epsilon=8.0 dp.num-sampled-clients=3 "
    "server.optimizer='adam' server.lr=0.05 vision.model='mlp' audit.canaries=4"
)
# N = 4 real clients + k = 4 canaries; Flower merges it into the cluster SuperLink's
# simulation config; the engine's run reads the CPUs per ClientApp.
AUDITED_FEDERATION = "num-supernodes=8 client-resources-num-cpus=1"


# A run that cannot learn: 5 nodes needed, the federation has 4 (tests/e2e/test_ray_cluster.py).
CANNOT_LEARN = "min-available-nodes=5"


@dataclass
class ClusterRun:
    run: RunOutcome  # the SecAgg+ run, its ClientApps on the cluster
    audited: RunOutcome  # the audited DP-FedAvg run, after it on the same cluster
    failed: RunOutcome  # the run of CANNOT_LEARN, last
    failed_dir: Path  # its output-dir
    config: str  # the Flower home's config.toml as the runs saw it
    head: str  # the nodes' ids (hex)
    worker: str
    calls: dict[str, int]  # node id -> the SecAgg+ run's finished `ClientAppActor.run`s


@pytest.fixture(scope="session")
def cluster_run(tmp_path_factory) -> ClusterRun:
    """:data:`SECAGG`, :data:`AUDITED` and :data:`CANNOT_LEARN` through `flwr run` with
    the ClientApps on a two-node Ray cluster
    (``lab.launcher.LocalSimulation(ray_address=...)``: the connection from
    ``lab.connections --ray-address`` and ``RAY_ADDRESS`` for the local SuperLink), and
    Ray's own record of where the SecAgg+ run's ClientApps ran; the cluster is stopped
    before the tests read it."""
    from tests.e2e.ray_cluster import clientapp_calls, ray_nodes, two_node_cluster
    from tests.server_app.test_privacy_runs import TINY

    root = tmp_path_factory.mktemp("cluster-run")
    with two_node_cluster(RAY_ENV) as cluster:
        nodes = ray_nodes(cluster.address)
        head, worker = (nodes[str(node.temp_dir)] for node in cluster.nodes)
        with LocalSimulation(num_supernodes=4, ray_address=cluster.address) as sim:
            config = (sim.home / "config.toml").read_text()
            run = sim.run(f"{TINY} {SECAGG} output-dir='{root}'", timeout=300)
            # The SecAgg+ run's ClientApps, before the next run adds its own. Task
            # events reach the GCS about once a second: wait for both nodes' (≤ 10 s).
            deadline = time.monotonic() + 10
            while True:
                calls = clientapp_calls(cluster.address)
                if (calls[head] and calls[worker]) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            audited = sim.run(
                f"{TINY} {AUDITED} output-dir='{root}'",
                timeout=300,
                federation_config=AUDITED_FEDERATION,
            )
            # Last: a run that fails its start-up check. Flower starts the simulation's
            # Ray beside the ServerApp whatever it does, and here that is a join.
            failed_dir = root / "failed"
            failed_dir.mkdir()
            failed = sim.run(f"{CANNOT_LEARN} output-dir='{failed_dir}'", timeout=300)
            kill_local_superlink(sim)
    return ClusterRun(run, audited, failed, failed_dir, config, head, worker, dict(calls))
