"""What the round loop hands back to the run directory: each round's record, each
round's checkpoint, and the state a resumed run continues from."""

from __future__ import annotations

from typing import cast

from flwr.app import MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from server_app import certify
from server_app.audit import RunAudit
from server_app.config import RunConfig
from server_app.failures import FailureWatch
from server_app.results import CURATOR_DIR, STRATEGY_STATE, RunDirectory
from server_app.rounds import RoundResult
from strategies.runtime.capabilities import (
    MultiModel,
    Resumable,
    WritesTables,
    innermost,
    ledger_of,
    provides,
)
from strategies.runtime.checkpoint import (
    decode,
    encode,
    global_rng_state,
    load_strategy_state,
    set_global_rng_state,
    strategy_state,
)
from strategies.runtime.nodes import wait_for_nodes
from strategies.runtime.partitions import partition_map

LOCAL_VIEW_FILE = f"{CURATOR_DIR}/local-view.json"  # each client's ε against the server


class RoundRecorder:
    """``on_round`` and ``on_commit`` of :func:`server_app.rounds.run_rounds`."""

    def __init__(
        self,
        run_dir: RunDirectory,
        cfg: RunConfig,
        strategy: Strategy,
        auditor: RunAudit | None,
        watch: FailureWatch | None = None,
    ) -> None:
        self.run_dir, self.cfg, self.strategy, self.auditor = run_dir, cfg, strategy, auditor
        self.watch = watch
        self.base = innermost(strategy)
        self.ledger = ledger_of(strategy)
        self.last_recorded = 0  # the last round whose model was recorded
        self._committed: tuple[int, dict] | None = None  # the last commit's round, payload

    def commit(self, result: RoundResult) -> None:
        """Checkpoint the round right after its aggregate (before anything is released),
        with the failure policy's state (the divergence guard's reference values)."""
        payload = {
            "arrays": encode(result.arrays),
            STRATEGY_STATE: strategy_state(self.strategy),
            "rng": global_rng_state(),
            "result": {
                "train": dict(result.train) if result.train is not None else None,
                "clients": result.clients,
                "seconds": result.seconds,
            },
            "guard": self.watch.state_dict() if self.watch is not None else None,
        }
        self.run_dir.commit(result.server_round, payload)
        self._committed = (result.server_round, payload)

    def reject(self, result: RoundResult, reason: str) -> None:
        """The committed round failed the divergence guard: mark its checkpoint so that
        ``resume-from`` refuses it. The payload is the commit's (a privacy charge stays
        committed; nothing is charged or released again)."""
        if self._committed is not None and self._committed[0] == result.server_round:
            self.run_dir.reject(result.server_round, self._committed[1], reason)

    def adopt(self, saved: dict) -> None:
        """A resumed run: the checkpoint it continues is the last commit (so that a
        resumed round that fails the guard again is marked too)."""
        payload = {k: v for k, v in saved.items() if k not in ("format", "round")}
        self._committed = (int(saved["round"]), payload)

    def record(self, result: RoundResult) -> None:
        """Write the evaluated round: metrics, models, the strategy's tables, the ledger."""
        if not result.diverged:
            self.last_recorded = result.server_round
            if self.auditor is not None:  # audit.canaries > 0
                self.auditor.interim(result.server_round, result.arrays)
        models = None
        multi = cast(MultiModel, self.base)
        if provides(multi, MultiModel) and multi.models:
            label = multi.MODEL_LABEL
            models = {f"{label}-{k}": m.to_torch_state_dict() for k, m in enumerate(multi.models)}
        if provides(self.base, WritesTables):
            for name, rows in cast(WritesTables, self.base).tables().items():
                self.run_dir.write_rows(self.run_dir.table(name), rows)
        self.run_dir.record_round(result, None, models)
        if self.ledger is not None and result.server_round > 0:
            self.run_dir.write_ledger(self.ledger, certify.ledger_report(self.cfg, self.strategy))
            view = getattr(self.strategy, "local_view", None)
            if view is not None:  # who was asked most depends on the secret sample
                self.run_dir.write_json(LOCAL_VIEW_FILE, view.summary())


def restore(
    saved: dict,
    strategy: Strategy,
    grid: Grid,
    cfg: RunConfig,
    watch: FailureWatch | None = None,
) -> RoundResult:
    """Load a checkpoint's strategy state (ledger included), generators and failure
    policy state (into ``watch``); return the committed round (its global arrays, train
    metrics and participation), which the run evaluates again before going on. State
    kept per client is handed to the nodes that report the same partition ids now (node
    ids change from run to run). A privacy wrapper then charges what the interrupted
    round may have released (``on_resume``)."""
    partitions = partition_map(strategy)  # the run's node -> partition map
    nodes = wait_for_nodes(grid, cfg.min_available_nodes, partitions, timeout=cfg.round_timeout)
    node_of = {p: n for n in nodes if (p := partitions.partition_of(n)) is not None}
    load_strategy_state(strategy, saved[STRATEGY_STATE], node_of)
    set_global_rng_state(saved["rng"])
    if watch is not None:
        watch.load_state_dict(saved.get("guard"))
    if provides(strategy, Resumable):
        cast(Resumable, strategy).on_resume()
    result = saved["result"]
    train = MetricRecord(result["train"]) if result["train"] is not None else None
    return RoundResult(
        int(saved["round"]),
        decode(saved["arrays"]),
        train=train,
        clients=list(result["clients"]),
        seconds=result["seconds"],
    )
