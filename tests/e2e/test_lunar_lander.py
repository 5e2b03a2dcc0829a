"""`flwr run` of the federated PPO task (the PPO study) on 3 SuperNodes (one per planet):
clustered FedAvg, IFCA, FedAvg under the Laplace mechanism and FedAvg with the options of
the study that lands (kept Adam state, the gravity input, a server optimizer, seeded
evaluation with standard errors), each for 2 tiny rounds. Plain FedAvg has no run of its
own: the Laplace run is FedAvg with the clients' and the server's defaults, and every
check of a plain run is made on it.

The "lands" run (client state kept across rounds in Flower's Context, SB3 training in
Ray's worker processes) goes through `flwr run`, and the in-process engine makes it again:
the same seed gives the same metrics.csv outside the timing columns, bit for bit. The
others are made in process
(:func:`tests.inprocess.run_like_flwr`: the same ServerApp and ClientApp without the
Flower runtime), which keeps CI within its time."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import Context, RecordDict
from threadpoolctl import threadpool_limits

from client_app import state
from lab import engine
from server_app.results import TIMING_COLUMNS, load_metrics
from tasks.lunar_lander.logs import load_snapshots
from tests.inprocess import make_run

pytestmark = pytest.mark.e2e

PLANETS = ("moon", "earth", "mars")
# 3 clients (no derived ones), 2 of them per round, 256 env steps each, tiny PPO.
TINY = (
    "task='lunar-lander' num-server-rounds=2 fraction-train=0.67 fraction-evaluate=1.0 "
    "ppo.derived-per-base=0 ppo.local-steps=256 ppo.n-steps=64 ppo.n-envs=2 "
    "ppo.batch-size=64 ppo.n-epochs=1 ppo.check-freq=64"
)
VARIANTS = {
    "clustered": "strategy='clustered' cluster.k=2 cluster.assign='l2' ppo.eval-episodes=1",
    "ifca": "strategy='clustered' cluster.k=2 cluster.assign='loss' "
    "cluster.update='assignment' cluster.init='distinct' ppo.eval-episodes=1",
    # With the clients' own metrics (written to curator/), which DP runs do not collect
    # unless asked: the PPO mechanics are checked here, not the privacy.
    # Fixed-size cohorts (fraction-train): every round trains 2 clients, which the
    # assertions count; Poisson cohorts are random (tests/strategies covers them).
    "laplace": "strategy='fedavg' privacy='laplace' dp.sensitivity=15.0 dp.epsilon=30.0 "
    "dp.sampling='fixed' dp.client-metrics=true ppo.eval-episodes=1",
    "lands": "strategy='fedavg' ppo.keep-optimizer=true ppo.observe-gravity=true "
    "ppo.lr-schedule='linear' server.optimizer='momentum' "
    "server.lr=1.0 server.momentum=0.5 ppo.gamma=0.999 ppo.gae-lambda=0.98 "
    "ppo.ent-coef=0.01 ppo.reward-scale=0.01 ppo.target-kl=0.015 ppo.eval-episodes=3",
}
THROUGH_FLOWER = {"lands"}
FEDERATION = "num-supernodes=3 client-resources-num-cpus=1"


@pytest.fixture(scope="module")
def lunar_runs(flower, tmp_path_factory):
    root = tmp_path_factory.mktemp("lunar-runs")
    runs = {}
    for name, options in VARIANTS.items():
        result = make_run(
            flower,
            f"{TINY} {options} output-dir='{root}'",
            in_process=name not in THROUGH_FLOWER,
            federation_config=FEDERATION,
        )
        assert result.returncode == 0 and result.run_dir is not None, result.output
        runs[name] = result
    return runs


@pytest.mark.parametrize("name", list(VARIANTS))
def test_global_policy_evaluated_on_every_planet(lunar_runs, name):
    result = lunar_runs[name]
    metrics = load_metrics(result.run_dir)
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    assert list(central.index) == [0, 1, 2], result.output
    for planet in PLANETS:
        assert central[f"eval-reward-{planet}"].notna().all()
    train = metrics[metrics["scope"] == "train"].set_index("round")
    assert list(train.index) == [1, 2] and train["train-loss"].notna().all()
    assert "[round 2/2]" in result.output and "train-reward" in result.output


@pytest.mark.parametrize("name", list(VARIANTS))
def test_clients_write_episode_logs_into_the_run_directory(lunar_runs, name):
    run_dir = lunar_runs[name].run_dir
    # A privacy run keeps the clients' files with what no epsilon covers (curator/).
    clients = run_dir / ("curator/clients" if name == "laplace" else "clients")
    files = sorted(clients.glob("*.npz"))
    assert len(files) == 4  # 2 clients x 2 rounds
    frame, weights = load_snapshots(clients)
    assert len(frame) == 4 * (256 // 64 + 1) and weights.shape[0] == len(frame)  # + trained
    model = torch.load(run_dir / "model.pt")
    assert weights.shape[1] == sum(t.numel() for t in model.values())
    assert set(frame["planet"]) <= set(PLANETS)


def test_clustered_keeps_and_checkpoints_k_models(lunar_runs):
    run_dir = lunar_runs["clustered"].run_dir
    for k in range(2):
        assert (run_dir / "checkpoint" / f"cluster-{k}.pt").is_file()
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state == {"round": 2, "models": ["cluster-0", "cluster-1"]}
    clusters = pd.read_csv(run_dir / "clusters.csv")
    assert len(clusters) == 4 and set(clusters["round"]) == {1, 2}
    assert set(clusters["cluster"]) <= {0, 1}
    metrics = pd.read_csv(run_dir / "metrics.csv")
    train = metrics[metrics["scope"] == "train"]
    assert (train["cluster-0-size"] + train["cluster-1-size"] == 2).all()
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    for planet in PLANETS:
        best = np.maximum(
            central.loc[2, f"cluster-0-eval-reward-{planet}"],
            central.loc[2, f"cluster-1-eval-reward-{planet}"],
        )
        assert central.loc[2, f"eval-reward-{planet}"] == pytest.approx(best)


def test_ifca_trains_the_model_each_client_scores_best_and_averages_by_assignment(lunar_runs):
    run_dir = lunar_runs["ifca"].run_dir
    clusters = pd.read_csv(run_dir / "clusters.csv")
    assert len(clusters) == 4
    # Distinct initial models (the ServerApp drew model 1 from its own seed): already in
    # round 1 each client takes its lowest score (negative mean return) on its planet.
    assert set(clusters["how"]) == {"loss"}
    assert "models 1..1 start from seeds" in lunar_runs["ifca"].output
    assert (clusters["cluster"] == clusters["assigned"]).all()  # no k-means moved anyone
    train = pd.read_csv(run_dir / "metrics.csv").query("scope == 'train'")
    assert (train["clusters-changed"] == 0).all()
    for k in range(2):
        assert (train[f"cluster-{k}-size"] == train[f"assigned-{k}"]).all()


def test_laplace_ledger_names_the_unit_of_privacy(lunar_runs):
    result = lunar_runs["laplace"]
    ledger = json.loads((result.run_dir / "ledger.json").read_text())["summary"]
    assert ledger["num-releases"] == 2
    assert ledger["basic-composition-epsilon"] == pytest.approx(60.0)
    assert "environment" in ledger["privacy-unit"]
    assert any(s.startswith("Unit of privacy") for s in ledger["statements"])


def test_kept_adam_state_and_seeded_evaluation_with_standard_errors(lunar_runs):
    result = lunar_runs["lands"]
    model = torch.load(result.run_dir / "model.pt")  # the policy observed gravity: 9 inputs
    assert model["mlp_extractor.policy_net.0.weight"].shape == (64, 9)
    metrics = load_metrics(result.run_dir)
    # The linear schedule over 2 rounds: each round's last update (progress 0) trains at
    # 3e-4 x (1 - r / 2), the same for every client of the round
    rates = metrics[metrics["scope"] == "train"].set_index("round")["train-learning-rate"]
    assert rates.to_dict() == pytest.approx({1: 1.5e-4, 2: 0.0}, abs=1e-12)
    # PPO learnt from rewards x 0.01; the clients report their episodes' raw returns
    # (an untrained lander's are below -20; scaled they would lie within a few points)
    returns = metrics[metrics["scope"] == "train"]["train-reward"].dropna()
    assert len(returns) and (returns < -20).all()
    central = metrics[metrics["scope"] == "central-eval"].set_index("round")
    for planet in PLANETS:  # 3 episodes per planet: a standard error each round
        assert (central[f"eval-reward-se-{planet}"] > 0).all()
    assert central.loc[0, "num-examples"] == 9
    # The Adam state a client kept: 2 updates (1 minibatch each) per round it trained
    files = sorted((result.run_dir / "clients" / "client-state").glob("partition-*/round-*.bin"))
    steps = set()
    for path in files:
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
        pid = int(path.parent.name.removeprefix("partition-"))
        state.restore(context, str(result.run_dir / "clients"), pid, 3)
        steps.add(float(context.state["task-tensors"]["adam.0.step"].numpy()))
    assert files and steps <= {4.0, 8.0} and 8.0 in steps  # someone trained in both rounds


def test_lands_run_made_again_in_process_gives_identical_metrics(lunar_runs, tmp_path):
    """The `flwr run` (SB3's PPO in Ray's workers) and the engine's run of the same config
    and seed: the same metrics.csv outside the timing columns, bit for bit. Ray starts a
    ClientApp's worker with OMP_NUM_THREADS = its num-cpus (1 here), so its BLAS and
    OpenMP pools have one thread; the engine's run gets the same (with this process's
    two, the training loss differs by ~1.5e-7 and the divergence by ~5e-10)."""
    first = lunar_runs["lands"]
    assert engine.engine_of(first.run_dir) == "flwr"
    with threadpool_limits(limits=1):
        again = engine.run(
            f"{TINY} {VARIANTS['lands']} output-dir='{tmp_path}'",
            engine.Federation.parse(FEDERATION),
        )
    assert again.returncode == 0 and again.run_dir is not None, again.error
    assert engine.engine_of(again.run_dir) == "inprocess"

    def metrics(run_dir):
        frame = pd.read_csv(run_dir / "metrics.csv")
        return frame.drop(columns=list(TIMING_COLUMNS), errors="ignore")

    expected, got = metrics(first.run_dir), metrics(again.run_dir)
    assert len(expected) > 0
    pd.testing.assert_frame_equal(expected, got, check_exact=True)
