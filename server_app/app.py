"""ServerApp: validate the run-config, build task and strategy, run the rounds,
write the run directory."""

from __future__ import annotations

from logging import INFO
from typing import cast

from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from threadpoolctl import threadpool_limits

from protocol import keys
from server_app import run_status, setup, tracking
from server_app.audit import AuditSettings, RunAudit
from server_app.evaluation import central_eval
from server_app.failures import FailureWatch, Outcome, RunFailed, write_outcome
from server_app.recorder import RoundRecorder, certify, restore
from server_app.rounds import ConsoleSettings, quiet_flower_rounds, run_rounds
from strategies import StopTraining
from strategies.mechanisms import threat_models
from strategies.runtime.capabilities import NoGlobalModel, innermost, ledger_of, provides

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment as the run-config describes it."""
    # The ServerApp runs in a thread of a process that also drives Ray; numpy's
    # multi-threaded OpenBLAS then spins for minutes on a 180 x 850 SVD (measured: 20 ms
    # alone, > 5 min there). The server's linear algebra is small: one BLAS thread.
    with threadpool_limits(limits=1, user_api="blas"):
        _run(grid, context)


def _run(grid: Grid, context: Context) -> None:
    run = setup.load(context.run_config, setup.explicit_keys(grid))
    cfg, task, strategy, run_dir = run.cfg, run.task, run.strategy, run.run_dir
    quiet_flower_rounds(cfg.part(ConsoleSettings).flower_rounds)
    model = setup.initial_model(run)
    ledger = ledger_of(strategy)  # privacy wrappers own the run's ledger
    watch = FailureWatch.for_run(cfg.options, private=ledger is not None)
    _check_federation(grid, run)
    rerun = setup.record_environment(run_dir, cfg, grid)
    initial = ArrayRecord(model.state_dict())
    resumed = restore(run.saved, strategy, grid, cfg, watch) if run.saved is not None else None
    central = None
    if provides(innermost(strategy), NoGlobalModel):
        log(INFO, "%s", cast(NoGlobalModel, innermost(strategy)).NO_GLOBAL_MODEL)
    elif cfg.central_eval:
        central = central_eval(task, model, innermost(strategy), run.test_set)
    if ledger is not None:
        ledger.privacy_unit = task.PRIVACY_UNIT
    auditor = RunAudit(cfg, initial, ledger) if AuditSettings.on_in(cfg) else None
    recorder = RoundRecorder(run_dir, cfg, strategy, auditor, watch)
    if run.saved is not None:
        recorder.adopt(run.saved)
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
            on_round=recorder.record,
            on_commit=recorder.commit,
            on_reject=recorder.reject,
            # Clients keep their own diagnostics (e.g. PPO episode logs) here: on a shared
            # filesystem (simulation) that is inside the run directory, under curator/
            # in a privacy run.
            train_config={keys.ARTIFACTS_DIR: str(run_dir.clients_dir)},
            resumed=resumed,
            watch=watch,
        )
    except BaseException as err:  # written if the process lives long enough
        reason = f"the ServerApp raised {type(err).__name__}: {err}"
        write_outcome(run_dir, Outcome("failed", reason, recorder.last_recorded))
        raise
    failed = outcome.status == "failed"
    title = f"{cfg.task} · {cfg.strategy} · privacy={cfg.privacy} · seed {cfg.seed}"
    report = threat_models.run_report(cfg.privacy, cfg, strategy) if ledger else None
    status = run_status.from_report(cfg.privacy, report, outcome.to_json())
    state = None if failed else final.to_torch_state_dict()
    run_dir.finish(state, title=title, caption=status.caption())
    # A failed run's last model is no release to audit.
    audited = None if failed or auditor is None else auditor.final(run_dir, final)
    if ledger is not None:
        certify(run_dir, ledger, cfg, strategy, audited)
    log(INFO, "Results: %s", run_dir.path)
    log(INFO, "Rerun: %s", rerun)
    write_outcome(run_dir, outcome, watch)
    tracking.finish_run(run_dir.path, cfg.options, log)
    log(INFO, "%s", setup.privacy_line(cfg))  # says NOT PRIVATE for privacy='none'
    if failed:  # Flower's run status says so too (`flwr list`)
        raise RunFailed(outcome.reason)


def _check_federation(grid: Grid, run: setup.Setup) -> None:
    """The start-up checks against the connected nodes; a failure ends the run."""
    try:
        setup.check_federation(grid, run.cfg, run.task, run.strategy)
    except StopTraining as err:
        last = int(run.saved["round"]) if run.saved else 0
        outcome = Outcome("failed", f"start-up check: {err}", last)
        write_outcome(run.run_dir, outcome)
        raise RunFailed(outcome.reason) from None
