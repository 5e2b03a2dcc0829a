"""ServerApp: validate the run-config, build task and strategy, run the rounds,
write the run directory."""

from __future__ import annotations

from logging import ERROR, INFO

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

import strategies
import tasks
from server_app import config
from server_app.results import RunDirectory, resolve_output_dir
from server_app.rounds import run_rounds
from tasks.base import Task
from tasks.options import ConfigError

app = ServerApp()


def _central_eval(task: Task, model: torch.nn.Module):
    test_set = task.load_central_test()  # loaded now: a missing dataset fails here

    def evaluate(_server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord(task.evaluate(model, test_set))

    return evaluate


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment as the run-config describes it."""
    try:
        cfg = config.load(context.run_config)
        # The task checks what depends on it (e.g. a CUDA device that is not there).
        task = tasks.get(cfg.task)(context.run_config)
        strategy = strategies.build(cfg.privacy, cfg.strategy_settings())
    except ConfigError as err:
        log(ERROR, "Invalid run-config: %s", err)
        raise
    run_dir = RunDirectory.create(
        resolve_output_dir(cfg.output_dir), cfg.task, cfg.strategy, cfg.privacy
    )
    run_dir.write_config(cfg.to_dict())
    log(INFO, "Run directory: %s", run_dir.path)

    model = task.build_model(cfg.seed)
    central = None
    if cfg.central_eval and cfg.strategy != "local":
        central = _central_eval(task, model)
    elif cfg.strategy == "local":
        log(INFO, "strategy=local keeps no global model: central evaluation is skipped")

    ledger = getattr(strategy, "ledger", None)  # privacy wrappers own the run's ledger
    log(INFO, "Strategy %s, privacy %s:", type(strategy).__name__, cfg.privacy)
    strategy.summary()
    final = run_rounds(
        strategy,
        grid,
        ArrayRecord(model.state_dict()),
        num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout,
        central_eval=central,
        on_round=lambda result: run_dir.record_round(result, ledger),
    )
    run_dir.finish(
        final.to_torch_state_dict(),
        title=f"{cfg.task} · {cfg.strategy} · privacy={cfg.privacy} · seed {cfg.seed}",
    )
    if ledger is not None:
        run_dir.write_ledger(ledger)
        _log_privacy_summary(ledger, cfg)
    log(INFO, "Results: %s", run_dir.path)


def _log_privacy_summary(ledger, cfg: config.RunConfig) -> None:
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
    if cfg.privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive"):
        log(INFO, "\t├── noise added by the %s", cfg.options["dp.noise-site"])
    for line in summary.get("statements", []):
        log(INFO, "\t├── %s", line)
    log(INFO, "\t└── full record: ledger.json in the run directory")
