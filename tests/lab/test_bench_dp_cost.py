"""``bench/privacy_cost.py`` and ``bench/gpu_paths.py`` run against the app's current
code (their measurements call the app's own functions, whose signatures move), with the
CPU standing in for the GPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))  # the scripts import bench/timing.py as `timing`
    try:
        import gpu_paths
        import privacy_cost

        yield privacy_cost, gpu_paths
    finally:
        sys.path.remove(str(BENCH))


def test_the_stand_in_aggregate_is_the_mean_of_the_clipped_updates(bench_modules):
    # Prepare: noise of std 1e-12: the DP aggregate is the mean of the clipped deltas.
    privacy_cost, _ = bench_modules
    from privacy.mechanisms import GaussianMechanism, make_generator

    rng = make_generator(0, 1)
    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=1e-12)
    deltas = [
        [np.full(3, 2.0, np.float32), np.full(1, 2.0, np.float32)],
        [np.zeros(3), np.zeros(1)],
    ]
    server = privacy_cost.ServerStandIn(mech, rng, num_sampled_clients=2)

    # Execute
    mean = privacy_cost.private_mean(server, deltas)

    # Assert: (2, 2, 2, 2) has norm 4, clipped to 1: (0.5, ...); the mean with zeros 0.25.
    np.testing.assert_allclose(np.concatenate(mean), np.full(4, 0.25), rtol=1e-6)


def test_privacy_cost_rows_measure_the_app(bench_modules):
    privacy_cost, _ = bench_modules
    update = privacy_cost.measure_update(1000, clients=3, repeats=1)
    model = privacy_cost.measure_model("lenet", clients=3, repeats=1)
    assert update["d"] == 985 and update["aggregate m=3 ms"] > 0
    assert model["d"] == 21_386 and model["aggregate m=3 ms"] > 0


def test_planned_ledger_rows_end_at_the_planned_epsilon(bench_modules):
    privacy_cost, _ = bench_modules
    rows = privacy_cost.section_planned(argparse.Namespace(rounds=5, clients=10))
    assert [row["composed"] for row in rows] == ["every round", "app's checkpoints"]
    # 5 rounds are the plan: both ledgers end at its exact epsilon
    assert all(row["last epsilon"] == row["planned epsilon"] > 0 for row in rows)


def test_gpu_paths_agree_exactly_when_both_devices_are_the_cpu(bench_modules):
    # The same seeds on the same device: identical weights, losses and epsilons, so a
    # difference on a GPU is the device's (its kernels, its noise generator).
    _, gpu_paths = bench_modules
    rows = gpu_paths.section_agree(gpu="cpu")
    assert [r["case"] for r in rows] == [
        "digits lenet", "digits lenet DP-SGD", "finance mlp", "finance mlp DP-SGD",
    ]  # fmt: skip
    for row in rows:
        assert row["max |w cpu - w cuda|"] == 0.0 and row["loss cpu"] == row["loss cuda"]
    assert rows[1]["epsilon cpu"] == rows[1]["epsilon cuda"] > 0


def test_gpu_paths_epoch_rows_train_through_the_task(bench_modules):
    _, gpu_paths = bench_modules
    rows = gpu_paths.section_epochs(["lenet"], [], repeats=1, gpu="cpu", examples=32)
    assert [(r["device"], r["training"]) for r in rows] == [("cpu", "SGD"), ("cpu", "DP-SGD")]
    assert all(r["epoch s"] > 0 and r["aggregate m=10 ms"] > 0 for r in rows)
