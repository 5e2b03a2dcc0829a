"""Every result carries its privacy statement: a private and a non-private digits run
(made in this process), then the per-run plot, the comparison's table and figures, the
paper figures and the notebook, each read back from the files they write."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient
from PIL import Image

from lab import comparison, figures, study
from server_app import run_status
from tests.inprocess import run_like_flwr

REPO = Path(__file__).resolve().parents[2]
TINY = "num-server-rounds=2 fraction-train=1.0 vision.local-epochs=1 run.divergence-factor=0.0"
DP = "privacy='dp-fedavg-fixed' dp.noise-multiplier=0.5 dp.clip-norm=1.0 dp.sampling='fixed' "
DP += "dp.num-sampled-clients=4"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"dp": run dir, "plain": run dir} under one root."""
    root = tmp_path_factory.mktemp("eps-runs")
    made = {}
    for name, options in (("dp", DP), ("plain", "")):
        result = run_like_flwr(f"{TINY} {options} output-dir='{root}'")
        assert result.returncode == 0 and result.run_dir is not None, result.output
        made[name] = result.run_dir
    return made


def central_epsilon(run_dir: Path) -> tuple[float, float]:
    """(ε, δ) the ledger states against observers of the released model."""
    ledger = json.loads((run_dir / "ledger.json").read_text())
    entry = next(e for e in ledger["threat-models"] if e["threat-model"] == "trusted-server")
    return entry["epsilon"], entry["delta"]


def test_the_learning_curve_title_states_epsilon_delta_and_the_party(runs):
    epsilon, delta = central_epsilon(runs["dp"])
    assert epsilon > 0 and delta == 1e-5

    def title_of(run_dir: Path) -> str:  # the caption is wrapped to the figure's width
        return " ".join(Image.open(run_dir / "plots" / "learning_curve.png").text["Title"].split())

    title, plain = title_of(runs["dp"]), title_of(runs["plain"])

    # dp-fedavg-fixed with the server adding noise: nothing holds against the server, so
    # the shown ε is the ledger's, against observers of the released model.
    assert f"ε = {epsilon:.3g}, δ = 1e-05 (client-level)" in title
    assert "against observers of the released model (trusted server)" in title
    assert "NOT PRIVATE (privacy = none)" in plain and "ε =" not in plain


def test_the_comparison_table_and_legends_carry_epsilon(runs, tmp_path):
    epsilon, _ = central_epsilon(runs["dp"])
    grouped = {"dp": {0: runs["dp"]}, "plain": {0: runs["plain"]}}

    table = comparison.analyse(grouped, tmp_path, fmt="svg")

    csv = pd.read_csv(tmp_path / "results.csv").set_index("experiment")
    assert csv.loc["dp", "epsilon"] == pytest.approx(epsilon, rel=1e-12)
    assert csv.loc["dp", "delta"] == 1e-5
    assert csv.loc["dp", "holds-against"] == "trusted-server"
    assert math.isinf(csv.loc["plain", "epsilon"])
    assert list(csv["status"]) == ["1 completed", "1 completed"]
    markdown = (tmp_path / "results.md").read_text()
    assert f"| {epsilon:.3g} (δ = 1e-05) | trusted-server | 1 completed |" in markdown
    assert "| ∞ (no DP) | – | 1 completed |" in markdown
    assert list(table["experiment"]) == ["dp", "plain"]
    # vector output, the legend with each experiment's ε
    svg = (tmp_path / "accuracy_comparison.svg").read_text()
    assert f"dp (ε = {epsilon:.3g} (δ = 1e-05))" in svg
    assert "plain (ε = ∞ (no DP))" in svg
    assert not list(tmp_path.glob("*.png"))


def test_figures_leave_out_a_diverged_run_and_say_so(runs, tmp_path):
    # A second seed of the private configuration whose global model diverged.
    diverged = tmp_path / "runs" / "diverged"
    shutil.copytree(runs["dp"], diverged)
    config = json.loads((diverged / "config.json").read_text())
    config["run-config"]["seed"] = 7
    (diverged / "config.json").write_text(json.dumps(config))
    metrics = pd.read_csv(diverged / "metrics.csv")
    metrics.loc[metrics["scope"] == "central-eval", "eval-accuracy"] = 0.01
    metrics.to_csv(diverged / "metrics.csv", index=False)
    reason = "round 2: central-eval 'eval-loss' = inf: the global model diverged"
    (diverged / "outcome.json").write_text(json.dumps({"status": "failed", "reason": reason}))
    good = pd.read_csv(runs["dp"] / "metrics.csv")
    final = good[good["scope"] == "central-eval"]["eval-accuracy"].iloc[-1]

    summary = figures.build_figures(
        [runs["dp"], diverged, runs["plain"]], tmp_path / "out", echo=lambda _: None, fmt="pdf"
    )

    row = summary.set_index("privacy").loc["dp-fedavg-fixed"]
    assert row["n_failed"] == 1 and row["n_runs"] == 1
    assert row["utility_mean"] == pytest.approx(final)  # the diverged 0.01 left out
    assert row["status"] == "1 completed, 1 diverged"
    assert row["holds_against"] == "trusted-server"
    assert (tmp_path / "out" / "utility_vs_epsilon.pdf").is_file()
    # the non-DP configuration is labelled without the mechanism's keys
    labels = list(summary["configuration"])
    assert "none / fedavg" in labels, labels
    assert run_status.read(diverged).caption().endswith("· run DIVERGED")


def test_the_study_table_gets_the_privacy_columns(runs):
    table = pd.DataFrame({"experiment": ["dp", "plain", "dp"], "planet": ["a", "a", "b"]})

    out = study.with_privacy(table, {"dp": runs["dp"], "plain": runs["plain"]})

    epsilon, _ = central_epsilon(runs["dp"])
    assert list(out["epsilon"][[0, 2]]) == [epsilon, epsilon]
    assert math.isinf(out["epsilon"][1])
    assert list(out["holds-against"]) == ["trusted-server", "", "trusted-server"]
    assert list(out["status"]) == ["completed"] * 3


def test_the_notebook_compares_on_central_evaluation_so_private_runs_appear(runs, tmp_path):
    runs_dir = tmp_path / "all"
    runs_dir.mkdir()
    for run_dir in runs.values():
        (runs_dir / run_dir.name).symlink_to(run_dir)
    notebook = nbformat.read(REPO / "notebooks" / "analyze_runs.ipynb", as_version=4)
    os.environ["RUNS_DIR"] = str(runs_dir)
    try:
        NotebookClient(
            notebook,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(REPO / "notebooks")}},
        ).execute()
    finally:
        del os.environ["RUNS_DIR"]
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    epsilon, _ = central_epsilon(runs["dp"])

    assert "compared on central-eval" in text and "not shown" not in text
    assert "epsilon" in html and "holds-against" in html
    assert f"{epsilon:.4f}"[:5] in html  # the table's ε cell
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3  # comparison + 2 curves
