"""Adaptive mu, EMA and model divergence (the SmartFedProx study, sections 2.3 and 3) against
hand-computed values."""

import math

import numpy as np
import pytest
import torch

from tasks.adaptive_mu import adaptive_mu, divergence_factor, ema, epoch_factor, model_divergence

BOUNDS = {"mu_min": 0.001, "mu_max": 10.0}


def _mu(base, h, g, epochs, **bounds):
    return adaptive_mu(
        base_mu=base,
        historical_divergence=h,
        global_avg_divergence=g,
        local_epochs=epochs,
        **(BOUNDS | bounds),
    )


def test_divergent_client_gets_the_upper_factor_times_the_epoch_factor():
    # Prepare: h/g = 5: 1 + 0.5 * (5 - 1) = 3, clamped to 2; 3 epochs: 1 + 0.1 * 2 = 1.2
    base, h, g, epochs = 0.1, 5.0, 1.0, 3

    # Execute
    mu = _mu(base, h, g, epochs)

    # Assert
    assert divergence_factor(h, g) == 2.0
    assert epoch_factor(epochs) == pytest.approx(1.2)
    assert mu == pytest.approx(0.24)


def test_ratio_three_reaches_the_factor_two_up_to_the_epsilon():
    # h/(g + 1e-8) = 3 / 1.00000001: 1 + 0.5 * (2.99999997 - 1) = 1.999999985
    assert divergence_factor(3.0, 1.0) == pytest.approx(1.999999985, abs=1e-12)
    assert _mu(0.1, 3.0, 1.0, 3) == pytest.approx(0.1 * 1.999999985 * 1.2, abs=1e-12)


def test_calm_client_gets_a_dampened_lower_factor():
    # h/g = 0.25: 1 + 0.5 * (0.25 - 1) = 0.625; one epoch: factor 1
    assert divergence_factor(0.5, 2.0) == pytest.approx(0.625)
    assert _mu(0.1, 0.5, 2.0, 1) == pytest.approx(0.0625)


def test_factor_approaches_but_never_passes_one_half():
    # ratio -> 0 gives 1 + 0.5 * (0 - 1) = 0.5: the lower clamp is the limit
    assert divergence_factor(1e-12, 1.0) == pytest.approx(0.5, abs=1e-9)
    assert divergence_factor(1e-12, 1.0) >= 0.5


@pytest.mark.parametrize(("h", "g"), [(0.0, 1.0), (2.0, 0.0), (0.0, 0.0)])
def test_no_history_leaves_the_divergence_factor_at_one(h, g):
    assert divergence_factor(h, g) == 1.0
    assert _mu(0.1, h, g, 2) == pytest.approx(0.1 * 1.1)


def test_result_is_clamped_to_mu_min_and_mu_max():
    # 0.1 * 2 * 1.2 = 0.24 > mu_max 0.2;  0.1 * 0.625 * 1 = 0.0625 < mu_min 0.08
    assert _mu(0.1, 5.0, 1.0, 3, mu_min=0.01, mu_max=0.2) == 0.2
    assert _mu(0.1, 0.5, 2.0, 1, mu_min=0.08, mu_max=1.0) == 0.08


def test_base_mu_zero_stays_zero_unless_mu_min_lifts_it():
    assert _mu(0.0, 5.0, 1.0, 3, mu_min=0.0) == 0.0
    assert _mu(0.0, 5.0, 1.0, 3, mu_min=0.05) == 0.05


@pytest.mark.parametrize(
    ("settings", "name"),
    [({"mu_min": 0.5, "mu_max": 0.1}, "mu_min"), ({"local_epochs": 0}, "local_epochs")],
)
def test_bad_settings_are_named(settings, name):
    arguments = {
        "base_mu": 0.1,
        "historical_divergence": 1.0,
        "global_avg_divergence": 1.0,
        "local_epochs": 1,
        **BOUNDS,
    }
    with pytest.raises(ValueError, match=name):
        adaptive_mu(**(arguments | settings))


def test_ema_sequence_from_zero():
    # Prepare: the SmartFedProx study's history starts at 0.0, alpha 0.3
    reports = [1.0, 2.0, 4.0]

    # Execute
    values, previous = [], 0.0
    for report in reports:
        previous = ema(previous, report)
        values.append(previous)

    # Assert: 0.3; 0.3*2 + 0.7*0.3 = 0.81; 0.3*4 + 0.7*0.81 = 1.767
    assert values == pytest.approx([0.3, 0.81, 1.767])


def test_ema_alpha_extremes_and_range():
    assert ema(5.0, 1.0, alpha=1.0) == 1.0
    assert ema(5.0, 1.0, alpha=0.0) == 5.0
    with pytest.raises(ValueError, match="alpha"):
        ema(0.0, 1.0, alpha=1.5)


def test_divergence_by_hand():
    local = [np.array([[1.0, 2.0]]), np.array([3.0])]
    global_ = [np.zeros((1, 2)), np.zeros(1)]
    assert model_divergence(local, global_) == pytest.approx(math.sqrt(14.0))


def test_divergence_matches_numpy_norm_for_arrays_and_tensors():
    # Prepare
    rng = np.random.default_rng(3)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    local = [rng.normal(size=s) for s in shapes]
    global_ = [rng.normal(size=s) for s in shapes]
    flat = np.concatenate([(a - b).ravel() for a, b in zip(local, global_, strict=True)])

    # Execute
    from_arrays = model_divergence(local, global_)
    from_tensors = model_divergence(
        [torch.from_numpy(a) for a in local], [torch.from_numpy(b) for b in global_]
    )

    # Assert
    assert from_arrays == pytest.approx(np.linalg.norm(flat), rel=1e-12)
    assert from_tensors == pytest.approx(np.linalg.norm(flat), rel=1e-12)


def test_divergence_of_trainable_parameters_is_detached_and_float64():
    net = torch.nn.Linear(2, 1)
    snapshot = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        net.weight.add_(torch.tensor([[3.0, 4.0]]))

    assert model_divergence(list(net.parameters()), snapshot) == pytest.approx(5.0, rel=1e-6)


def test_divergence_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="tensors"):
        model_divergence([np.zeros(2)], [np.zeros(2), np.zeros(1)])
    with pytest.raises(ValueError, match="shape"):
        model_divergence([np.zeros(2)], [np.zeros(3)])
