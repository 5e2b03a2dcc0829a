"""The finance task without Flower: options, partitions, model, train and evaluate.

Built from its class, not through ``tasks.build`` (see test_vision_task.py).
"""

import numpy as np
import pytest
import torch
from sklearn.metrics import r2_score
from torch import nn

from config.options import ConfigError
from tasks.base import DPSGD, EVAL_LOSS, NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.finance import EVAL_MSE, EVAL_R2, FinanceTask, RegressionSplit
from tasks.finance.data import prepared_data
from tasks.finance.model import FinanceMLP
from tasks.finance.task import regression_metrics, training_batches

CONFIG = {"task": "finance", "seed": 42, "finance.synthetic-rows": 2000}
IID = {**CONFIG, "finance.partitioning": "iid"}


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --- options ------------------------------------------------------------------------


def test_defaults_and_parsed_config():
    # Execute
    task = FinanceTask({})

    # Assert
    cfg = task.config
    assert cfg.scheme == ("multi-key", "label-skew", "quantity-skew")
    assert (cfg.batch_size, cfg.local_epochs, cfg.lr, cfg.bn) == (64, 3, 1e-3, "average")
    assert cfg.norm == "batch"  # finance.norm = auto without privacy = dp-sgd
    assert (cfg.synthetic_rows, cfg.central_test_fraction, cfg.test_fraction) == (20000, 0.2, 0.2)
    assert cfg.seed == 42 and cfg.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert task.data_source == "synthetic (seed 42, 20000 rows)"
    assert FinanceTask.name == "finance"
    assert FinanceTask.EPOCHS_KEY == "finance.local-epochs"
    assert FinanceTask.SUPPORTS_DP_SGD is True  # with LayerNorm (test_finance_dpsgd.py)


@pytest.mark.parametrize(
    ("key", "value"),
    [("finance.partitioning", "dirichlet"), ("finance.bn", "group"), ("finance.norm", "group"),
     ("finance.lr", 0),
     ("finance.batch-size", 1), ("finance.test-fraction", 0.9), ("finance.device", "tpu"),
     ("finance.synthetic-rows", 10), ("finance.local-epochs", 0), ("finance.data-path", 3)],
)  # fmt: skip
def test_invalid_option_raises_config_error_naming_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        FinanceTask({key: value})


# --- data ---------------------------------------------------------------------------


def test_partitions_and_central_test_are_disjoint():
    # Prepare
    task = FinanceTask(CONFIG)

    # Execute
    parts = [task.load_partition(i, 4) for i in range(4)]
    central = task.load_central_test()

    # Assert
    ids = [np.concatenate([p.train.ids.numpy(), p.test.ids.numpy()]) for p in parts]
    every = np.concatenate([*ids, central.test.ids.numpy()])
    assert len(central.test) == 400
    assert len(np.unique(every)) == len(every)
    for part, rows in zip(parts, ids, strict=True):
        assert len(part.test) == round(0.2 * len(rows))
        assert part.train.features.shape == (len(part.train), 26)
        assert part.train.features.dtype == torch.float32
    assert task.load_partition(2, 4) is parts[2]  # cached per process


def test_partition_id_out_of_range():
    with pytest.raises(ValueError, match="partition_id 4"):
        FinanceTask(CONFIG).load_partition(4, 4)


@pytest.mark.parametrize("scheme", ["iid", "multi-key+label-skew+quantity-skew"])
def test_the_servers_partitioning_check_refuses_what_the_clients_would(scheme):
    # The ServerApp checks at start-up the split every client makes: same seed, same
    # table, so it passes exactly where every client's load_partition does.
    task = FinanceTask({**CONFIG, "finance.partitioning": scheme})
    task.check_partitioning(4)
    assert len(task.load_partition(3, 4).train) > 0
    too_many = 1600 // 9  # 1 600 pool rows: fewer than 10 rows a client
    with pytest.raises(ConfigError, match=r"'finance\.partitioning'.*minimum 10") as server:
        task.check_partitioning(too_many)
    with pytest.raises(ConfigError) as client:
        task.load_partition(0, too_many)
    assert str(client.value) == str(server.value)


# --- model --------------------------------------------------------------------------


def test_model_shape_parameter_count_and_seeded_init():
    # Prepare
    task = FinanceTask(CONFIG)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)

    # Execute
    model, same, other = task.build_model(3), task.build_model(3), task.build_model(4)
    after = torch.rand(1)
    output = model.eval()(torch.zeros(5, 26))

    # Assert: Linear + BatchNorm (weight, bias) per block, then Linear(32, 1)
    expected = (26 * 128 + 128 + 2 * 128) + (128 * 64 + 64 + 2 * 64) + (64 * 32 + 32 + 2 * 32)
    expected += 32 + 1
    assert expected == 14273
    assert sum(p.numel() for p in model.parameters()) == expected
    assert output.shape == (5,)
    assert torch.equal(_weights(model), _weights(same))
    assert not torch.equal(_weights(model), _weights(other))
    assert torch.equal(before, after)  # the global RNG is untouched


def test_bn_local_declares_exactly_the_batchnorm_keys():
    # Prepare
    stats = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    # layers: Linear 0, BN 1, ReLU 2, Dropout 3, Linear 4, BN 5, ReLU 6, Dropout 7,
    # Linear 8, BN 9, ReLU 10, Linear 11
    expected = tuple(f"layers.{i}.{s}" for i in (1, 5, 9) for s in stats)

    # Execute
    local = FinanceTask({**CONFIG, "finance.bn": "local"}).local_state_keys()
    average = FinanceTask(CONFIG).local_state_keys()

    # Assert
    assert local == expected
    assert set(local) <= set(FinanceMLP().state_dict())
    assert average == ()


# --- train --------------------------------------------------------------------------


def test_training_reduces_loss_and_reports_metrics():
    # Prepare
    task = FinanceTask(IID)
    partition, central = task.load_partition(0, 4), task.load_central_test()
    model = task.build_model(seed=0)
    before = task.evaluate(model, central)

    # Execute
    metrics = [task.train(model, partition, LocalTraining(r, seed=r)) for r in (1, 2, 3)]
    after = task.evaluate(model, central)

    # Assert
    assert set(metrics[0]) == {NUM_EXAMPLES, TRAIN_LOSS}
    assert metrics[0][NUM_EXAMPLES] == len(partition.train) == 320
    assert metrics[-1][TRAIN_LOSS] < metrics[0][TRAIN_LOSS]
    assert after[EVAL_LOSS] < 0.5 * before[EVAL_LOSS]
    assert after[EVAL_R2] > 0.5
    assert all(type(v) in (int, float) for v in {**metrics[-1], **after}.values())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_training_is_reproducible_from_local_seed():
    # Prepare
    task = FinanceTask({**IID, "finance.local-epochs": 1})
    partition = task.load_partition(1, 4)
    models = [task.build_model(seed=0) for _ in range(3)]

    # Execute (dropout and shuffling both draw from the local seed)
    results = [
        task.train(model, partition, LocalTraining(1, seed=seed))
        for model, seed in zip(models, (5, 5, 6), strict=True)
    ]

    # Assert
    assert results[0] == results[1]
    assert torch.equal(_weights(models[0]), _weights(models[1]))
    assert not torch.equal(_weights(models[0]), _weights(models[2]))
    assert task.evaluate(models[0], partition) == task.evaluate(models[1], partition)


def test_huge_proximal_term_keeps_weights_near_the_global_model():
    # Prepare
    task = FinanceTask(IID)
    partition = task.load_partition(2, 4)
    anchor = _weights(task.build_model(seed=0))

    def drift(mu: float) -> float:
        model = task.build_model(seed=0)
        task.train(model, partition, LocalTraining(1, seed=1, proximal_mu=mu))
        return float((_weights(model) - anchor).norm())

    # Execute / Assert
    assert drift(1e4) < 0.2 * drift(0.0)


def test_single_row_batches_are_dropped():
    # Prepare
    generator = torch.Generator().manual_seed(0)

    # Execute: 129 rows in batches of 64 leave one row over
    batches = training_batches(129, 64, generator)

    # Assert
    assert [len(b) for b in batches] == [64, 64]


def test_training_on_a_split_with_a_lone_last_row():
    # Prepare: 65 rows in batches of 64 (BatchNorm cannot train on the 65th alone)
    task = FinanceTask(IID)
    part = task.load_partition(0, 4)
    lone = RegressionSplit(part.train.features[:65], part.train.target[:65], part.train.ids[:65])

    # Execute
    metrics = task.train(
        task.build_model(0), type(part)(0, 4, lone, part.test), LocalTraining(1, seed=0)
    )

    # Assert
    assert metrics[NUM_EXAMPLES] == 65 and np.isfinite(metrics[TRAIN_LOSS])


def test_dp_sgd_on_the_batchnorm_model_is_refused():
    # Prepare: no privacy = dp-sgd in the run-config, so finance.norm = auto is batch
    task = FinanceTask(CONFIG)
    local = LocalTraining(1, seed=0, dp_sgd=DPSGD(1.0, 1.0, 1e-5))

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"'finance\.norm' = 'layer'.*BatchNorm"):
        task.train(task.build_model(0), task.load_partition(0, 4), local)


# --- evaluate -----------------------------------------------------------------------


def test_regression_metrics_by_hand():
    # Execute: SSE = 1, SST = 42/9 around the mean 7/3
    mse, r2 = regression_metrics(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 4.0]))

    # Assert
    assert mse == pytest.approx(1 / 3)
    assert r2 == pytest.approx(11 / 14)
    assert regression_metrics(np.array([2.0, 2.0]), np.array([2.0, 2.0])) == (0.0, 1.0)
    assert regression_metrics(np.empty(0), np.empty(0)) == (0.0, 0.0)


def test_perfect_predictor_has_r2_one():
    # Prepare: the target is the first feature; a linear model that copies it
    features = torch.randn(50, 26, generator=torch.Generator().manual_seed(0))
    split = RegressionSplit(features, features[:, 0].clone(), torch.arange(50))
    model = nn.Linear(26, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.weight[0, 0] = 1.0
        model.bias.zero_()

    # Execute
    metrics = FinanceTask(CONFIG).evaluate(model, split)

    # Assert
    assert metrics == {NUM_EXAMPLES: 50, EVAL_LOSS: 0.0, EVAL_MSE: 0.0, EVAL_R2: 1.0}


def test_r2_matches_sklearn_and_rupees():
    # Prepare: on the CPU, where the test's own prediction below runs
    task = FinanceTask({**IID, "finance.device": "cpu"})
    model = task.build_model(0)
    task.train(model, task.load_partition(0, 4), LocalTraining(1, seed=0))
    central = task.load_central_test()
    scaler = prepared_data("", 2000, 42, 0.2).target_scaler

    # Execute
    metrics = task.evaluate(model, central)
    with torch.no_grad():
        prediction = model.eval()(central.test.features).numpy().astype(np.float64)
    target = central.test.target.numpy().astype(np.float64)

    # Assert: R² is the same in standardised units and in rupees
    rupees = scaler.inverse_transform(np.stack([prediction, target], axis=1).reshape(-1, 1))
    pred_rupees, target_rupees = rupees.reshape(-1, 2).T
    assert metrics[NUM_EXAMPLES] == 400
    assert metrics[EVAL_R2] == pytest.approx(r2_score(target, prediction), abs=1e-9)
    assert metrics[EVAL_R2] == pytest.approx(r2_score(target_rupees, pred_rupees), abs=1e-6)
    assert metrics[EVAL_MSE] == metrics[EVAL_LOSS]
    assert metrics[EVAL_MSE] == pytest.approx(np.mean((prediction - target) ** 2), rel=1e-6)
