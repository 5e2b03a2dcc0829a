"""ServerApp: validate the run-config, build task and strategy, run the rounds,
write the run directory."""

from __future__ import annotations

from dataclasses import replace
from logging import ERROR, INFO

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from threadpoolctl import threadpool_limits

import strategies
import tasks
from server_app import certify, config, subspace_setup
from server_app.audit import RunAudit
from server_app.failures import OUTCOME_FILE, FailureWatch, Outcome, RunFailed
from server_app.results import CLIENTS_DIR, RunDirectory, resolve_output_dir
from server_app.rounds import RoundResult, run_rounds
from server_app.startup import check_federation
from strategies import StopTraining, keys, partitions, threat_models
from strategies.base import wait_for_nodes
from strategies.checkpoint import (
    decode,
    encode,
    global_rng_state,
    load_strategy_state,
    set_global_rng_state,
    strategy_state,
)
from tasks.base import Task
from tasks.options import ConfigError

app = ServerApp()


def _central_eval(task: Task, model: torch.nn.Module, strategy=None, test_set=None):
    """Evaluation of the global model on the central test set (``test_set``, loaded
    now when not given).

    A strategy that keeps several models (``models``, named by ``MODEL_LABEL``) has
    each one evaluated too, as ``<label>-<k>-<key>``. For clusters (K global models)
    the plain keys are :func:`best_of_clusters`; otherwise (hierarchical edges) they
    are the global model's own.
    """
    if test_set is None:
        test_set = task.load_central_test()
    label = getattr(strategy, "MODEL_LABEL", "cluster")

    def evaluate_one(arrays: ArrayRecord) -> dict:
        model.load_state_dict(arrays.to_torch_state_dict())
        return task.evaluate(model, test_set)

    def evaluate(_server_round: int, arrays: ArrayRecord) -> MetricRecord:
        models = list(getattr(strategy, "models", None) or [])  # none before round 1
        if not models:
            return MetricRecord(evaluate_one(arrays))
        per_model = [evaluate_one(m) for m in models]
        if label == "cluster":
            return MetricRecord(best_of_clusters(per_model))
        return MetricRecord(evaluate_one(arrays) | _prefixed(per_model, label))

    return evaluate


def _prefixed(per_model: list[dict[str, float]], label: str) -> dict[str, float]:
    return {
        f"{label}-{k}-{key}": value
        for k, metrics in enumerate(per_model)
        for key, value in metrics.items()
    }


def best_of_clusters(per_model: list[dict[str, float]]) -> dict[str, float]:
    """Merge the central evaluation of K cluster models.

    Every model's metrics appear as ``cluster-<k>-<key>``. The plain keys are the
    best model's per key (highest reward, accuracy, R², AUC or hit rate; lowest loss
    or squared error): for a per-planet reward, that is the cluster model the planet's
    clients would pick with perfect assignment. Other keys (counts, stds, gaps) are
    model 0's.
    """
    merged = _prefixed(per_model, "cluster")
    for key, first in per_model[0].items():
        values = [metrics[key] for metrics in per_model]
        if "std" in key:
            merged[key] = first
        elif any(word in key for word in HIGHER_IS_BETTER):
            merged[key] = max(values)
        elif any(word in key for word in LOWER_IS_BETTER):
            merged[key] = min(values)
        else:
            merged[key] = first
    return merged


# Metric-name parts that say which way is better (tasks' EVAL_* keys).
HIGHER_IS_BETTER = ("reward", "accuracy", "r2", "auc", "hr10")
LOWER_IS_BETTER = ("loss", "mse")


def _innermost(strategy):
    """The base strategy inside the privacy wrappers (which keep it as ``.strategy``)."""
    while isinstance(getattr(strategy, "strategy", None), Strategy):
        strategy = strategy.strategy
    return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment as the run-config describes it."""
    # The ServerApp runs in a thread of a process that also drives Ray; numpy's
    # multi-threaded OpenBLAS then spins for minutes on a 180 x 850 SVD (measured: 20 ms
    # alone, > 5 min there). The server's linear algebra is small: one BLAS thread.
    with threadpool_limits(limits=1, user_api="blas"):
        _run(grid, context)


def _run(grid: Grid, context: Context) -> None:
    try:
        cfg = config.load(context.run_config)
        # The task checks what depends on it (e.g. a CUDA device that is not there).
        task = tasks.get(cfg.task)(context.run_config)
        if hasattr(task, "data_source"):
            log(INFO, "Data: %s", task.data_source)
        # Loaded before anything else happens: a missing file, a wrong CSV schema or an
        # unreachable dataset fails here, with the key to fix, not inside a client.
        test_set = task.load_central_test()
        head_only = bool(cfg.options.get("subspace.head-only", False))
        settings = cfg.strategy_settings()
        if head_only:  # DP wrappers release (and update) only the head's arrays
            settings = replace(settings, released_keys=task.head_keys())
        strategy = strategies.build(cfg.privacy, settings)
        subspace_setup.check(cfg, task)
        # Under a privacy mechanism the run directory keeps apart what no epsilon covers.
        released = getattr(strategy, "releases_metric", None)
        saved = None
        if cfg.resume_from:
            run_dir, saved = RunDirectory.resume(
                resolve_output_dir(cfg.resume_from), cfg.to_dict(), released
            )
    except ConfigError as err:
        log(ERROR, "Invalid run-config: %s", err)
        raise
    if saved is None:
        run_dir = RunDirectory.create(
            resolve_output_dir(cfg.output_dir), cfg.task, cfg.strategy, cfg.privacy, released
        )
        run_dir.write_config(cfg.to_dict())
    else:
        log(INFO, "Resuming after round %d of %d", saved["round"], cfg.num_server_rounds)
    log(INFO, "Run directory: %s", run_dir.path)

    base = _innermost(strategy)
    model = task.build_model(cfg.seed)
    if int(cfg.options.get("subspace.warm-start", 0)) > 0:
        warm = task.warm_start(model)  # public data only: no client is touched
        log(
            INFO,
            "Warm start on public data: %s",
            ", ".join(f"{k} {v:.4f}" for k, v in warm.items()),
        )
        run_dir.write_json("warm-start.json", warm)
        run_dir.write_model("warm-start.pt", model.state_dict())
    if head_only:
        log(INFO, "Head-only training: clients train and share %s", ", ".join(task.head_keys()))
    released = task.head_keys() if head_only else tuple(model.state_dict())
    subspace_setup.prepare(cfg, task, model, strategy, released)
    watch = FailureWatch(
        max_failed_rounds=int(cfg.options["run.max-failed-rounds"]),
        divergence_factor=float(cfg.options["run.divergence-factor"]),
        private=getattr(strategy, "ledger", None) is not None,
    )
    try:
        check_federation(grid, cfg, task, strategy)
    except StopTraining as err:
        outcome = Outcome("failed", f"start-up check: {err}", int(saved["round"]) if saved else 0)
        _write_outcome(run_dir, outcome, watch, None)
        raise RunFailed(outcome.reason) from None
    initial, resumed = ArrayRecord(model.state_dict()), None
    if saved is not None:
        resumed = _restore(saved, strategy, grid, cfg)
    central = None
    if cfg.central_eval and cfg.strategy != "local":
        central = _central_eval(task, model, base, test_set)
    elif cfg.strategy == "local":
        log(INFO, "strategy=local keeps no global model: central evaluation is skipped")

    ledger = getattr(strategy, "ledger", None)  # privacy wrappers own the run's ledger
    if ledger is not None:
        ledger.privacy_unit = task.PRIVACY_UNIT

    def on_commit(result) -> None:
        run_dir.commit(
            result.server_round,
            {
                "arrays": encode(result.arrays),
                "strategy": strategy_state(strategy),
                "rng": global_rng_state(),
                "result": {
                    "train": dict(result.train) if result.train is not None else None,
                    "clients": result.clients,
                    "seconds": result.seconds,
                },
            },
        )

    recorded = [0]  # the last round whose model was recorded
    auditor = RunAudit(cfg, initial, ledger)

    def on_round(result) -> None:
        if not result.diverged:
            recorded[0] = result.server_round
            auditor.interim(result.server_round, result.arrays)
        models = None
        if getattr(base, "models", None):  # K cluster models or E edge models
            label = getattr(base, "MODEL_LABEL", "cluster")
            models = {f"{label}-{k}": m.to_torch_state_dict() for k, m in enumerate(base.models)}
        # Strategies with per-client records (clusters.csv, selection.csv) expose them.
        for name, rows in getattr(base, "tables", dict)().items():
            run_dir.write_rows(run_dir.table(name), rows)
        run_dir.record_round(result, None, models)
        if ledger is not None and result.server_round > 0:
            run_dir.write_ledger(ledger, _ledger_extra(cfg, strategy))

    log(INFO, "Strategy %s, privacy %s:", type(strategy).__name__, cfg.privacy)
    strategy.summary()
    try:
        final, outcome = run_rounds(
            strategy,
            grid,
            initial,
            num_rounds=cfg.num_server_rounds,
            timeout=cfg.round_timeout,
            central_eval=central,
            on_round=on_round,
            on_commit=on_commit,
            # Clients keep their own diagnostics (e.g. PPO episode logs) here: on a shared
            # filesystem (simulation) that is inside the run directory.
            train_config={keys.ARTIFACTS_DIR: str(run_dir.path / CLIENTS_DIR)},
            resumed=resumed,
            watch=watch,
        )
    except BaseException as err:  # written if the process lives long enough
        reason = f"the ServerApp raised {type(err).__name__}: {err}"
        _write_outcome(run_dir, Outcome("failed", reason, recorded[0]), watch, ledger)
        raise
    run_dir.finish(
        final.to_torch_state_dict() if outcome.status != "failed" else None,
        title=f"{cfg.task} · {cfg.strategy} · privacy={cfg.privacy} · seed {cfg.seed}",
    )
    audited = None
    if outcome.status != "failed":  # a failed run's last model is no release to audit
        audited = auditor.final(run_dir, final)
    if ledger is not None:
        report = _ledger_extra(cfg, strategy)
        if audited is not None:
            doc = audited.to_json()
            report["audit"] = {
                key: doc[key]
                for key in ("epsilon_estimate", "epsilon_lower_bound", "confidence",
                            "canaries", "exceeds_accountant")
            }  # fmt: skip
        run_dir.write_ledger(ledger, report)
        _log_privacy_summary(ledger, cfg, report)
        certify.report(run_dir, ledger, strategy)
    log(INFO, "Results: %s", run_dir.path)
    _write_outcome(run_dir, outcome, watch, ledger)
    if outcome.status == "failed":  # Flower's run status says so too (`flwr list`)
        raise RunFailed(outcome.reason)


def _write_outcome(run_dir: RunDirectory, outcome: Outcome, watch: FailureWatch, ledger) -> None:
    """``outcome.json`` and the log's last line: how the run ended."""
    if outcome.last_round > 0:
        outcome.checkpoint = str(run_dir.path / "checkpoint" / "global.pt")
    log(ERROR if outcome.status == "failed" else INFO, "%s", outcome.line())
    if ledger is not None and watch.stopped_on_failed_rounds:
        # The clients' error texts stay with what no epsilon covers (curator/); the top
        # level says only that the run stopped, and that no epsilon covers that event.
        run_dir.write_json(run_dir.table(OUTCOME_FILE), outcome.to_json())
        outcome.reason = (
            f"no sampled client contributed; the clients' reasons are in "
            f"{run_dir.table(OUTCOME_FILE)}"
        )
        outcome.undisclosed = (
            "the run stopped because no sampled client contributed (every client of its "
            "first round failed alike, or no client of its last 'run.max-failed-rounds' "
            "rounds contributed); that event depends on the clients' data and no epsilon "
            "covers it"
        )
    run_dir.write_outcome(outcome)


def _restore(saved: dict, strategy: Strategy, grid: Grid, cfg: config.RunConfig) -> RoundResult:
    """Load a checkpoint's strategy state (ledger included) and generators; return the
    committed round (its global arrays, train metrics and participation), which the run
    evaluates again before going on. State kept per client is handed to the nodes that
    report the same partition ids now (node ids change from run to run). A privacy
    wrapper then charges what the interrupted round may have released (``on_resume``)."""
    nodes = wait_for_nodes(grid, cfg.min_available_nodes, timeout=cfg.round_timeout)
    node_of = {partitions.partition_of(n): n for n in nodes}
    node_of.pop(None, None)
    load_strategy_state(strategy, saved["strategy"], node_of)
    set_global_rng_state(saved["rng"])
    if hasattr(strategy, "on_resume"):
        strategy.on_resume()
    result = saved["result"]
    train = MetricRecord(result["train"]) if result["train"] is not None else None
    return RoundResult(
        int(saved["round"]),
        decode(saved["arrays"]),
        train=train,
        clients=list(result["clients"]),
        seconds=result["seconds"],
    )


def _ledger_extra(cfg: config.RunConfig, strategy: Strategy) -> dict:
    """``ledger.json``'s record of who each epsilon holds against, and of the noise
    calibrated to ``dp.target-epsilon`` (None when the noise was given)."""
    return {
        "threat-models": threat_models.run_report(cfg.privacy, cfg.options, strategy),
        "calibration": getattr(strategy, "calibration", None),
    }


def _log_privacy_summary(ledger, cfg: config.RunConfig, report: dict) -> None:
    summary = ledger.summary()
    log(INFO, "Privacy (%s):", cfg.privacy)
    if ledger.releases:  # else the statements say plainly that no client-level epsilon exists
        log(
            INFO,
            "\t├── (epsilon, delta) = (%.4f, %g) over %d releases",
            ledger.epsilon(),
            ledger.target_delta,
            len(ledger.releases),
        )
        log(
            INFO,
            "\t├── accountant %s, sampling %s, neighbouring relation %s",
            ledger.accountant,
            ledger.sampling,
            ledger.neighboring,
        )
    if cfg.privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive", "subspace-dp"):
        log(INFO, "\t├── noise added by the %s", cfg.options["dp.noise-site"])
    for line in threat_models.summary_lines(report["threat-models"]):
        log(INFO, "\t├── %s", line)
    for line in summary.get("statements", []):
        log(INFO, "\t├── %s", line)
    log(INFO, "\t└── full record: ledger.json in the run directory")
