"""Everything a run needs before round 1: the validated config, the task, the strategy,
the run directory and the initial model (with the steps some experiments add to it);
the start-up checks against the federation; and what the run ran on.

``environment.json`` beside ``config.json`` records the federation as far as the
ServerApp can know it (the connected nodes; the runtime: Flower's simulation runs the
ServerApp on an ``InMemoryGrid``; the simulation's client resources are not visible to
the ServerApp), the versions of the packages the results depend on, and the app's git
commit where the app was installed from a checkout (a FAB unpacked on a SuperLink has no
git: "unknown"). ``rerun.sh`` holds the ``flwr run`` command that makes the same
resolved run-config on a federation of the same size (also printed at the end).

Design notes: ``docs/notes.md``, ``server_app.setup`` (the start-up checks).
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import metadata
from logging import ERROR, INFO
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

import strategies
import tasks
from config.options import ConfigError
from protocol import presets
from server_app import config, subspace_setup
from server_app.audit import AuditSettings
from server_app.config import RunConfig
from server_app.results import RunDirectory, app_source_dir, resolve_output_dir
from server_app.subspace_setup import PublicData
from strategies import StopTraining
from strategies.algorithms.clustered import ClusteredFedAvg, model_seeds
from strategies.algorithms.hierarchical_fedavg import HierSettings
from strategies.mechanisms.base import NOISE_PARAMETER, DPSettings
from strategies.runtime.capabilities import Accounted, innermost, provides
from strategies.runtime.partitions import fedavg_sample_size, partition_map
from strategies.secure.secagg_plus import SecAggSettings
from tasks.base import Task

SUBSPACE = "subspace-dp"  # the mechanism whose set-up reads public data (subspace_setup)


@dataclass
class Setup:
    """A run ready to start (``saved``: the checkpoint it resumes, else None)."""

    cfg: config.RunConfig
    task: Task
    strategy: Any
    test_set: Any
    run_dir: RunDirectory
    saved: dict | None


def load(run_config: dict, explicit: Collection[str] | None = None) -> Setup:
    """Validate the run-config (its preset resolved; ``explicit``: the keys given on
    the command line, :func:`explicit_keys`), build task and strategy, open the run
    directory. The first line logged says whether the run is private.

    A ``ConfigError`` is logged (naming the key and the valid values) and raised before
    anything is written or trained."""
    try:
        cfg = config.load(run_config, explicit)
        log(INFO, "%s", privacy_line(cfg))
        # The task checks what depends on it (e.g. a CUDA device that is not there).
        task = tasks.get(cfg.task)(cfg.to_dict())  # the preset resolved
        if hasattr(task, "data_source"):
            log(INFO, "Data: %s", task.data_source)
        # Loaded before anything else happens: a missing file, a wrong CSV schema or an
        # unreachable dataset fails here, with the key to fix, not inside a client.
        test_set = task.load_central_test()
        settings = cfg.strategy_settings()
        if task.head_only:  # DP wrappers release (and update) only the head's arrays
            settings = replace(settings, released_keys=task.head_keys())
        device = getattr(task, "device", None)  # clients train on a GPU: aggregate there
        if isinstance(device, torch.device) and device.type == "cuda":
            settings = replace(settings, aggregate_device=str(device))
        strategy = strategies.build(cfg.privacy, settings)
        if cfg.privacy == SUBSPACE:
            subspace_setup.check(cfg, task)
        # Under a privacy mechanism the run directory keeps apart what no epsilon covers.
        released = (
            cast(Accounted, strategy).releases_metric if provides(strategy, Accounted) else None
        )
        saved = None
        if cfg.resume_from:
            path = resolve_output_dir(cfg.resume_from)
            with _writable("resume-from", path):
                run_dir, saved = RunDirectory.resume(path, cfg.to_dict(), released)
        else:
            path = resolve_output_dir(cfg.output_dir)
            with _writable("output-dir", path):
                run_dir = RunDirectory.create(path, cfg.task, cfg.strategy, cfg.privacy, released)
                run_dir.write_config(cfg.to_dict())
    except ConfigError as err:
        log(ERROR, "Invalid run-config: %s", err)
        raise
    if saved is not None:
        log(INFO, "Resuming after round %d of %d", saved["round"], cfg.num_server_rounds)
    log(INFO, "Run directory: %s", run_dir.path)
    return Setup(cfg, task, strategy, test_set, run_dir, saved)


@contextmanager
def _writable(key: str, path: Path) -> Iterator[None]:
    """An OS error while the run directory is made or reopened, as a ConfigError naming
    ``key`` and the path (not a traceback from inside the run)."""
    try:
        yield
    except OSError as err:
        raise ConfigError(
            f"'{key}' = {str(path)!r}: the run directory cannot be written there "
            f"({type(err).__name__}: {err.strerror or err}); choose a writable directory"
        ) from None


def explicit_keys(grid: Any) -> frozenset[str] | None:
    """The run-config keys the user gave (``flwr run --run-config``), from the Run that
    Flower hands the Grid; None where the Grid has none (a test's)."""
    try:
        return frozenset(grid.run.override_config)
    except (AttributeError, TypeError):
        return None


def privacy_line(cfg: config.RunConfig) -> str:
    """One plain line: private or NOT PRIVATE, the mechanism and the epsilon target."""
    o, dp, secure = cfg.options, cfg.part(DPSettings), SecAggSettings.on_in(cfg)
    what = f"task {cfg.task}, strategy {cfg.strategy}"
    if cfg.preset:
        what += f", preset {cfg.preset!r}"
    if cfg.privacy == "none":
        hidden = "; SecAgg+ hides single updates" if secure else ""
        return f"NOT PRIVATE: privacy='none', no differential privacy{hidden} ({what})"
    target, delta = dp.target_epsilon, dp.target_delta
    noise_key = NOISE_PARAMETER.get(cfg.privacy)
    if target:
        goal = f"epsilon target {target:g} at delta {delta:g}"
    elif noise_key and float(o[noise_key]):
        z = float(o[noise_key])
        goal = f"no epsilon target ({noise_key} = {z:g}; the ledger reports epsilon)"
    else:
        goal = "epsilon as the mechanism's keys set it (the ledger reports it)"
    how = [cfg.privacy]
    if cfg.privacy.startswith("dp-fedavg") or cfg.privacy == "subspace-dp":
        how.append(f"{dp.sampling} sampling")
        if secure and dp.noise_site == "client":
            how.append("distributed Skellam noise under SecAgg+")
        else:
            how.append(f"noise added by the {dp.noise_site}")
    elif secure:
        how.append("SecAgg+")
    return f"PRIVATE: {', '.join(how)}; {goal} ({what})"


def initial_model(run: Setup) -> torch.nn.Module:
    """The model of round 0: the task's, seeded, after the experiment's public-data
    steps (a warm start; subspace-dp's public basis and allocation samples), which
    touch no client."""
    cfg, task = run.cfg, run.task
    model = task.build_model(cfg.seed)
    if task.warm_start_epochs > 0:
        warm = cast(PublicData, task).warm_start(model)  # public data only: no client is touched
        shown = ", ".join(f"{k} {v:.4f}" for k, v in warm.items())
        log(INFO, "Warm start on public data: %s", shown)
        run.run_dir.write_json("warm-start.json", warm)
        run.run_dir.write_model("warm-start.pt", model.state_dict())
    if task.head_only:
        log(INFO, "Head-only training: clients train and share %s", ", ".join(task.head_keys()))
    released = task.head_keys() if task.head_only else tuple(model.state_dict())
    if cfg.privacy == SUBSPACE:
        subspace_setup.prepare(cfg, task, model, run.strategy, released)
    _distinct_cluster_models(run)
    return model


def _distinct_cluster_models(run: Setup) -> None:
    """Clustered FedAvg with ``cluster.init = "distinct"``: models 1..K-1 are the task's
    model drawn from their own seeds (public: no client is touched)."""
    strategy = innermost(run.strategy)
    if not isinstance(strategy, ClusteredFedAvg) or strategy.init != "distinct":
        return
    seeds = model_seeds(run.cfg.seed, strategy.k)
    models = [ArrayRecord(run.task.build_model(s).state_dict()) for s in seeds]
    strategy.set_distinct_models(models)
    log(INFO, "Clustered FedAvg: models 1..%d start from seeds %s", strategy.k - 1, seeds)


# -- start-up checks against the federation, before round 1 --------------------
SETTLE_S = 1.0  # simulation: virtual SuperNodes register within this of the first one
LOG_EVERY_S = 10.0


def needs(cfg: RunConfig, strategy) -> dict[str, int]:
    """``key -> the number of connected nodes it needs``."""
    need = {"min-available-nodes": cfg.min_available_nodes}
    if cfg.strategy != "local":
        need["min-train-nodes"] = cfg.min_train_nodes
    cohort = getattr(strategy, "num_sampled_clients", None) or getattr(
        strategy, "expected_clients", None
    )
    if cohort:
        need["dp.num-sampled-clients"] = int(cohort)
    if cfg.strategy == "hierarchical":
        need["hier.num-edges"] = cfg.part(HierSettings).num_edges
    return need


def _is_simulation(grid: Grid) -> bool:
    """Flower's simulation runs the ServerApp on an ``InMemoryGrid``."""
    return type(grid).__name__ == "InMemoryGrid"


def wait_for_federation(grid: Grid, need: dict[str, int], timeout: float) -> list[int]:
    """The connected node ids once every key's need is met, or what is there when it
    cannot be met any more (a simulation's count is final; a deployment waited
    ``timeout`` seconds)."""
    needed = max(need.values())
    simulation = _is_simulation(grid)
    started = time.monotonic()
    logged = -LOG_EVERY_S
    while True:
        nodes = sorted(grid.get_node_ids())
        waited = time.monotonic() - started
        if len(nodes) >= needed or waited >= timeout:
            return nodes
        if simulation and nodes:
            time.sleep(SETTLE_S)
            return sorted(grid.get_node_ids())
        if waited - logged >= LOG_EVERY_S:
            logged = waited
            short = ", ".join(f"'{k}' = {v}" for k, v in need.items() if v > len(nodes))
            log(
                INFO,
                "Waiting for nodes: %d connected, %d needed (%s); up to 'round-timeout' = %g s",
                len(nodes),
                needed,
                short,
                timeout,
            )
        time.sleep(0.5)


def check_federation(grid: Grid, cfg: RunConfig, task: Task, strategy) -> list[int]:
    """Run the start-up checks (module docstring); return the connected nodes in
    partition order.

    Raises
    ------
    StopTraining
        A check failed; the message names the key, the value and the fix.
    """
    partitions = partition_map(strategy)  # the run's node -> partition map
    need = needs(cfg, strategy)
    nodes = wait_for_federation(grid, need, cfg.round_timeout)
    short = {k: v for k, v in need.items() if v > len(nodes)}
    if short:
        where = (
            "the simulation has"
            if _is_simulation(grid)
            else f"connected within 'round-timeout' = {cfg.round_timeout:g} s:"
        )
        keys = ", ".join(f"'{k}' = {v}" for k, v in short.items())
        raise StopTraining(
            f"{keys} needs at least {max(short.values())} nodes, but {where} {len(nodes)}. "
            "Start more SuperNodes (simulation: --federation-config "
            '"num-supernodes=<n> client-resources-num-cpus=1") or lower the key'
        )
    _check_clusters(cfg, strategy, len(nodes))
    started = time.monotonic()
    log(
        INFO,
        "Learning the partition ids of %d nodes (%s)",
        len(nodes),
        "from the simulation's node order, confirmed by a few nodes; their answers wait "
        "for Ray to start the ClientApps, which import PyTorch and the app: seconds"
        if _is_simulation(grid)
        else "one query message each",
    )
    partitions.discover(grid, nodes, timeout=cfg.round_timeout)  # duplicates raise here
    log(INFO, "Partition ids known after %.1f s", time.monotonic() - started)
    errors = Counter(partitions.query_error(n) for n in nodes if partitions.query_error(n))
    if errors and sum(errors.values()) == len(nodes):
        grouped = "; ".join(f"{c} of {len(nodes)} nodes: {r}" for r, c in errors.most_common())
        raise StopTraining(f"no node could report its partition: {grouped}")
    sizes = Counter(n for node in nodes if (n := partitions.num_partitions_of(node)) is not None)
    if len(sizes) > 1:
        listed = ", ".join(f"{count} nodes say {size}" for size, count in sorted(sizes.items()))
        raise StopTraining(
            f"the SuperNodes' node configs disagree on num-partitions ({listed}); give every "
            "SuperNode the same 'num-partitions=<n>'"
        )
    canaries = cfg.part(AuditSettings).canaries
    if sizes:
        (size,) = sizes
        check_size(size, canaries, cfg.task, task)
    described = _describe(sizes)
    if canaries:  # say which nodes are not real clients: a federation not sized N + k
        described += f" ({canaries} of them the audit's canaries, the last partition ids)"
    log(INFO, "Federation: %d nodes, %s", len(nodes), described)
    return partitions.order(nodes)


def _check_clusters(cfg: RunConfig, strategy, connected: int) -> None:
    """``cluster.k`` against the clients one round trains (module docstring)."""
    base = innermost(strategy)
    if not isinstance(base, ClusteredFedAvg):
        return
    cohort = getattr(strategy, "num_sampled_clients", None) or getattr(
        strategy, "expected_clients", None
    )
    if cohort:
        per_round, source = int(cohort), f"'dp.num-sampled-clients' = {int(cohort)}"
    else:
        per_round = fedavg_sample_size(connected, base.fraction_train, base.min_train_nodes)
        source = (
            f"'fraction-train' = {base.fraction_train:g} of {connected} nodes, at least "
            f"'min-train-nodes' = {base.min_train_nodes}"
        )
    if base.k > per_round:
        raise StopTraining(
            f"'cluster.k' = {base.k} is more than the {per_round} clients a round trains "
            f"({source}): every round would leave at least {base.k - per_round} of the "
            f"{base.k} models untrained. Set 'cluster.k' to at most {per_round}, or train "
            "more clients per round"
        )


def check_size(size: int, canaries: int, name: str, task: Task) -> None:
    """num-partitions against the audit's canaries and a task that fixes its clients (the
    ServerApp's start-up and ``lab check``); raises ``StopTraining`` with the fix."""
    if canaries and size <= canaries:
        raise StopTraining(
            f"'audit.canaries' = {canaries} needs num-partitions = N + {canaries} with N "
            f">= 1 real clients, but the federation has num-partitions = {size} "
            "(simulation: --federation-config "
            f'"num-supernodes={size + canaries} client-resources-num-cpus=1")'
        )
    defined = task.num_partitions()
    clients = size - canaries  # the last partition ids are the audit's canaries
    try:
        task.check_partitioning(clients)  # e.g. more clients than examples to split
    except ValueError as err:
        raise StopTraining(str(err)) from None
    if defined is None or clients == defined:
        return
    try:
        task.load_partition(0, clients)  # the task's own message names the fix
    except ValueError as err:
        raise StopTraining(str(err)) from None
    raise StopTraining(
        f"task '{name}' defines {defined} clients but the federation has "
        f"num-partitions={size}" + (f" ({canaries} of them 'audit.canaries')" if canaries else "")
    )


def _describe(sizes: Counter) -> str:
    return f"num-partitions = {next(iter(sizes))}" if sizes else "num-partitions not reported"


# -- what the run ran on: environment.json and rerun.sh ----------------------------
ENVIRONMENT_FILE = "environment.json"
RERUN_FILE = "rerun.sh"
PACKAGES = ("flwr", "torch", "opacus", "dp-accounting", "numpy", "ray")
UNKNOWN = "unknown"
# What lab.connections registers: one CPU per ClientApp (Flower's own default is 2).
CLIENT_RESOURCES = "client-resources-num-cpus=1"
DEPLOYED_CONNECTION = "lab"  # the docs' name of a connection to a real SuperLink


def versions() -> dict[str, str]:
    """Python's and each of ``PACKAGES``' version ("not installed" where absent)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def git_state(directory: Path | None) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the checkout at ``directory`` ("unknown"
    for both where there is no checkout or no git)."""
    state: dict[str, Any] = {"commit": UNKNOWN, "dirty": UNKNOWN}
    if directory is None:
        return state
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return state
    return {"commit": head, "dirty": bool(changed)}


def federation(grid: Any) -> dict[str, Any]:
    """The federation as the ServerApp sees it."""
    simulation = type(grid).__name__ == "InMemoryGrid"
    found: dict[str, Any] = {
        "runtime": "simulation" if simulation else "deployment",
        "num-nodes": len(list(grid.get_node_ids())),
        "backend": UNKNOWN,
        "client-resources": UNKNOWN + " to the ServerApp (they change speed, not results)",
    }
    ray = sys.modules.get("ray")
    if simulation and ray is not None and ray.is_initialized():
        found["backend"] = "ray"
        found["ray-cluster-cpus"] = ray.cluster_resources().get("CPU")
    return found


def rerun_command(cfg: config.RunConfig, fed: dict[str, Any]) -> str:
    """The ``flwr run`` command that makes ``cfg`` again on a federation like ``fed``."""
    parts = ["flwr run ."]
    if fed["runtime"] == "simulation":
        parts.append("local-simulation --stream")
        size = f"num-supernodes={fed['num-nodes']} {CLIENT_RESOURCES}"
        parts.append(f'--federation-config "{size}"')
    else:  # SuperNodes are started by hand: as many, with the same node configs
        parts.append(f"{DEPLOYED_CONNECTION} --stream")
    pairs = config.run_config_arg(config.command_line(cfg))
    if pairs:
        parts.append(f"--run-config {_quoted(pairs)}")
    return " ".join(parts)


def _quoted(text: str) -> str:
    """Double quotes (as the docs write it) unless the shell would expand something."""
    if any(c in text for c in '"$`\\!'):
        return shlex.quote(text)
    return f'"{text}"'


def record_environment(run_dir: RunDirectory, cfg: config.RunConfig, grid: Any) -> str:
    """Write ``environment.json`` and ``rerun.sh``; return the rerun command."""
    fed = federation(grid)
    command = rerun_command(cfg, fed)
    # The code that runs, where it is a checkout (not a FAB unpacked on a SuperLink);
    # else the checkout the app was pip-installed from.
    source = presets.APP_DIR if (presets.APP_DIR / ".git").exists() else app_source_dir()
    doc: dict[str, Any] = {
        "federation": fed,
        "versions": versions(),
        "app": {"source-dir": str(source) if source else UNKNOWN, **git_state(source)},
        "preset": cfg.preset,
        "rerun": command,
    }
    run_dir.write_json(ENVIRONMENT_FILE, doc)
    script = (
        "#!/bin/sh\n# Reruns this run's resolved run-config (from the app's directory; "
        f"git commit {doc['app']['commit']}).\n{command}\n"
    )
    (run_dir.path / RERUN_FILE).write_text(script)
    return command
