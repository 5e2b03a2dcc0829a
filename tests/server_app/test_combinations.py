"""Valid values that cannot run together are refused with a message naming the keys."""

import pytest

from config.options import ConfigError
from server_app import config
from server_app.evaluation import best_of_clusters
from tests.inprocess import pyproject_defaults, with_test_noise


def _load(**overrides):
    return config.load(with_test_noise({**pyproject_defaults(), **overrides}))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"strategy": "local", "privacy": "laplace"}, "needs a federated strategy"),
        (
            {"strategy": "clustered", "privacy": "subspace-dp"},
            "valid values with clustered: 'none', 'laplace', 'dp-sgd', 'dp-fedavg-fixed', "
            "'dp-fedavg-adaptive'",
        ),
        (
            {
                "strategy": "clustered",
                "privacy": "dp-fedavg-adaptive",
                "dp.noise-site": "client",
                "dp.sampling": "fixed",
            },
            "needs 'dp.noise-site' = 'server'",
        ),
        (
            {"strategy": "clustered", "privacy": "laplace", "cluster.assign": "loss"},
            "use 'cluster.assign' = 'l2'",
        ),
        (
            {"task": "lunar-lander", "privacy": "dp-sgd"},
            "'privacy' = 'dp-sgd' is not available for 'task' = 'lunar-lander'",
        ),
        ({"cluster.assign": "nearest"}, "valid values: 'l2', 'loss'"),
        ({"cluster.space": "cosine"}, "valid values: 'weights', 'directions'"),
        ({"cluster.update": "ifca"}, "valid values: 'kmeans', 'assignment'"),
        ({"cluster.init": "random"}, "valid values: 'shared', 'distinct'"),
        (
            {"strategy": "clustered", "cluster.init": "distinct", "subspace.warm-start": 1},
            "'cluster.init' = 'distinct' draws models 1..K-1 afresh, which would skip "
            "'subspace.warm-start' = 1",
        ),
        (
            {
                "strategy": "clustered",
                "cluster.update": "assignment",
                "cluster.space": "directions",
            },
            "'cluster.space' = 'directions' has no effect with 'cluster.update' = 'assignment'",
        ),
        (
            {
                "strategy": "clustered",
                "privacy": "dp-fedavg-fixed",
                "dp.noise-site": "server",
                "cluster.space": "directions",
            },
            "'cluster.space' = 'directions' has no effect with 'privacy' = 'dp-fedavg-fixed'",
        ),
        (
            {"strategy": "smart-fedprox", "privacy": "laplace"},
            "valid values with smart-fedprox: 'none', 'dp-sgd', 'dp-fedavg-fixed', "
            "'dp-fedavg-adaptive'",
        ),
        (
            {"strategy": "smart-fedprox", "smart.divergence-noise": 2.0},
            "'smart.divergence-noise' = 2 sets the divergence release of DP-FedAvg",
        ),
        (
            {"strategy": "smart-fedprox", "smart.mu-min": 0.5, "smart.mu-max": 0.1},
            "'smart.mu-min' = 0.5 must not exceed 'smart.mu-max' = 0.1",
        ),
        ({"privacy": "cp-np"}, "use it with 'strategy' = 'hierarchical'"),
        (
            {"strategy": "hierarchical", "privacy": "dp-fedavg-fixed"},
            "valid values: 'none', 'cg-ng', 'cg-np', 'cp-np'",
        ),
        ({"strategy": "hierarchical", "task": "lunar-lander"}, "valid tasks: 'digits'"),
        (
            {"strategy": "hierarchical", "privacy": "cg-np", "dp.per-example": True},
            "no sound per-example bound",
        ),
        ({"cluster.k": 0}, "'cluster.k' = 0 is out of range"),
        (
            {"privacy": "subspace-dp", "subspace.rank": 256},
            "'subspace.rank' = 256 must be below 'subspace.sketch-dim' = 256",
        ),
        (
            {"privacy": "subspace-dp", "dp.noise-site": "client"},
            "set 'dp.noise-site' = 'server'",
        ),
        ({"privacy": "subspace-dp", "subspace.init": "public"}, "set 'subspace.warm-start' > 0"),
        (
            {"task": "finance", "subspace.head-only": True},
            "'task' = 'finance' has no head-only mode; valid tasks: 'digits'",
        ),
        (
            {"subspace.head-only": True, "privacy": "laplace"},
            "valid values: 'none', 'dp-fedavg-fixed', 'dp-fedavg-adaptive', 'subspace-dp'",
        ),
        (
            {"subspace.head-only": True, "strategy": "clustered"},
            "valid values: 'fedavg', 'fedprox'",
        ),
        ({"privacy": "subspace-dp", "strategy": "clustered"}, "valid values with clustered"),
        ({"privacy": "subspace-dp", "strategy": "hierarchical"}, "valid values: 'none', 'cg-ng'"),
    ],
)
def test_impossible_combinations_are_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _load(**overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"strategy": "clustered", "privacy": "none", "cluster.assign": "loss"},
        {"strategy": "clustered", "privacy": "laplace", "cluster.assign": "l2"},
        {"strategy": "clustered", "privacy": "laplace", "cluster.space": "directions"},
        {"strategy": "clustered", "privacy": "laplace", "cluster.update": "assignment"},
        {"strategy": "clustered", "cluster.assign": "loss", "cluster.update": "assignment"},
        {"strategy": "clustered", "cluster.assign": "loss", "cluster.init": "distinct"},
        {"strategy": "clustered", "privacy": "dp-fedavg-fixed", "cluster.init": "distinct"},
        {"strategy": "clustered", "privacy": "dp-sgd"},
        {"strategy": "clustered", "privacy": "dp-fedavg-adaptive", "cluster.assign": "loss"},
        {"strategy": "clustered", "privacy": "dp-fedavg-fixed", "cluster.assign": "l2"},
        {"task": "lunar-lander", "privacy": "laplace"},
        {
            "task": "lunar-lander",
            "privacy": "dp-fedavg-adaptive",
            "dp.noise-site": "client",
            "dp.sampling": "fixed",
        },
        {
            "privacy": "subspace-dp",
            "subspace.head-only": True,
            "subspace.warm-start": 1,
            "subspace.init": "public",
        },
        {"privacy": "dp-fedavg-fixed", "subspace.head-only": True, "strategy": "fedprox"},
        {"task": "lunar-lander", "privacy": "subspace-dp"},
        {"strategy": "smart-fedprox", "privacy": "dp-fedavg-adaptive", "task": "finance"},
        {
            "strategy": "smart-fedprox",
            "privacy": "dp-fedavg-fixed",
            "dp.noise-site": "client",
            "smart.divergence-clip": 2.0,
            "smart.divergence-noise": 3.0,
        },
    ],
)
def test_sound_combinations_load(overrides):
    cfg = _load(**overrides)
    assert cfg.strategy == overrides.get("strategy", "fedavg")


def test_best_of_clusters_takes_each_metrics_best_model():
    merged = best_of_clusters(
        [
            {
                "eval-reward-moon": -50.0,
                "eval-reward-mars": 10.0,
                "eval-loss": 2.0,
                "eval-reward-std-moon": 3.0,
                "eval-reward-se-mars": 0.5,
                "eval-length-std": 7.0,
                "num-examples": 5,
            },
            {
                "eval-reward-moon": 20.0,
                "eval-reward-mars": -80.0,
                "eval-loss": 1.5,
                "eval-reward-std-moon": 9.0,
                "eval-reward-se-mars": 4.0,
                "eval-length-std": 8.0,
                "num-examples": 5,
            },
        ]
    )
    assert merged["eval-reward-moon"] == 20.0  # cluster 1 is best on the moon
    assert merged["eval-reward-mars"] == 10.0  # cluster 0 on mars
    assert merged["eval-loss"] == 1.5
    # A spread is its headline's model's: the moon's std is cluster 1's, mars' SE cluster
    # 0's; a spread without a headline key, and a count, are cluster 0's
    assert merged["eval-reward-std-moon"] == 9.0 and merged["eval-reward-se-mars"] == 0.5
    assert merged["eval-length-std"] == 7.0 and merged["num-examples"] == 5
    assert merged["cluster-0-eval-reward-moon"] == -50.0
    assert merged["cluster-1-eval-reward-mars"] == -80.0
    assert len(merged) == 7 + 2 * 7


def test_best_of_clusters_takes_the_best_r2_and_mse_of_a_regression():
    merged = best_of_clusters(
        [
            {"eval-r2": -0.03, "eval-mse": 1.03, "eval-loss": 1.03, "num-examples": 8},
            {"eval-r2": 0.62, "eval-mse": 0.38, "eval-loss": 0.38, "num-examples": 8},
        ]
    )
    assert merged["eval-r2"] == 0.62 and merged["eval-mse"] == 0.38
    assert merged["eval-loss"] == 0.38 and merged["cluster-0-eval-r2"] == -0.03
