"""Sample-level DP-SGD on the finance task: the LayerNorm MLP that ``finance.norm = auto``
builds under ``privacy = 'dp-sgd'``, its training through :mod:`privacy.dpsgd`, and the
combinations the task refuses. test_dpsgd.py tests the DP-SGD machinery itself."""

import json
import math

import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn

from config.options import ConfigError
from privacy.dpsgd import (
    CALIBRATED_KEY,
    HISTORY_KEY,
    ROUND_NOISE,
    ROUND_SAMPLE_RATE,
    ROUND_STEPS,
    ROUNDS,
    epsilon_from_history,
)
from server_app import config
from strategies.mechanisms.dpsgd_clients import DPSGDClients
from tasks.base import DPSGD, LOCAL_EPSILON, NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.finance import EVAL_R2, FinanceTask
from tasks.finance.model import build_model

CONFIG = {"task": "finance", "seed": 42, "finance.synthetic-rows": 2000}
IID = {**CONFIG, "finance.partitioning": "iid"}
DP_CONFIG = {**IID, "privacy": "dp-sgd"}
# Client 0 of 4 holds 320 training rows: q = 64/320 = 0.2, int(1/q) = 5 steps per epoch,
# 3 local epochs per round.
NUM_TRAIN, SAMPLE_RATE, STEPS_PER_ROUND = 320, 0.2, 15
DP = DPSGD(noise_multiplier=0.5, max_grad_norm=1.0, delta=1e-5)
NORMS = (nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm)


@pytest.fixture(scope="module")
def task():
    return FinanceTask(DP_CONFIG)


@pytest.fixture(scope="module")
def partition(task):
    return task.load_partition(0, 4)


def _norm_layers(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules() if isinstance(m, NORMS)]


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _hooks_left(model: nn.Module) -> list[str]:
    return [
        type(m).__name__
        for m in model.modules()
        if m._forward_hooks or m._backward_hooks or m._forward_pre_hooks
    ] + [n for n, p in model.named_parameters() if hasattr(p, "grad_sample")]


# --- model ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "norm"),
    [({}, "batch"), ({"privacy": "none"}, "batch"), ({"privacy": "dp-fedavg-fixed"}, "batch"),
     ({"privacy": "dp-sgd"}, "layer"), ({"finance.norm": "layer"}, "layer"),
     ({"privacy": "dp-sgd", "finance.norm": "layer"}, "layer"),
     ({"privacy": "laplace", "finance.norm": "batch"}, "batch")],
)  # fmt: skip
def test_norm_auto_is_layer_exactly_under_dp_sgd(overrides, norm):
    # Execute
    task = FinanceTask({**CONFIG, **overrides})

    # Assert
    assert task.config.norm == norm
    expected = nn.LayerNorm if norm == "layer" else nn.BatchNorm1d
    assert _norm_layers(task.build_model(0)) == [expected] * 3


def test_dp_sgd_model_has_layer_norm_and_opacus_accepts_it(task):
    # Execute
    model = task.build_model(3)
    batchnorm_model = FinanceTask(CONFIG).build_model(3)

    # Assert: no BatchNorm, and Opacus finds nothing to fix (it does in the BatchNorm MLP of
    # the SmartFedProx study)
    assert _norm_layers(model) == [nn.LayerNorm] * 3
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert ModuleValidator.validate(model, strict=False) == []
    assert ModuleValidator.validate(batchnorm_model, strict=False) != []
    # The same parameters (LayerNorm's weight and bias where BatchNorm's were), no
    # running statistics, and the same weights from the same seed.
    params = {n: p.shape for n, p in model.named_parameters()}
    assert params == {n: p.shape for n, p in batchnorm_model.named_parameters()}
    assert set(model.state_dict()) == set(params)
    assert torch.equal(_weights(model), _weights(batchnorm_model))


def test_without_dp_sgd_the_model_is_the_seeds_batchnorm_mlp():
    # Execute
    model = FinanceTask({**CONFIG, "privacy": "none"}).build_model(5)
    seed_model = build_model(5)  # the model before finance.norm existed

    # Assert
    assert _norm_layers(model) == [nn.BatchNorm1d] * 3
    assert model.state_dict().keys() == seed_model.state_dict().keys()
    assert all(torch.equal(v, seed_model.state_dict()[k]) for k, v in model.state_dict().items())


# --- refused combinations ---------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"privacy": "dp-sgd"},
        {"finance.norm": "layer"},
        {"privacy": "dp-sgd", "finance.norm": "layer"},
    ],
)
def test_fedbn_with_layer_norm_is_refused_naming_the_keys(overrides):
    with pytest.raises(
        ConfigError,
        match=r"'finance\.bn' = 'local'.*'finance\.norm' = '(auto|layer)'.*"
        r"valid values: 'finance\.bn' = 'average'",
    ):
        FinanceTask({**CONFIG, "finance.bn": "local", **overrides})


def test_batch_norm_under_dp_sgd_is_refused_when_the_task_is_built():
    with pytest.raises(
        ConfigError,
        match=r"'finance\.norm' = 'batch' is not available with privacy = 'dp-sgd'.*"
        r"valid values with dp-sgd: 'finance\.norm' = 'auto' or 'layer'",
    ):
        FinanceTask({**CONFIG, "privacy": "dp-sgd", "finance.norm": "batch"})


def test_server_config_accepts_finance_with_dp_sgd():
    # Execute: check_combinations reads FinanceTask.SUPPORTS_DP_SGD
    cfg = config.load({"task": "finance", "privacy": "dp-sgd", "dp.target-epsilon": 8.0})
    task = FinanceTask(cfg.to_dict())  # what the ServerApp and each ClientApp build

    # Assert
    assert (cfg.task, cfg.privacy) == ("finance", "dp-sgd")
    assert task.config.norm == "layer"


# --- training ---------------------------------------------------------------------------


def test_dp_training_reports_cumulative_epsilon_and_the_round_steps(task, partition):
    # Prepare
    model = task.build_model(0)
    keys = list(model.state_dict())
    state: dict = {}

    # Execute: two rounds; the state travels as JSON, as the ClientApp stores it
    first = task.train(model, partition, LocalTraining(1, seed=1, dp_sgd=DP, state=state))
    state = json.loads(json.dumps(state))
    second = task.train(model, partition, LocalTraining(2, seed=2, dp_sgd=DP, state=state))

    # Assert: what the server's DP-SGD wrapper reads from every reply
    assert set(DPSGDClients.CLIENT_REPORTS) <= set(second)
    assert first[NUM_EXAMPLES] == len(partition.train) == NUM_TRAIN
    assert math.isfinite(first[TRAIN_LOSS]) and first[TRAIN_LOSS] > 0
    assert 0 < first[LOCAL_EPSILON] < second[LOCAL_EPSILON] < math.inf
    assert all(type(v) in (int, float) for v in second.values())
    history = [(DP.noise_multiplier, SAMPLE_RATE, 2 * STEPS_PER_ROUND)]
    assert [tuple(e) for e in state[HISTORY_KEY]] == history
    assert second[LOCAL_EPSILON] == pytest.approx(epsilon_from_history(history, DP.delta))
    assert (second[ROUNDS], second[ROUND_STEPS]) == (2.0, STEPS_PER_ROUND)
    assert second[ROUND_NOISE] == DP.noise_multiplier
    assert second[ROUND_SAMPLE_RATE] == pytest.approx(SAMPLE_RATE)
    assert list(model.state_dict()) == keys
    assert _hooks_left(model) == []
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_more_local_epochs_spend_more_epsilon(partition):
    # Execute
    def epsilon(epochs: int) -> float:
        task = FinanceTask({**DP_CONFIG, "finance.local-epochs": epochs})
        local = LocalTraining(1, seed=1, dp_sgd=DP, state={})
        return task.train(task.build_model(0), partition, local)[LOCAL_EPSILON]

    one, three = epsilon(1), epsilon(3)

    # Assert
    assert 0 < one < three < math.inf


@pytest.mark.parametrize("dp_seed", [0, 1])
def test_dp_training_learns_with_modest_noise(task, partition, dp_seed):
    # Prepare
    model = task.build_model(0)
    before = task.evaluate(model, partition.train)
    state: dict = {}

    # Execute: three rounds of three epochs at z = 0.5
    metrics = [
        task.train(
            model, partition, LocalTraining(r, seed=r, dp_sgd=DP, state=state, dp_seed=dp_seed)
        )
        for r in (1, 2, 3)
    ]
    after = task.evaluate(model, partition.train)

    # Assert: better than the initial model on the local data
    assert metrics[-1][TRAIN_LOSS] < before["eval-mse"]
    assert after["eval-mse"] < 0.7 * before["eval-mse"]
    assert after[EVAL_R2] > max(0.3, before[EVAL_R2])


def test_dp_training_is_reproducible_from_its_dp_seed(task, partition):
    # Prepare
    models = [task.build_model(0) for _ in range(3)]
    rng_before = torch.get_rng_state()

    # Execute: the same local seed; batch sampling and noise follow the DP seed
    for model, dp_seed in zip(models, (3, 3, 4), strict=True):
        local = LocalTraining(1, seed=7, dp_sgd=DP, state={}, dp_seed=dp_seed)
        task.train(model, partition, local)

    # Assert
    assert torch.equal(_weights(models[0]), _weights(models[1]))
    assert not torch.equal(_weights(models[0]), _weights(models[2]))
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_proximal_gradient_under_dp_keeps_the_model_near_the_global_one(task, partition):
    # Prepare
    anchor = _weights(task.build_model(0))

    def drift(mu: float) -> float:
        model = task.build_model(0)
        local = LocalTraining(1, seed=1, proximal_mu=mu, dp_sgd=DP, state={}, dp_seed=5)
        task.train(model, partition, local)
        return float((_weights(model) - anchor).norm())

    # Execute / Assert: the same batches and noise; the proximal term goes on the public
    # path (Opacus would drop it from the loss)
    assert drift(10.0) < 0.5 * drift(0.0)


def test_target_epsilon_is_met_after_the_planned_rounds(task, partition):
    # Prepare: the noise multiplier given is replaced by the calibrated one
    dp = DPSGD(99.0, 1.0, 1e-5, target_epsilon=3.0, planned_rounds=2)
    model, state = task.build_model(0), {}

    # Execute
    epsilons = [
        task.train(model, partition, LocalTraining(r, seed=r, dp_sgd=dp, state=state))[
            LOCAL_EPSILON
        ]
        for r in (1, 2)
    ]

    # Assert
    assert 0.3 < state[CALIBRATED_KEY] < 99.0
    assert epsilons[0] < epsilons[1] <= 3.0
    assert epsilons[1] == pytest.approx(3.0, rel=0.02)
