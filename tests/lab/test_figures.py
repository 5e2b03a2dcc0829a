"""The figures command on small run directories written with the app's own writers:
mean ± std over seeds by hand, ε from real ledgers, the stacked ledger checked against
round-by-round ledgers and dp-accounting, clear errors. No Flower run."""

from __future__ import annotations

import math

import dp_accounting
import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest

from lab import figures
from lab import figures_plots as fplots
from privacy.accounting import PrivacyLedger, Release
from server_app.results import RunDirectory

DELTA = 1e-5
Q, POPULATION = 0.1, 100
Z_UPDATE, Z_COUNT = 2.0, 1.5  # noise multipliers of the two release kinds
ROUNDS = 4
# Final central-eval numbers per (privacy, seed): accuracy, (low, high) group accuracy.
FINAL = {
    ("dp-fedavg-fixed", 0): (0.80, (0.70, 0.90)),
    ("dp-fedavg-fixed", 1): (0.84, (0.80, 0.88)),
    ("dp-fedavg-fixed", 2): (0.88, (0.84, 0.92)),
    ("subspace-dp", 0): (0.90, (0.85, 0.95)),
    ("subspace-dp", 1): (0.86, (0.81, 0.91)),
    ("none", 0): (0.95, (0.93, 0.97)),
    ("none", 1): (0.93, (0.90, 0.96)),
}
SPI = {0: [1.0, 2.0, 4.0], 1: [1.0, 2.2, 4.4]}  # subspace-dp seeds, at k = 1, 2, 4


def release(server_round: int, kind: str, z: float) -> Release:
    return Release(
        server_round=server_round,
        kind=kind,
        mechanism="gaussian",
        noise_multiplier=z,
        sampling="poisson",
        sample_size=int(Q * POPULATION),
        population=POPULATION,
    )


def new_ledger() -> PrivacyLedger:
    return PrivacyLedger(accountant="rdp", target_delta=DELTA, sampling="poisson")


def charged_ledger(rounds: int = ROUNDS) -> tuple[PrivacyLedger, list[float]]:
    """A model update every round and a clip count every other round; ε after each round."""
    ledger, epsilons = new_ledger(), []
    for rnd in range(1, rounds + 1):
        batch = [release(rnd, "model-update", Z_UPDATE)]
        if rnd % 2 == 1:
            batch.append(release(rnd, "clip-count", Z_COUNT))
        ledger.charge(batch)
        epsilons.append(ledger.epsilon())
    return ledger, epsilons


def make_run(root, privacy: str, seed: int) -> tuple:
    """A run directory: config.json and ledger.json by the app's writers, metrics.csv
    with central-eval group columns (the final accuracy of seed 1 sits one round early:
    the last row does not report it), certificates.json for subspace-dp."""
    run = RunDirectory.create(root, "digits", "fedavg", privacy)
    config = {"task": "digits", "strategy": "fedavg", "privacy": privacy, "seed": seed}
    config |= {"output-dir": str(root), "subspace.tau": 1.0 if privacy == "subspace-dp" else 0.8}
    run.write_config(config)
    accuracy, (low, high) = FINAL[privacy, seed]
    rows = [{"round": 0, "scope": "central-eval", "eval-accuracy": 0.1, "eval-loss": 2.0}]
    for rnd in range(1, ROUNDS + 1):
        last = rnd == ROUNDS
        value = accuracy if last or (seed == 1 and rnd == ROUNDS - 1) else 0.5
        row = {"round": rnd, "scope": "central-eval", "eval-loss": 1.0 / rnd}
        if not (seed == 1 and last):
            row |= {"eval-accuracy": value}
        if last:
            row |= {"eval-accuracy-low": low, "eval-accuracy-high": high}
            row |= {"num-examples-low": 40, "num-examples-high": 60, "fairness-gap": high - low}
        rows += [{"round": rnd, "scope": "train", "train-loss": 1.0}, row]
    run.write_rows("metrics.csv", rows)
    ledger = None
    if privacy != "none":
        ledger, _ = charged_ledger()
        run.write_ledger(ledger)
    if privacy == "subspace-dp":
        spi = {"k": [1, 2, 4], "value": SPI[seed]}
        mia = [{"fpr": 0.01, "tpr-bound": 0.05}]
        run.write_json("certificates.json", {"gdp-mu": 0.5 + seed, "mia": mia, "spi": spi})
    return run.path, ledger


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    ledgers = {key: make_run(root / key[0], *key)[1] for key in FINAL}
    out = tmp_path_factory.mktemp("figures")
    lines: list[str] = []
    table = figures.build_figures([root], out, echo=lines.append)
    return root, out, table.set_index("privacy"), ledgers, lines


def is_image(path) -> bool:
    image = mpimg.imread(path)
    return image.ndim == 3 and min(image.shape[:2]) > 200


def test_every_figure_and_the_table_are_written(results):
    _, out, _, _, lines = results

    names = ("utility_vs_epsilon.png", "fairness.png", "ledger.png", "spi.png")

    for name in names:
        assert is_image(out / name), name
    assert lines == [f"wrote {out / n}" for n in names] + [
        f"wrote {out / 'figures.csv'} (3 configurations, 7 runs)"
    ]
    assert len(pd.read_csv(out / "figures.csv")) == 3


def test_utility_is_mean_and_std_over_seeds(results):
    _, out, table, _, _ = results

    csv = pd.read_csv(out / "figures.csv").set_index("privacy")

    # dp-fedavg-fixed 0.80, 0.84 (a round early: the last row lacks it), 0.88.
    assert csv.loc["dp-fedavg-fixed", "utility_mean"] == pytest.approx(0.84)
    assert csv.loc["dp-fedavg-fixed", "utility_std"] == pytest.approx(0.04)
    # subspace-dp 0.90, 0.86: std |0.04| / sqrt 2; none 0.95, 0.93.
    assert csv.loc["subspace-dp", "utility_mean"] == pytest.approx(0.88)
    assert csv.loc["subspace-dp", "utility_std"] == pytest.approx(0.04 / math.sqrt(2))
    assert csv.loc["none", "utility_mean"] == pytest.approx(0.94)
    assert list(csv.loc[["dp-fedavg-fixed", "subspace-dp", "none"], "n_seeds"]) == [3, 2, 2]
    assert (csv["metric"] == "eval-accuracy").all()
    assert table.loc["none", "utility_std"] == pytest.approx(csv.loc["none", "utility_std"])


def test_epsilon_is_the_ledgers_and_no_dp_is_infinite(results):
    _, out, _, ledgers, _ = results

    csv = pd.read_csv(out / "figures.csv").set_index("privacy")

    expected = ledgers["dp-fedavg-fixed", 0].epsilon()
    assert expected > 0
    assert csv.loc["dp-fedavg-fixed", "epsilon"] == pytest.approx(expected, rel=1e-12)
    assert csv.loc["subspace-dp", "epsilon"] == pytest.approx(expected, rel=1e-12)
    assert csv.loc["dp-fedavg-fixed", "epsilon_std"] == pytest.approx(0.0, abs=1e-12)
    assert csv.loc["dp-fedavg-fixed", "delta"] == DELTA
    assert math.isinf(csv.loc["none", "epsilon"])


def test_fairness_gap_group_accuracy_and_gdp_mu(results):
    _, _, table, _, _ = results

    fixed, sdp = table.loc["dp-fedavg-fixed"], table.loc["subspace-dp"]

    # Gaps 0.20, 0.08, 0.08: mean 0.12, var (0.08² + 2·0.04²) / 2 = 0.0048.
    assert fixed["fairness_gap_mean"] == pytest.approx(0.12)
    assert fixed["fairness_gap_std"] == pytest.approx(math.sqrt(0.0048))
    assert fixed["eval-accuracy-low_mean"] == pytest.approx((0.70 + 0.80 + 0.84) / 3)
    assert sdp["eval-accuracy-high_std"] == pytest.approx(0.04 / math.sqrt(2))
    assert sdp["gdp_mu"] == pytest.approx(1.0)  # 0.5 and 1.5
    assert math.isnan(fixed["gdp_mu"])


def test_labels_name_only_keys_that_differ_and_are_not_default(results):
    _, _, table, _, _ = results

    labels = figures.configuration_labels(
        [
            {"privacy": "none", "strategy": "fedavg", "seed": 0, "dp.clip-norm": 1.0},
            {"privacy": "dp-fedavg-fixed", "strategy": "fedavg", "seed": 1, "dp.clip-norm": 0.1},
        ],
        defaults={"dp.clip-norm": 1.0},
    )

    assert labels == ["none / fedavg", "dp-fedavg-fixed / fedavg: dp.clip-norm=0.1"]
    assert table.loc["subspace-dp", "configuration"] == "subspace-dp / fedavg: subspace.tau=1"


def test_stacked_ledger_top_is_the_ledgers_epsilon_at_every_round():
    ledger, epsilons = charged_ledger(rounds=7)

    stack = figures.stack_ledger(ledger.state_dict())

    assert list(stack.rounds) == list(range(1, 8))
    assert stack.kinds == ("model-update", "clip-count")  # 7 releases before 4
    np.testing.assert_allclose(stack.cumulative[-1], epsilons, rtol=1e-12)
    assert stack.epsilon == pytest.approx(ledger.epsilon(), rel=1e-12)
    assert (stack.bands >= 0).all() and (stack.bands[1] > 0).all()
    np.testing.assert_allclose(stack.bands.sum(axis=0), epsilons, rtol=1e-12)


def test_stack_bottom_band_matches_dp_accounting_alone():
    ledger, _ = charged_ledger(rounds=5)

    stack = figures.stack_ledger(ledger.state_dict())

    # Bottom band at round 5: five Poisson-sampled Gaussian releases, nothing else.
    accountant = dp_accounting.rdp.RdpAccountant(list(ledger.config.rdp_orders))
    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(Z_UPDATE))
    accountant.compose(event, 5)
    assert stack.bands[0, -1] == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)


def test_long_ledgers_are_evaluated_at_most_fifty_rounds():
    ledger = new_ledger()
    ledger.charge([release(rnd, "model-update", 5.0) for rnd in range(1, 121)])

    stack = figures.stack_ledger(ledger.state_dict(), max_points=50)

    assert len(stack.rounds) <= 50 and stack.rounds[0] == 1 and stack.rounds[-1] == 120
    assert np.all(np.diff(stack.rounds) > 0)
    assert stack.cumulative[-1, -1] == pytest.approx(ledger.epsilon(), rel=1e-12)
    with pytest.raises(ValueError, match="max_points must be an integer >= 2"):
        figures.evaluation_rounds(1, 10, max_points=1)


def test_runs_without_groups_ledgers_or_certificates_skip_those_figures(tmp_path, capsys):
    make_run(tmp_path / "runs", "none", 0)
    run = next((tmp_path / "runs").iterdir())
    frame = pd.read_csv(run / "metrics.csv")
    frame.drop(columns=[c for c in frame if c.startswith("eval-accuracy-")]).to_csv(
        run / "metrics.csv", index=False
    )

    status = figures.main([str(run), "--out", str(tmp_path / "out")])

    printed = capsys.readouterr().out
    assert status == 0
    assert "skipped fairness.png: no run reports eval-accuracy-<group>" in printed
    assert "skipped ledger.png: no run has a ledger.json" in printed
    assert "skipped spi.png: no run has a certificates.json" in printed
    assert is_image(tmp_path / "out" / "utility_vs_epsilon.png")


def test_a_path_without_runs_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty" / "nested").mkdir(parents=True)

    status = figures.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")])

    assert status == 2
    assert "holds no run directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds no run directory"):
        figures.build_figures([tmp_path / "empty"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unknown_metric_lists_the_valid_ones(results, tmp_path):
    root = results[0]

    with pytest.raises(figures.FiguresError, match=r"--metric 'eval-auc'.*'eval-accuracy'"):
        figures.build_figures([root], tmp_path, metric="eval-auc")
    table = figures.build_figures([root], tmp_path / "loss", metric="eval-loss", echo=print)
    assert table.set_index("privacy").loc["none", "utility_mean"] == pytest.approx(0.25)


def test_mixed_neighbouring_relations_are_said_on_the_figure():
    # Laplace runs are accounted under zero-out, fixed-size DP-FedAvg under replace-one:
    # one axis may show both, but not as if they were one quantity.
    rows = [
        ("laplace", 20.0, "zero-out", False),
        ("dp-fedavg-fixed", 8.0, "replace-one", False),
        ("debug", 8.0, "replace-one", True),
    ]
    summary = pd.DataFrame(
        [
            {"configuration": name, "n_runs": 1, "epsilon": eps, "epsilon_std": 0.0,
             "utility_mean": 0.5, "utility_std": 0.0, "delta": DELTA, "relation": relation,
             "noise_from_seed": seeded}
            for name, eps, relation, seeded in rows
        ]
    )  # fmt: skip
    assert fplots.relations(summary) == ["replace-one", "zero-out"]
    figure = fplots.plot_utility_vs_epsilon(summary, "eval-accuracy")
    left = figure.axes[0]
    assert "neighbouring relations differ (replace-one, zero-out)" in left.get_xlabel()
    labels = left.get_legend_handles_labels()[1] or [
        t.get_text() for legend in figure.legends for t in legend.get_texts()
    ]
    assert any("[replace-one]" in label for label in labels)
    assert any("noise from seed" in label for label in labels)
    one = fplots.plot_utility_vs_epsilon(summary.iloc[1:2], "eval-accuracy")
    assert one.axes[0].get_xlabel().endswith("neighbouring relation replace-one")
