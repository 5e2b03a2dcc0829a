"""Experiment tracking of real runs: MLflow against a local file store in a temporary
directory, W&B's offline run read back with its own reader (`wandb leet inspect`),
TensorBoard hparams read back from the event files; under DP only what the run
directory publishes reaches a tracker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from server_app.tracking import published
from tests.inprocess import run_like_flwr

# One worker makes the module's runs once (a module-scoped fixture per worker otherwise).
pytestmark = pytest.mark.xdist_group("tracking")

TINY = "num-server-rounds=2 fraction-train=1.0 vision.local-epochs=1 run.divergence-factor=0.0"
DP = "privacy='dp-fedavg-fixed' dp.noise-multiplier=1.0 dp.sampling='fixed' "
DP += "dp.num-sampled-clients=4"


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A private run logged to MLflow, and a plain run with tracking off."""
    root = tmp_path_factory.mktemp("tracked")
    uri = (root / "store").as_uri()
    with pytest.MonkeyPatch.context() as env:
        env.delenv("WANDB_MODE", raising=False)  # the app must choose offline itself
        private = run_like_flwr(
            f"{TINY} {DP} output-dir='{root / 'runs'}' tracking.mlflow=true "
            f"tracking.mlflow-uri='{uri}' tracking.mlflow-experiment='digits-dp' "
            "tracking.wandb=true tracking.wandb-project='digits-dp'"
        )
    assert private.returncode == 0 and private.run_dir is not None, private.output
    plain = run_like_flwr(f"{TINY} output-dir='{root / 'plain'}'")
    assert plain.returncode == 0, plain.output
    return private, plain, uri, root


def the_run(uri: str):
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("digits-dp")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def test_mlflow_gets_params_per_round_metrics_and_the_ledgers_epsilon(tracked):
    private, _, uri, _ = tracked
    client, run = the_run(uri)
    metrics = pd.read_csv(private.run_dir / "metrics.csv")
    ledger = json.loads((private.run_dir / "ledger.json").read_text())

    assert run.info.run_name == private.run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["privacy"] == "dp-fedavg-fixed"
    assert run.data.params["num-server-rounds"] == "2"
    assert run.data.tags["lab.epsilon-holds-against"] == "trusted-server"
    history = client.get_metric_history(run.info.run_id, "central-eval/eval-accuracy")
    central = metrics[metrics["scope"] == "central-eval"]
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx(list(central["eval-accuracy"]))
    assert run.data.metrics["privacy/epsilon"] == pytest.approx(ledger["summary"]["epsilon"])
    assert run.data.metrics["privacy/delta"] == 1e-5
    assert "MLflow: run" in private.output


def test_under_dp_only_published_files_and_columns_reach_mlflow(tracked):
    private, _, uri, _ = tracked
    client, run = the_run(uri)
    store = client.download_artifacts(run.info.run_id, "")
    files = {os.path.relpath(os.path.join(d, f), store) for d, _, fs in os.walk(store) for f in fs}
    curator = pd.read_csv(private.run_dir / "curator" / "metrics.csv")
    published_columns = set(pd.read_csv(private.run_dir / "metrics.csv").columns)

    assert {"config.json", "metrics.csv", "ledger.json", "model.pt"} <= files
    assert "plots/learning_curve.png" in files and "checkpoint/global.pt" in files
    assert not any(f.startswith(("curator", "clients")) for f in files)
    assert "checkpoint/server.pt" not in files
    # outcome.json is published: under DP no stop reads client outcomes
    assert ("outcome.json" in files) == ("outcome.json" in ledger_covered(private.run_dir))
    # no metric of curator/metrics.csv: federated evaluation, client reports, timing
    logged = {key.split("/", 1)[1] for key in run.data.metrics if "/" in key}
    assert "federated-eval" not in {key.split("/")[0] for key in run.data.metrics}
    only_curator = set(curator.columns) - published_columns - {"round", "scope"}
    assert only_curator and not (logged & only_curator)


def wandb_records(root: Path) -> list[dict]:
    """The records of the one offline W&B run under ``root/wandb``, as W&B reads them."""
    (log,) = (root / "wandb").glob("offline-run-*/run-*.wandb")
    cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(cli), "leet", "inspect", "--json", str(log)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_wandb_offline_run_holds_params_per_round_metrics_epsilon_and_files(tracked):
    private, _, _, root = tracked
    records = wandb_records(root / "runs")
    metrics = pd.read_csv(private.run_dir / "metrics.csv")
    central = metrics[metrics["scope"] == "central-eval"]
    ledger = json.loads((private.run_dir / "ledger.json").read_text())
    by_type: dict[str, list[dict]] = {}
    for record in records:
        by_type.setdefault(record["type"], []).append(record[record["type"]])

    (run,) = by_type["run"]
    assert run["telemetry"]["feature"]["offline"] is True
    assert run["project"] == "digits-dp" and run["display_name"] == private.run_dir.name
    assert run["config"]["update"]["privacy"] == "dp-fedavg-fixed"
    assert run["config"]["update"]["num-server-rounds"] == 2
    assert "epsilon-holds-against=trusted-server" in run["tags"]
    history = {h["step"].get("num", 0): h["item"] for h in by_type["history"]}
    assert sorted(history) == [0, 1, 2]
    accuracy = [history[step]["central-eval/eval-accuracy"] for step in (0, 1, 2)]
    assert accuracy == pytest.approx(list(central["eval-accuracy"]))
    summary = {}
    for update in by_type["summary"]:
        summary.update(update.get("update", {}))
    assert summary["privacy/epsilon"] == pytest.approx(ledger["summary"]["epsilon"])
    assert summary["privacy/delta"] == 1e-5
    (artifact,) = by_type["artifact"]
    files = {entry["path"] for entry in artifact["manifest"]["contents"]}
    assert artifact["type"] == "run-directory"
    assert {"config.json", "metrics.csv", "ledger.json", "model.pt"} <= files
    assert not any(f.startswith(("curator", "clients")) for f in files)
    assert "checkpoint/server.pt" not in files
    # no metric of curator/metrics.csv: no federated evaluation reaches W&B either
    assert not any(k.startswith("federated-eval/") for item in history.values() for k in item)
    assert by_type["exit"][0]["exit_code"] == 0
    assert "W&B: run logged to" in private.output


def test_tensorboard_hparams_hold_the_run_config_and_final_metrics(tracked):
    private, _, _, _ = tracked
    events = EventAccumulator(str(private.run_dir / "tensorboard"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    metrics = pd.read_csv(private.run_dir / "metrics.csv")
    final = metrics[metrics["scope"] == "central-eval"]["eval-accuracy"].iloc[-1]

    assert hparams["privacy"].string_value == "dp-fedavg-fixed"
    assert hparams["num-server-rounds"].number_value == 2
    scalar = events.Scalars("final/central-eval/eval-accuracy")
    assert [s.step for s in scalar] == [2] and scalar[0].value == pytest.approx(final)
    assert "privacy/epsilon" in events.Tags()["scalars"]


def test_mlflow_and_wandb_are_off_by_default(tracked):
    _, plain, _, root = tracked
    assert "MLflow" not in plain.output
    assert not (root / "plain" / "mlruns").exists()
    assert "W&B" not in plain.output and not (root / "plain" / "wandb").exists()
    assert (plain.run_dir / "tensorboard").is_dir()


@pytest.mark.parametrize(
    ("name", "covered", "expected"),
    [
        ("metrics.csv", None, True),
        ("outcome.json", None, True),
        ("curator/metrics.csv", None, False),
        ("checkpoint/server.pt", None, False),
        ("clients/state/partition-0/round-1.bin", None, False),
        ("checkpoint/cluster-0.pt", ["checkpoint/<model>.pt"], True),
        ("plots/ledger.png", ["plots/"], True),
        ("outcome.json", ["metrics.csv", "plots/"], False),
        ("curator/metrics.csv", ["curator/"], False),  # never, whatever a list says
    ],
)
def test_what_is_published(name, covered, expected):
    assert published(name, covered) is expected


def ledger_covered(run_dir) -> list[str]:
    ledger = json.loads((run_dir / "ledger.json").read_text())
    return ledger["run-directory"]["covered-by-epsilon"]
