"""Sample-level DP-SGD (privacy.dpsgd) and its use in the vision task's local training.

Golden numbers come from independent sources: Opacus' own accountant test
(z=1.5, q=0.04, 2250 steps, delta=1e-5 -> epsilon 7.32911117143), Opacus' pure RDP
analysis functions, and Google's dp-accounting RDP accountant.
"""

import copy
import json
from functools import partial

import dp_accounting
import pytest
import torch
from dp_accounting import rdp as dp_rdp
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy.dpsgd import (
    BUDGET_REFUSAL,
    HISTORY_KEY,
    ROUND_NOISE,
    ROUND_SAMPLE_RATE,
    ROUND_STEPS,
    ROUNDS,
    BudgetExceeded,
    add_proximal_gradient,
    calibrate_noise_multiplier,
    epsilon_from_history,
    history_from_state,
    make_private,
)
from tasks.base import DPSGD, LOCAL_EPSILON, NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.proximal import proximal_term, snapshot_parameters
from tasks.vision import DigitsTask

# Client 0 of 5 holds 230 digits for training: q = 32/230, int(230/32) = 7 steps/epoch.
# Deterministic kernels: the bitwise comparisons below hold on a CUDA machine too (where
# `vision.device` = auto trains on the GPU; cuDNN's default kernels are not reproducible).
DIGITS_CONFIG = {
    "task": "digits", "seed": 42, "vision.batch-size": 32, "vision.local-epochs": 1,
    "vision.deterministic": True,
}  # fmt: skip
NUM_TRAIN, BATCH = 230, 32
SAMPLE_RATE, STEPS_PER_EPOCH = BATCH / NUM_TRAIN, 7
DP = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


@pytest.fixture(scope="module")
def task():
    return DigitsTask(DIGITS_CONFIG)


@pytest.fixture(scope="module")
def partition(task):
    return task.load_partition(0, 5)


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _opacus_leftovers(model: nn.Module) -> list[str]:
    """Hooks and Opacus attributes still on ``model``, as readable strings."""
    found = [
        f"hooks on {type(m).__name__}"
        for m in model.modules()
        if m._forward_hooks or m._backward_hooks or m._forward_pre_hooks
    ]
    found += [
        f"{attr} on a parameter"
        for p in model.parameters()
        for attr in ("grad_sample", "_forward_counter", "summed_grad")
        if hasattr(p, attr)
    ]
    found += [
        f"{attr} on {type(m).__name__}"
        for m in model.modules()
        for attr in ("activations", "autograd_grad_sample_hooks")
        if hasattr(m, attr)
    ]
    return found  # fmt: skip


# --- accounting -----------------------------------------------------------------------


def test_epsilon_matches_opacus_golden_number():
    # Opacus' accountants_test.py: 90 epochs at q=0.04, z=1.5, delta=1e-5.
    assert epsilon_from_history([[1.5, 0.04, 2250]], 1e-5) == pytest.approx(
        7.32911117143, abs=1e-9
    )


def test_epsilon_matches_dp_accounting_at_the_same_orders():
    # Prepare: Google's dp-accounting, an independent RDP implementation.
    orders = [float(a) for a in range(2, 64)]
    accountant = dp_rdp.RdpAccountant(orders=orders)
    event = dp_accounting.PoissonSampledDpEvent(SAMPLE_RATE, dp_accounting.GaussianDpEvent(1.0))
    accountant.compose(event, 2 * STEPS_PER_EPOCH)

    # Execute
    epsilon = epsilon_from_history([[1.0, SAMPLE_RATE, 14]], 1e-5, orders=orders)

    # Assert
    assert epsilon == pytest.approx(accountant.get_epsilon(1e-5), abs=1e-6)


def test_empty_history_has_zero_epsilon():
    assert epsilon_from_history([], 1e-5) == 0.0


@pytest.mark.parametrize(
    "entry", [[1.0, 0.0, 5], [1.0, 1.5, 5], [-1.0, 0.1, 5], [1.0, 0.1, 0], [1.0, 0.1, 2.5],
              [1.0, 0.1]],
)  # fmt: skip
def test_invalid_history_entry_raises(entry):
    with pytest.raises(ValueError, match="history entry"):
        history_from_state([entry])


def test_calibrated_noise_multiplier_reaches_target_epsilon(task, partition):
    # Prepare
    target, epochs = 2.0, 3

    # Execute
    z = calibrate_noise_multiplier(
        target_epsilon=target, delta=DP.delta, sample_rate=SAMPLE_RATE, epochs=epochs
    )
    planned = epsilon_from_history([[z, SAMPLE_RATE, epochs * STEPS_PER_EPOCH]], DP.delta)
    trained = DigitsTask({**DIGITS_CONFIG, "vision.local-epochs": epochs}).train(
        task.build_model(seed=0),
        partition,
        LocalTraining(1, seed=0, dp_sgd=DPSGD(z, 1.0, DP.delta), state={}),
    )[LOCAL_EPSILON]

    # Assert: within Opacus' bisection tolerance (0.01) below the target.
    assert target - 0.01 <= planned <= target
    assert trained == pytest.approx(planned, abs=1e-12)


# --- training -------------------------------------------------------------------------


def test_dp_training_reports_cumulative_epsilon(task, partition):
    # Prepare
    model = task.build_model(seed=0)
    keys = list(model.state_dict())
    state: dict = {}

    # Execute: two rounds; the state travels as JSON, as the ClientApp stores it.
    first = task.train(model, partition, LocalTraining(1, seed=1, dp_sgd=DP, state=state))
    state = json.loads(json.dumps(state))
    second = task.train(model, partition, LocalTraining(2, seed=2, dp_sgd=DP, state=state))

    # Assert
    assert len(partition.train) == NUM_TRAIN
    assert first[NUM_EXAMPLES] == NUM_TRAIN and first[TRAIN_LOSS] > 0
    assert list(model.state_dict()) == keys
    assert 0 < first[LOCAL_EPSILON] < second[LOCAL_EPSILON]
    assert type(second[LOCAL_EPSILON]) is float
    history = [(1.0, SAMPLE_RATE, 2 * STEPS_PER_EPOCH)]  # same (z, q): one merged entry
    assert [tuple(e) for e in state[HISTORY_KEY]] == history
    accountant = RDPAccountant()
    accountant.history = history
    assert second[LOCAL_EPSILON] == pytest.approx(accountant.get_epsilon(DP.delta), abs=1e-12)
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = rdp_analysis.compute_rdp(q=SAMPLE_RATE, noise_multiplier=1.0, steps=14, orders=orders)
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=DP.delta)
    assert second[LOCAL_EPSILON] == pytest.approx(epsilon, abs=1e-6)
    # What the server re-derives the epsilon from: trainings covered, this round's steps.
    assert second[ROUNDS] == 2.0 and second[ROUND_STEPS] == STEPS_PER_EPOCH
    assert (second[ROUND_NOISE], second[ROUND_SAMPLE_RATE]) == (1.0, pytest.approx(SAMPLE_RATE))


def test_a_client_refuses_a_round_that_would_exceed_its_budget(task, partition):
    # One round costs epsilon(7 steps); a budget between one and two rounds' epsilon.
    one = epsilon_from_history([(1.0, SAMPLE_RATE, STEPS_PER_EPOCH)], DP.delta)
    two = epsilon_from_history([(1.0, SAMPLE_RATE, 2 * STEPS_PER_EPOCH)], DP.delta)
    budgeted = DPSGD(
        noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, max_epsilon=(one + two) / 2
    )
    model, state = task.build_model(seed=0), {}
    task.train(model, partition, LocalTraining(1, seed=1, dp_sgd=budgeted, state=state))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(BudgetExceeded, match=BUDGET_REFUSAL):
        task.train(model, partition, LocalTraining(2, seed=2, dp_sgd=budgeted, state=state))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not trained
    assert len(state[HISTORY_KEY]) == 1 and state[HISTORY_KEY][0][2] == STEPS_PER_EPOCH


def test_dp_training_is_secret_by_default_and_reproducible_from_its_dp_seed(task, partition):
    # Prepare: cnn has dropout and GroupNorm.
    cnn_task = DigitsTask({**DIGITS_CONFIG, "vision.model": "cnn"})
    models = [cnn_task.build_model(seed=0) for _ in range(5)]
    rng_before = torch.get_rng_state()

    # Execute: the same local seed; DP seeds given (dp.reproducible-noise) or secret.
    for model, dp_seed in zip(models, (3, 3, 4, None, None), strict=True):
        given = {} if dp_seed is None else {"dp_seed": dp_seed}
        local = LocalTraining(1, seed=7, dp_sgd=DP, state={}, **given)
        cnn_task.train(model, partition, local)

    # Assert: batch sampling and noise follow the DP seed alone, which by default
    # nobody can recompute (OS entropy).
    assert torch.equal(_weights(models[0]), _weights(models[1]))
    assert not torch.equal(_weights(models[0]), _weights(models[2]))
    assert not torch.equal(_weights(models[3]), _weights(models[4]))
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_plain_training_after_dp_training_is_unaffected(task, partition):
    # Prepare: DP-train a model, then copy its weights into a model Opacus never saw.
    model = task.build_model(seed=0)
    task.train(model, partition, LocalTraining(1, seed=1, dp_sgd=DP, state={}))
    fresh = task.build_model(seed=1)
    fresh.load_state_dict(model.state_dict())

    # Execute: the same module object trains without DP.
    metrics = task.train(model, partition, LocalTraining(2, seed=2))
    task.train(fresh, partition, LocalTraining(2, seed=2))
    model.zero_grad()
    images, labels = partition.train.images[:8], partition.train.labels[:8]
    nn.functional.cross_entropy(model(images), labels).backward()

    # Assert
    assert LOCAL_EPSILON not in metrics
    assert torch.equal(_weights(model), _weights(fresh))
    assert _opacus_leftovers(model) == []


def test_proximal_term_keeps_dp_model_closer_to_global(task, partition):
    # Prepare
    anchor = _weights(task.build_model(seed=0))

    def drift(mu: float) -> float:
        model = task.build_model(seed=0)
        local = LocalTraining(1, seed=1, proximal_mu=mu, dp_sgd=DP, state={})
        task.train(model, partition, local)
        return float((_weights(model) - anchor).norm())

    # Execute / Assert: same seed, so the same batches and noise.
    assert drift(5.0) < drift(0.0)


def test_incompatible_model_raises_value_error_naming_model(task, partition):
    # Prepare
    batchnorm_net = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 10)
    )

    # Execute / Assert
    with pytest.raises(ValueError, match=r"vision\.model = 'lenet'.*BatchNorm"):
        task.train(batchnorm_net, partition, LocalTraining(1, seed=0, dp_sgd=DP, state={}))
    assert _opacus_leftovers(batchnorm_net) == []


# --- the proximal gradient under DP-SGD -------------------------------------------------


def _private_step_setup(proximal_in_loss: bool):
    """A linear model, its drifted copy, and one DP-SGD step without noise or clipping."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 5, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    model = nn.Linear(5, 3)
    global_params = snapshot_parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator))
    reference = copy.deepcopy(model)
    mu = 0.5
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    add = partial(add_proximal_gradient, model, global_params, mu)
    private = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
        dp=DPSGD(noise_multiplier=0.0, max_grad_norm=1e6, delta=1e-5), generator_seed=0,
        public_gradient=None if proximal_in_loss else add,
    )  # fmt: skip
    with private:
        private.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[:8]), y[:8])
        if proximal_in_loss:
            loss = loss + proximal_term(model, global_params, mu)
        loss.backward()
        private.optimizer.step()
    return model, reference, global_params, mu, x[:8], y[:8]


def _sgd_step(model, loss) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss.backward()
    optimizer.step()


def test_public_proximal_gradient_equals_plain_step_on_full_loss():
    # Prepare: without noise or clipping, DP-SGD on a batch of the expected size is SGD.
    model, reference, global_params, mu, x, y = _private_step_setup(proximal_in_loss=False)

    # Execute
    loss = nn.functional.cross_entropy(reference(x), y)
    _sgd_step(reference, loss + proximal_term(reference, global_params, mu))

    # Assert
    torch.testing.assert_close(_weights(model), _weights(reference))


def test_proximal_term_in_loss_is_dropped_byopacus_names():
    # Prepare: why the proximal gradient is added after the noise, not in the loss.
    model, reference, _, _, x, y = _private_step_setup(proximal_in_loss=True)

    # Execute
    _sgd_step(reference, nn.functional.cross_entropy(reference(x), y))

    # Assert
    torch.testing.assert_close(_weights(model), _weights(reference))


def test_add_proximal_gradient_matches_autograd():
    # Prepare
    model = nn.Linear(3, 2)
    global_params = [p.detach() + 1.0 for p in model.parameters()]

    # Execute
    proximal_term(model, global_params, 0.3).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    add_proximal_gradient(model, global_params, 0.3)

    # Assert: d/dw (mu/2)||w - w_g||^2 = mu (w - w_g) = -0.3 everywhere
    for p, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad)
        torch.testing.assert_close(p.grad, torch.full_like(p, -0.3))


def test_target_epsilon_is_met_after_the_planned_rounds():
    from dataclasses import replace as _replace

    from tasks.base import DPSGD, LocalTraining
    from tasks.vision import DigitsTask

    task = DigitsTask({"seed": 1, "vision.lr": 0.05})
    partition = task.load_partition(0, 5)
    model = task.build_model(1)
    dp = DPSGD(
        noise_multiplier=99.0, max_grad_norm=1.0, delta=1e-5, target_epsilon=3.0, planned_rounds=3
    )
    state: dict = {}
    epsilons = []
    for rnd in range(1, 4):
        metrics = task.train(
            model, partition, LocalTraining(rnd, seed=rnd, dp_sgd=dp, state=state)
        )
        epsilons.append(metrics["local-epsilon"])
    # The multiplier given (99) was replaced by the calibrated one, cached in the state.
    calibrated = state["dpsgd-calibrated-noise-multiplier"]
    assert 0.3 < calibrated < 99.0
    assert epsilons[0] < epsilons[1] < epsilons[2] <= 3.0
    assert epsilons[2] == pytest.approx(3.0, rel=0.02)
    plain = _replace(dp, target_epsilon=0.0)
    assert task._calibrated(LocalTraining(1, 1, dp_sgd=plain), 0.1) is plain


def test_importing_opacus_leaves_no_root_log_handler_behind():
    # Opacus' basicConfig() would print every Flower log line twice.
    import logging

    from privacy import dpsgd

    dpsgd.opacus_names()  # Opacus is imported on first use
    formats = [getattr(h.formatter, "_fmt", None) for h in logging.root.handlers]
    assert dpsgd._OPACUS_LOG_FORMAT not in formats
