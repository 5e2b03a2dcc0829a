"""Replaying the attacks on DP randomness and on aborted rounds, with the real
ServerApp and ClientApp in one process (:mod:`tests.inprocess`).

The attacker is a client (or any reader of ``config.json``): it knows the run seed and
every message it received, among them the released model. If the server's DP sample
and noise were a function of the seed, it could recompute them and subtract the noise,
recovering the clipped mean of the updates exactly. By default the DP randomness is
secret (OS entropy) and the same attack recovers only noise; under the explicit
``dp.reproducible-noise`` opt-in it succeeds, and the ledger says that no ε holds
against anyone who knows the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

from privacy.mechanisms import clip_by_l2_norm, make_generator
from protocol import keys
from strategies.registry import _SERVER_STREAM
from strategies.runtime.partitions import sample_uniform
from tasks.vision import DigitsTask
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [11, 22, 33, 44]
Z, CLIP = 1.0, 1.0
# One worker makes the module's shared runs once (a module-scoped fixture per worker
# otherwise).
pytestmark = [
    pytest.mark.xdist_group("dp-attack"),
    pytest.mark.usefixtures("learning_curve_not_rendered"),
]


class RecordingGrid(InProcessGrid):
    """An in-process grid that keeps every train reply (the server's view)."""

    def __init__(self, config, node_ids, failing=()):
        super().__init__(config, node_ids)
        self.replies = []
        self.failing = set(failing)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        out = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.metadata.message_type == "train" and node in self.failing:
                continue  # this SuperNode crashes in every round it is asked to train
            out.append(reply)
            if reply.metadata.message_type == "train":
                self.replies.append(reply)
        return out


def _run(tmp_path: Path, failing=(), **overrides) -> tuple[Path, RecordingGrid]:
    config = run_config(
        **{
            "output-dir": str(tmp_path),
            "privacy": "dp-fedavg-fixed",
            "num-server-rounds": 1,
            "dp.noise-multiplier": Z,
            "dp.clip-norm": CLIP,
            "dp.num-sampled-clients": 2,
            "central-eval": False,
            **overrides,
        }
    )
    grid = RecordingGrid(config, NODES, failing)
    run_server(config, grid)
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return path, grid


@pytest.fixture(scope="module")
def secret_runs(tmp_path_factory) -> list[tuple[Path, RecordingGrid]]:
    """Two one-round DP-FedAvg runs with one seed and the default secret noise, made once:
    the attack's target and the run it is compared with."""
    # What Flower's runtime sets for a ServerApp (tests/conftest.py sets it per test; a
    # module-scoped fixture runs before that).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    return [_run(tmp_path_factory.mktemp(f"secret-{run}")) for run in (1, 2)]


def _flat(state: dict) -> np.ndarray:
    return np.concatenate([v.numpy().astype(np.float64).ravel() for v in state.values()])


def _attack(path: Path, m: int) -> tuple[list[int], np.ndarray]:
    """What a reader of config.json recomputes: the sampled partitions and the server's
    noise on the mean, drawn exactly as the server would from a seed-derived generator."""
    config = json.loads((path / "config.json").read_text())["run-config"]
    rng = make_generator(config["seed"], _SERVER_STREAM)
    partitions = list(range(len(NODES)))  # in partition order, as the server samples
    if config["dp.sampling"] == "poisson":  # one uniform per client, rate m / N
        sampled = [p for p, u in zip(partitions, rng.random(len(NODES)), strict=True) if u < m / 4]
    else:
        sampled = sample_uniform(partitions, m, rng)
    shapes = [v.shape for v in torch.load(path / "model.pt", weights_only=True).values()]
    noise = np.concatenate([rng.normal(0.0, Z * CLIP, size=s).ravel() for s in shapes])
    return sampled, noise / m


def _clipped_mean(grid: RecordingGrid, initial: np.ndarray, m: int) -> np.ndarray:
    total = np.zeros_like(initial)
    for reply in grid.replies:
        arrays = reply.content[keys.ARRAYS]
        trained = np.concatenate([arrays[k].numpy().astype(np.float64).ravel() for k in arrays])
        total += clip_by_l2_norm([trained - initial], clip_norm=CLIP).arrays[0]
    return total / m


def _initial() -> np.ndarray:
    """The global model before round 1 (the task's seeded initialisation)."""
    config = run_config()
    return _flat(DigitsTask(config).build_model(config["seed"]).state_dict())


@pytest.mark.parametrize("reproducible", [True, False])
def test_a_client_that_knows_the_seed_recovers_the_mean_only_under_reproducible_noise(
    reproducible, tmp_path, request
):
    if reproducible:
        path, grid = _run(tmp_path, **{"dp.reproducible-noise": True})
    else:  # the default: secret noise
        path, grid = request.getfixturevalue("secret_runs")[0]
        assert not grid.run_config["dp.reproducible-noise"]
    released = _flat(torch.load(path / "model.pt", weights_only=True))
    initial = _initial()
    sampled, noise = _attack(path, m=2)
    truth = _clipped_mean(grid, initial, m=2)
    recovered = released - initial - noise
    asked = sorted(grid.contexts[r.metadata.src_node_id].node_config["partition-id"]
                   for r in grid.replies)  # fmt: skip
    ledger = json.loads((path / "ledger.json").read_text())
    if reproducible:
        assert asked == sampled  # the sample, recomputed from the seed
        np.testing.assert_allclose(recovered, truth, atol=1e-6)  # float32 weights
        assert ledger["summary"]["statements"][0].startswith("NO EPSILON HOLDS")
        assert all("caveat" in e for e in ledger["threat-models"] if e["holds"])
    else:
        # Whatever the sample guess, what is left is the server's noise: std zC/m.
        error = recovered - truth
        assert np.std(error) > 0.5 * Z * CLIP / 2
        assert not ledger["summary"]["noise-from-seed"]
        assert not any("caveat" in e for e in ledger["threat-models"])


def test_two_dp_runs_with_one_seed_differ_and_two_plain_runs_do_not(secret_runs, tmp_path):
    models = {}
    for run, (path, _) in enumerate(secret_runs, start=1):
        models["dp-fedavg-fixed", run] = _flat(torch.load(path / "model.pt", weights_only=True))
    for run in (1, 2):
        path, _ = _run(tmp_path / f"none-{run}", privacy="none")
        models["none", run] = _flat(torch.load(path / "model.pt", weights_only=True))
    assert not np.allclose(models["dp-fedavg-fixed", 1], models["dp-fedavg-fixed", 2])
    np.testing.assert_array_equal(models["none", 1], models["none", 2])


def test_a_client_that_always_fails_is_a_zero_update_and_every_round_is_charged(tmp_path):
    # Every client is sampled every round; partition 1's SuperNode never answers. No
    # round aborts: each is released and charged, with that client's update zero.
    failing = {"dp.num-sampled-clients": 4, "dp.reproducible-noise": True, "round-timeout": 1.0}
    path, _ = _run(tmp_path / "three", failing=[22], **failing, **{"num-server-rounds": 3})
    ledger = json.loads((path / "ledger.json").read_text())
    assert [r["server_round"] for r in ledger["state"]["releases"]] == [1, 2, 3]
    rows = pd.read_csv(path / "curator" / "participation.csv")
    dead = rows[rows["node-id"] == 22]
    assert dead["round"].tolist() == [1, 2, 3] and not dead["replied"].any()
    curator = pd.read_csv(path / "curator" / "metrics.csv").query("scope == 'train'")
    assert (curator["dp-failed-clients"] >= 1.0).all()

    path, grid = _run(tmp_path / "one", failing=[22], **failing)
    released = _flat(torch.load(path / "model.pt", weights_only=True))
    initial = _initial()
    _, noise = _attack(path, m=4)
    # The three replies' clipped updates over m = 4: the failed client added nothing.
    assert len(grid.replies) == 3
    recovered = released - initial - noise
    np.testing.assert_allclose(recovered, _clipped_mean(grid, initial, 4), atol=1e-6)
