"""Everything a run needs before round 1: the validated config, the task, the strategy,
the run directory and the initial model (with the steps some experiments add to it)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from logging import ERROR, INFO
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord
from flwr.common.logger import log

import strategies
import tasks
from config.options import ConfigError
from server_app import config, subspace_setup
from server_app.results import RunDirectory, resolve_output_dir
from server_app.subspace_setup import PublicData
from strategies.algorithms.clustered import ClusteredFedAvg, model_seeds
from strategies.mechanisms.base import NOISE_PARAMETER, DPSettings
from strategies.runtime.capabilities import Accounted, innermost, provides
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
