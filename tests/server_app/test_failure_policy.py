"""Runs that cannot learn stop loudly (``server_app/failures.py``, ``setup.py``):
``outcome.json`` says ``completed``, ``stopped`` or ``failed`` with the reason, and a
failed run keeps its last good checkpoint.

The ServerApp runs against the real ClientApp in this process (:mod:`tests.inprocess`);
a ClientApp that raises answers with Flower's error reply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import tasks
from lab import figures
from lab.checks import exit_on_failed
from server_app.failures import (
    FailureWatch,
    Outcome,
    RunFailed,
    grouped_reasons,
)
from tests.inprocess import InProcessGrid, run_config, run_server

pytestmark = pytest.mark.usefixtures("learning_curve_not_rendered")

NODES = [11, 22, 33, 44]


def _run(tmp_path: Path, nodes=NODES, **overrides) -> tuple[Path, InProcessGrid, Exception | None]:
    config = run_config(**{"output-dir": str(tmp_path), **overrides})
    grid = InProcessGrid(config, nodes)
    grid.errors_as_replies = True
    try:
        run_server(config, grid)
        raised = None
    except RunFailed as err:
        raised = err
    (path,) = list(tmp_path.iterdir())
    return path, grid, raised


def _outcome(path: Path) -> dict:
    return json.loads((path / "outcome.json").read_text())


def _train_rounds(grid: InProcessGrid) -> list[int]:
    return sorted(
        {
            int(m.content["config"]["server-round"])
            for m in grid.sent
            if m.metadata.message_type == "train"
        }
    )


def test_a_normal_run_is_completed(tmp_path):
    path, _, raised = _run(tmp_path, **{"num-server-rounds": 1})
    assert raised is None
    assert _outcome(path) == {
        "status": "completed",
        "reason": "",
        "last-round": 1,
        "checkpoint": str(path / "checkpoint" / "global.pt"),
    }
    assert (path / "model.pt").is_file()


def test_lunar_lander_on_a_federation_of_another_size_fails_before_round_one(tmp_path):
    # The case: the client table fixes the clients (3 + 3 x derived-per-base).
    nodes = list(range(101, 111))  # 10 nodes
    path, grid, raised = _run(tmp_path, nodes, task="lunar-lander", **{"ppo.derived-per-base": 10})
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert outcome["last-round"] == 0 and outcome["checkpoint"] is None
    assert "lunar-lander defines 33 clients" in outcome["reason"]
    assert "num-partitions=10" in outcome["reason"]
    assert "num-supernodes=33" in outcome["reason"]  # the fix
    assert _train_rounds(grid) == []  # nothing was trained


def test_every_client_failing_alike_stops_after_the_first_round(tmp_path, monkeypatch):
    def broken(self, model, partition, local):
        raise RuntimeError("the data file is corrupt")

    monkeypatch.setattr(tasks.get("digits"), "train", broken)
    path, grid, raised = _run(tmp_path, **{"num-server-rounds": 5})
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert _train_rounds(grid) == [1]
    assert outcome["reason"] == (
        "round 1, every client failed the same way: 4 of 4 clients: "
        "<class 'RuntimeError'>:<'the data file is corrupt'>"
    )
    assert not (path / "model.pt").exists()


def test_consecutive_failed_rounds_stop_the_run(tmp_path, monkeypatch):
    # Errors that differ by client are not the first-round rule: the streak rule stops.
    def broken(self, model, partition, local):
        raise RuntimeError(f"client {local.partition_id} broke")

    monkeypatch.setattr(tasks.get("digits"), "train", broken)
    path, grid, raised = _run(tmp_path, **{"num-server-rounds": 6, "run.max-failed-rounds": 2})
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert _train_rounds(grid) == [1, 2]
    assert outcome["reason"].startswith(
        "no client contributed in 2 consecutive rounds ('run.max-failed-rounds' = 2); "
        "round 2: 1 of 4 clients: <class 'RuntimeError'>:<'client 0 broke'>; "
    )
    # 0: never stopped on failed rounds; every round runs.
    path, grid, raised = _run(
        tmp_path / "never", **{"num-server-rounds": 3, "run.max-failed-rounds": 0}
    )
    assert raised is None and _outcome(path)["status"] == "completed"
    assert _train_rounds(grid) == [1, 2, 3]


def test_a_run_shorter_than_the_streak_where_no_client_ever_contributed_fails(
    tmp_path, monkeypatch
):
    # Two rounds, fewer than 'run.max-failed-rounds' (3): the streak rule cannot stop it,
    # yet its model is the initial one. (Seen deployed: no message was ever answered.)
    def broken(self, model, partition, local):
        raise RuntimeError(f"client {local.partition_id} broke")

    monkeypatch.setattr(tasks.get("digits"), "train", broken)
    path, grid, raised = _run(tmp_path, **{"num-server-rounds": 2})
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert _train_rounds(grid) == [1, 2] and outcome["last-round"] == 2
    assert outcome["reason"].startswith(
        "no client contributed in any of the run's 2 round(s), so the global model is the one "
        "it started from; last round: 1 of 4 clients: <class 'RuntimeError'>:<'client 0 broke'>; "
    )
    # One round that contributed is enough; 0 never fails a run on failed rounds.
    watch = FailureWatch()
    watch.after_train(1, [{"replied": True, "error": ""}], first=True)
    watch.after_train(2, [{"replied": False, "error": "no reply"}], first=False)
    assert watch.never_contributed(2) is None
    never = FailureWatch(max_failed_rounds=0)
    never.after_train(1, [{"replied": False, "error": "no reply"}], first=True)
    assert never.never_contributed(1) is None


def test_a_diverging_run_fails_and_keeps_the_last_good_checkpoint(tmp_path):
    # The app's default factor (the in-process harness turns the ratio check off).
    factor = {"run.divergence-factor": 1000.0}
    path, grid, raised = _run(tmp_path, **{"num-server-rounds": 6, "vision.lr": 1e4, **factor})
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert "the global model diverged" in outcome["reason"]
    last = outcome["last-round"]
    assert last < 6 and _train_rounds(grid) == list(range(1, last + 2))
    state = json.loads((path / "checkpoint" / "state.json").read_text())
    assert state["round"] == last  # the diverged round's model was not kept
    kept = torch.load(path / "checkpoint" / "global.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in kept.values())
    assert not (path / "model.pt").exists()
    # The analysis commands draw what they can, then exit non-zero on a failed run.
    assert figures.main([str(path), "--out", str(tmp_path / "figures")]) == 1
    with pytest.raises(SystemExit, match=r"study: 1 run\(s\) failed"):
        exit_on_failed("study", [path, tmp_path / "not-a-run"])


@pytest.mark.parametrize(
    ("nodes", "overrides", "reason"),
    [
        # 1 437 digits examples in the client pool (central test 20 %): 1 438 nodes would
        # leave one client without data. Before, such a run went on with every data-less
        # client failing each round (86 % of them at N = 10 000).
        (
            1438,
            {"vision.partitioner": "array-split"},
            "start-up check: 'vision.partitioner': partitioner 'array-split' cannot split 1437 "
            "digits examples into 1438 partitions: 1 clients would hold no data",
        ),
        # 2 000 synthetic rows, 20 % central test: 1 600 pool rows for 161 clients are 9
        # each under iid, below the 10 a client needs. Before, every client raised this
        # ConfigError in its first round, and the run failed only after the streak.
        (
            161,
            {"task": "finance", "finance.synthetic-rows": 2000, "finance.partitioning": "iid"},
            "start-up check: 'finance.partitioning' = 'iid' leaves partition 0 only 9 rows "
            "(minimum 10) when 1600 pool rows are split among 161 partitions",
        ),
    ],
    ids=["digits-more-clients-than-examples", "finance-too-few-rows-a-client"],
)
def test_a_split_that_leaves_a_client_without_data_fails_at_start_up_naming_the_key(
    tmp_path, nodes, overrides, reason
):
    path, grid, raised = _run(tmp_path, nodes=list(range(1, nodes + 1)), **overrides)
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert outcome["reason"].startswith(reason)
    assert _train_rounds(grid) == []  # no training message was sent


def test_budget_exhaustion_is_stopped(tmp_path):
    path, grid, raised = _run(
        tmp_path,
        privacy="dp-fedavg-fixed",
        **{"num-server-rounds": 5, "dp.num-sampled-clients": 4, "dp.sampling": "fixed",
           "dp.noise-multiplier": 3.0, "dp.clip-norm": 0.1, "dp.max-epsilon": 6.0},
    )  # fmt: skip
    outcome = _outcome(path)
    assert raised is None and outcome["status"] == "stopped"
    assert outcome["reason"].startswith("round 4 would exceed 'dp.max-epsilon' = 6.0")
    assert outcome["last-round"] == 3 and _train_rounds(grid) == [1, 2, 3]
    assert (path / "model.pt").is_file()


def test_a_dp_cohort_larger_than_the_federation_fails_at_start_up_naming_the_key(tmp_path):
    path, grid, raised = _run(
        tmp_path,
        privacy="dp-fedavg-fixed",
        **{"dp.num-sampled-clients": 5, "round-timeout": 0.5},
    )
    outcome = _outcome(path)
    assert isinstance(raised, RunFailed) and outcome["status"] == "failed"
    assert outcome["reason"] == (
        "start-up check: 'dp.num-sampled-clients' = 5 needs at least 5 nodes, but connected "
        "within 'round-timeout' = 0.5 s: 4. Start more SuperNodes (simulation: "
        '--federation-config "num-supernodes=<n> client-resources-num-cpus=1") or lower the key'
    )
    assert grid.sent == []  # not even a partition query


def test_nodes_that_disagree_on_num_partitions_fail_at_start_up(tmp_path):
    config = run_config(**{"output-dir": str(tmp_path)})
    grid = InProcessGrid(config, NODES)
    grid.contexts[44].node_config["num-partitions"] = 5
    with pytest.raises(RunFailed, match=r"disagree on num-partitions \(3 nodes say 4, 1 nodes"):
        run_server(config, grid)
    (path,) = list(tmp_path.iterdir())
    assert _outcome(path)["status"] == "failed"


# -- the policy on its own -------------------------------------------------------------


def _row(error: str = "", replied: bool = False) -> dict:
    return {"replied": replied, "error": error}


def test_grouped_reasons_count_each_message_most_frequent_first():
    rows = [_row("boom"), _row("no reply"), _row("boom"), _row(replied=True)]
    assert grouped_reasons(rows) == "2 of 4 clients: boom; 1 of 4 clients: no reply"


def test_a_round_with_one_contribution_resets_the_streak():
    watch = FailureWatch(max_failed_rounds=2)
    failed = [_row("a"), _row("b")]
    assert watch.after_train(1, failed, first=False) is None
    assert watch.after_train(2, [_row("a"), _row(replied=True)], first=False) is None
    assert watch.after_train(3, failed, first=False) is None
    assert "2 consecutive rounds" in watch.after_train(4, failed, first=False)
    # Rejected replies (replied, but unusable) do not contribute.
    rejected = [_row("rejected: array 'w' contains NaN or Inf", replied=True)]
    assert FailureWatch(max_failed_rounds=1).after_train(1, rejected, first=False)
    # Timeouts alone are not "every client failed the same way" in round 1.
    assert FailureWatch().after_train(1, [_row("no reply")] * 3, first=True) is None


def test_divergence_is_measured_against_the_first_value_and_non_finite_always_stops():
    watch = FailureWatch(divergence_factor=10.0)
    assert watch.diverged(0, {"central-eval": {"eval-loss": 2.0}}) is None
    assert watch.diverged(1, {"central-eval": {"eval-loss": 19.9}}) is None
    assert "'eval-loss' = 20.1 > 'run.divergence-factor' = 10 x its first value 2" in (
        watch.diverged(2, {"central-eval": {"eval-loss": 20.1}})
    )
    assert "'eval-reward' = nan" in watch.diverged(
        3, {"central-eval": {"eval-reward": float("nan")}}
    )
    # Under DP only the central evaluation of the released model is read.
    private = FailureWatch(private=True)
    assert private.diverged(1, {"federated-eval": {"eval-loss": float("inf")}}) is None
    assert FailureWatch().diverged(1, {"federated-eval": {"eval-loss": float("inf")}})


def test_outcome_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="'done' is not one of"):
        Outcome("done")


def test_under_dp_failed_rounds_are_charged_and_never_stop_the_run(tmp_path, monkeypatch):
    # Whether clients failed can depend on their data, and no epsilon covers it: under
    # DP a failed client is a zero update of a charged round, and the run goes on
    # (tests/server_app/test_dp_failures.py has the NaN-loss client).
    def broken(self, model, partition, local):
        raise RuntimeError("the data file is corrupt")

    monkeypatch.setattr(tasks.get("digits"), "train", broken)
    path, grid, raised = _run(
        tmp_path,
        privacy="dp-fedavg-fixed",
        **{"dp.num-sampled-clients": 4, "dp.sampling": "fixed", "dp.noise-multiplier": 3.0,
           "dp.clip-norm": 0.1},
    )  # fmt: skip
    outcome = _outcome(path)
    assert raised is None and outcome["status"] == "completed"
    assert _train_rounds(grid) == [1, 2, 3]
    # The clients' error texts are kept with what no epsilon covers, not at the top level.
    assert "corrupt" not in json.dumps(outcome)
    assert not (path / "curator" / "outcome.json").exists()
    detail = pd.read_csv(path / "curator" / "participation.csv")
    assert (detail["error"] == "<class 'RuntimeError'>:<'the data file is corrupt'>").all()
    ledger = json.loads((path / "ledger.json").read_text())["state"]
    assert [r["server_round"] for r in ledger["releases"]] == [1, 2, 3]  # each round charged
    assert outcome["last-round"] == 3  # its (noise-only) models were released and kept
