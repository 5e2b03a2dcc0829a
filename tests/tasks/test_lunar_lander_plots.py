"""Study plots and tables of the federated PPO task, on hand-made client logs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from server_app.results import RunDirectory
from tasks.lunar_lander import plots
from tasks.lunar_lander.logs import ClientRoundLog, load_episodes, load_snapshots

GRAVITY = {"moon": -1.6, "earth": -9.8, "mars": -3.73}
COMPARED = {"num-server-rounds": 2, "fraction-train": 0.5, "ppo.local-steps": 8192}


def client_logs(
    directory: Path, label: str, rewards: list[float], rounds: int = 2, snapshots: int = 2
) -> None:
    """``label``'s episodes (one per 100 env steps), split evenly over ``rounds``
    files, each file ending with ``snapshots`` weight snapshots after its episodes."""
    planet = label.split("-")[0]
    chunks = np.array_split(np.arange(len(rewards)), rounds)
    for server_round, chunk in enumerate(chunks, start=1):
        ends = [100 * (i + 1) for i in chunk]
        last = ends[-1] if ends else 0
        log = ClientRoundLog(label, planet, GRAVITY[planet], 0.5, 0, server_round, 1000)
        log.episode_rewards = [float(rewards[i]) for i in chunk]
        log.episode_lengths = [100] * len(chunk)
        log.episode_end_steps = ends
        log.weight_steps = [last + 10 * (s + 1) for s in range(snapshots)]
        rng = np.random.default_rng(len(rewards) + server_round)
        log.weights = [rng.normal(size=6).astype(np.float32) for _ in range(snapshots)]
        log.save(directory)


def make_run(
    root: Path,
    strategy: str,
    clients: dict[str, list[float]],
    central: list[dict[str, float]] | None = None,
    **config,
) -> Path:
    """A run directory as the ServerApp writes it, with ``clients``' logs."""
    run = RunDirectory.create(root, "lunar-lander", strategy, "none")
    run.write_config(
        {"task": "lunar-lander", "strategy": strategy, "privacy": "none", "seed": 42}
        | COMPARED
        | config
    )
    run.record(1, "train", {"train-reward": 0.0, "num-examples": 8192})
    for server_round, metrics in enumerate(central or []):
        run.record(server_round, "central-eval", metrics)
    for label, rewards in clients.items():
        client_logs(run.path / "clients", label, rewards)
    return run.path


FEDAVG_CLIENTS = {
    "moon-00": list(range(1, 151)),  # last 100: 51..150, mean 100.5
    "moon-01": [10.0] * 50,
    "earth-00": [-5.0] * 20,
    "mars-00": [30.0] * 120,
}
SINGLE_CLIENTS = {"moon-00": [50.0] * 30, "earth-00": [0.0] * 30, "mars-00": [30.0] * 30}
CENTRAL = [
    {"eval-reward-moon": -100.0, "eval-reward-earth": -90.0, "eval-reward-mars": -80.0},
    {
        "eval-reward-moon": 42.0,
        "eval-reward-earth": 7.0,
        "eval-reward-mars": -1.0,
        "eval-reward-std-moon": 3.0,
    },
]


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    return {
        "fedavg": make_run(tmp_path, "fedavg", FEDAVG_CLIENTS, CENTRAL),
        "single": make_run(tmp_path, "local", SINGLE_CLIENTS),
    }


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_rolling_rewards_average_the_last_100_episodes_of_each_client(runs):
    episodes = load_episodes(runs["fedavg"] / "clients")

    frame = plots.rolling_rewards(episodes)

    moon = frame[frame["label"] == "moon-00"]["rolling_reward"].to_numpy()
    assert np.isnan(moon[: plots.MIN_EPISODES - 1]).all()
    assert moon[9] == pytest.approx(5.5)  # mean of 1..10
    assert moon[99] == pytest.approx(50.5)  # mean of 1..100
    assert moon[149] == pytest.approx(100.5)  # mean of 51..150
    assert (frame[frame["label"] == "moon-01"]["rolling_reward"].dropna() == 10.0).all()


def test_results_table_holds_hand_computed_final_rewards_and_steps(runs):
    table = plots.results_table(runs).set_index(["experiment", "planet"])

    moon = table.loc[("fedavg", "moon")]
    assert moon["clients"] == 2
    assert moon["train-reward"] == pytest.approx((100.5 + 10.0) / 2)
    assert moon["train-reward-std"] == pytest.approx(np.std([100.5, 10.0], ddof=1))
    assert moon["eval-reward"] == 42.0 and moon["eval-reward-std"] == 3.0
    # Last recorded step: the round's last snapshot, 20 steps after the last episode.
    assert moon["planet-env-steps"] == (15000 + 20) + (5000 + 20)
    assert table.loc[("fedavg", "earth"), "train-reward"] == -5.0
    assert np.isnan(table.loc[("fedavg", "earth"), "train-reward-std"])  # one client
    assert table.loc[("fedavg", "mars"), "eval-reward"] == -1.0
    assert np.isnan(table.loc[("fedavg", "mars"), "eval-reward-std"])
    assert (table.loc["fedavg", "run-env-steps"] == 15020 + 5020 + 2020 + 12020).all()
    single = table.loc["single"]
    assert single["eval-reward"].isna().all()  # strategy=local: no global model
    assert single.loc["moon", "train-reward"] == 50.0
    assert list(table.loc["fedavg"].index) == ["moon", "earth", "mars"]


def test_federated_runs_are_compared_with_the_single_agent(runs):
    table = plots.results_table(runs)
    configs = {name: plots.load_run_config(path) for name, path in runs.items()}

    comparison = plots.compare_to_single_agent(table, configs).set_index("planet")

    assert (comparison["experiment"] == "fedavg").all()
    assert comparison.loc["moon", "beats-single-agent"]  # 55.25 > 50
    assert comparison.loc["moon", "difference"] == pytest.approx(5.25)
    assert not comparison.loc["earth", "beats-single-agent"]  # -5 < 0
    assert not comparison.loc["mars", "beats-single-agent"]  # a tie does not beat
    assert comparison["comparable"].all()


def test_runs_with_other_step_budgets_are_flagged(tmp_path, runs):
    runs["short"] = make_run(tmp_path, "fedavg", FEDAVG_CLIENTS, **{"ppo.local-steps": 64})
    table = plots.results_table(runs)
    configs = {name: plots.load_run_config(path) for name, path in runs.items()}

    with pytest.warns(UserWarning, match="'short' and the Single Agent run 'single' differ"):
        comparison = plots.compare_to_single_agent(table, configs)

    short = comparison[comparison["experiment"] == "short"]
    assert not short["comparable"].any()
    assert (short["differs-in"] == "ppo.local-steps: 64 vs 8192").all()
    assert comparison[comparison["experiment"] == "fedavg"]["comparable"].all()


def test_the_single_agent_baseline_must_be_unique(tmp_path, runs):
    configs = {name: plots.load_run_config(path) for name, path in runs.items()}
    assert plots.single_agent_baseline(configs) == "single"
    with pytest.raises(ValueError, match="found 0"):
        plots.single_agent_baseline({"fedavg": configs["fedavg"]})
    with pytest.raises(ValueError, match="found 2"):
        plots.single_agent_baseline({**configs, "single-2": configs["single"]})


def test_learning_curves_draw_one_line_per_client_and_a_legend_per_planet(runs):
    episodes = load_episodes(runs["fedavg"] / "clients")

    figure = plots.learning_curves(episodes, "fedavg")

    (ax,) = figure.axes
    assert len(ax.get_lines()) == len(FEDAVG_CLIENTS)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["moon (2 clients)", "earth (1 client)", "mars (1 client)"]
    colours = {line.get_color() for line in ax.get_lines()}
    assert colours == {plots.PLANET_COLOURS[p] for p in ("moon", "earth", "mars")}


def test_planet_curves_average_clients_where_they_have_data():
    # Two moon clients with constant rewards: 10 over epochs 0.1..2, 20 over 1..3.
    rows = [("moon-00", 10.0, e) for e in np.linspace(0.1, 2, 20)]
    rows += [("moon-01", 20.0, e) for e in np.linspace(1, 3, 20)]
    episodes = pd.DataFrame(rows, columns=["label", "reward", "local_epoch"])
    episodes["planet"], episodes["end_step"] = "moon", episodes["local_epoch"] * 1000

    curve = plots.planet_curves(episodes, np.array([0.0, 1.0, 2.0, 3.0, 4.0]))

    # The first 9 episodes of a client have no rolling mean: moon-00 starts at 1.0.
    assert list(curve["clients"]) == [0, 1, 2, 1, 0]
    np.testing.assert_allclose(curve["reward"], [np.nan, 10.0, 15.0, 20.0, np.nan])


def test_comparison_plots_draw_every_experiment_and_planet(runs):
    experiments = {name: load_episodes(path / "clients") for name, path in runs.items()}

    combined = plots.comparison_combined(experiments)
    side = plots.comparison_side_by_side(experiments)

    (ax,) = combined.axes
    assert len(ax.get_lines()) == 2 * 3  # experiments x planets
    assert {line.get_linestyle() for line in ax.get_lines()} == {":", "-", "--"}
    panels = [a for a in side.axes if a.get_title()]
    assert [a.get_title() for a in panels] == ["moon", "earth", "mars"]
    assert all(len(a.get_lines()) == 2 for a in panels)
    assert [t.get_text() for t in side.legends[0].get_texts()] == ["fedavg", "single"]


# UMAP's numba compile (~7 s of CPU) is paid once per process: the tests that fit a
# UMAP share one xdist worker (group "umap", tests/lab/test_study.py too).
@pytest.mark.parametrize(
    "method", ["tsne", pytest.param("umap", marks=pytest.mark.xdist_group("umap"))]
)
def test_weight_embedding_marks_planets_and_colours_time(runs, method):
    snapshots, weights = load_snapshots(runs["single"] / "clients")
    few = snapshots.index[:3]  # 3 snapshots suffice: perplexity / neighbours adapt

    for frame, matrix in ((snapshots, weights), (snapshots.loc[few], weights[few])):
        figure = plots.weight_embedding(frame, matrix, method=method, title="w")

        ax, colorbar = figure.axes
        assert len(ax.collections) == frame["planet"].nunique()  # one marker per planet
        offsets = np.vstack([c.get_offsets() for c in ax.collections])
        assert offsets.shape == (len(frame), 2) and np.isfinite(offsets).all()
        assert "env steps" in colorbar.get_ylabel()


def test_umap_is_handed_the_exact_neighbours_it_would_compute_itself():
    from sklearn.metrics import pairwise_distances
    from umap.distances import euclidean
    from umap.utils import fast_knn_indices

    weights = np.random.default_rng(3).normal(size=(20, 6)).astype(np.float32)
    weights[10:13] = weights[2]  # repeated snapshots: ties at distance 0

    indices, distances = plots._umap_exact_knn(weights, 15)

    all_pairs = pairwise_distances(weights, metric=euclidean)
    # UMAP's own sort, not compiled (CI runs numba with its JIT off: a plain function).
    expected = getattr(fast_knn_indices, "py_func", fast_knn_indices)(all_pairs, 15)
    np.testing.assert_array_equal(indices, expected)
    assert indices.dtype == expected.dtype == np.int32
    np.testing.assert_array_equal(distances, np.take_along_axis(all_pairs, expected, axis=1))
    for row in (2, 10, 12):  # itself and its copies first, ties broken by index
        assert list(indices[row, :4]) == [2, 10, 11, 12]
        assert distances[row, :4].tolist() == [0.0] * 4


def test_weight_embedding_refuses_too_few_snapshots(runs):
    snapshots, weights = load_snapshots(runs["single"] / "clients")
    with pytest.raises(ValueError, match="at least 3 weight snapshots, got 2"):
        plots.weight_embedding(snapshots.iloc[:2], weights[:2])
    with pytest.raises(ValueError, match="not one of"):
        plots.weight_embedding(snapshots, weights, method="pca")


def test_markdown_table_formats_numbers_nan_and_booleans():
    frame = pd.DataFrame(
        {"name": ["a|b", "c"], "n": [3, 12], "x": [1.234, np.nan], "ok": [True, False]}
    )

    text = plots.to_markdown(frame)

    assert text.splitlines() == [
        "| name | n | x | ok |",
        "| --- | ---: | ---: | --- |",
        "| a\\|b | 3 | 1.2 | yes |",
        "| c | 12 | – | no |",
    ]
