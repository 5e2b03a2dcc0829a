"""Front-loaded DP client modes (privacy.frontloaded): CG-NG, CG-NP, CP-NP.

Expected values are computed by hand on models whose gradients are known in closed
form: ``nn.Linear(2, 1, bias=False)`` with loss ``mean(output)`` has batch gradient
``mean(x)`` and per-example gradient ``x``, whatever the weights. The per-example
epsilon is checked against Google's dp-accounting RDP accountant.
"""

import copy
import json

import dp_accounting
import pytest
import torch
from dp_accounting import rdp as dp_rdp
from torch import nn

from privacy.dpsgd import HISTORY_KEY, epsilon_from_history
from privacy.frontloaded import (
    CLIP_FRACTION,
    CLIPPED,
    NOISE_STD,
    OPTIMIZER_STEPS,
    UPDATE_NORM,
    ConfigError,
    FrontLoadedDP,
    clip_and_noise_delta,
    train_clipped_gradients,
)

LR = 0.1


def mean_output(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Loss whose gradient w.r.t. a bias-free linear layer's weight is ``mean(x)``."""
    return outputs.mean()


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets)


def zero_linear() -> nn.Linear:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model


def batches(*xs: list[list[float]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.tensor(x), torch.zeros(len(x), 1)) for x in xs]


def regression_data(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, generator=gen), torch.randn(2, 2, generator=gen))
            for _ in range(4)]  # fmt: skip


def train(model, data, dp, *, epochs=1, seed=0, state=None, optimizer=None, loss_fn=mse):
    """CG training with plain SGD (lr 0.1) and noise from a generator seeded ``seed``."""
    return train_clipped_gradients(
        model, data, dp=dp, local_epochs=epochs,
        optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=LR), loss_fn=loss_fn,
        generator=torch.Generator().manual_seed(seed), device="cpu", state=state,
    )  # fmt: skip


def draws(seed: int, shapes: list[torch.Size], times: int = 1) -> list[list[torch.Tensor]]:
    """The standard normals a generator seeded ``seed`` yields, per parameter, per step."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(times)]


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


# --- settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"mode": "cg"}, "'privacy'.*'cg-ng', 'cg-np', 'cp-np'"),
     ({"clip": 0.0}, "'dp.clip-norm'.*> 0"),
     ({"clip": float("nan")}, "'dp.clip-norm'"),
     ({"sigma": -0.1}, "'dp.noise-std'.*>= 0"),
     ({"delta": 1.0}, "'dp.target-delta'"),
     ({"mode": "cg-np", "per_example": True}, "'cg-ng'.*'dp.per-example' = true.*'dp-sgd'"),
     ({"mode": "cp-np", "per_example": True}, "only to 'privacy' = 'cg-ng'")],
)  # fmt: skip
def test_invalid_settings_name_the_key(kwargs, match):
    settings = {"mode": "cg-ng", "clip": 1.0, "sigma": 0.1, **kwargs}
    with pytest.raises(ConfigError, match=match):
        FrontLoadedDP(**settings)


def test_cp_np_is_not_a_training_mode():
    with pytest.raises(ValueError, match="'cg-ng', 'cg-np'"):
        train(zero_linear(), batches([[1.0, 0.0]]), FrontLoadedDP("cp-np", 1.0, 0.0),
              loss_fn=mean_output)  # fmt: skip


# --- CG-NG / CG-NP ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cg-ng", "cg-np"])
def test_each_batch_gradient_is_clipped_then_averaged(mode):
    # Prepare: batch gradients mean(x) = [6, 8] (norm 10, clipped to [0.6, 0.8] at C=1)
    # and [0.3, 0.4] (norm 0.5, kept); their average is [0.45, 0.6].
    model, factor = zero_linear(), 1.0 / (10.0 + 1e-6)
    data = batches([[6.0, 8.0], [6.0, 8.0]], [[0.3, 0.4]])

    # Execute: 3 epochs, one step each, no noise.
    metrics = train(model, data, FrontLoadedDP(mode, 1.0, 0.0), epochs=3, loss_fn=mean_output)

    # Assert
    average = (torch.tensor([6.0, 8.0]) * factor + torch.tensor([0.3, 0.4])) / 2
    torch.testing.assert_close(model.weight.detach()[0], -3 * LR * average)
    assert metrics[CLIP_FRACTION] == 0.5
    assert metrics[OPTIMIZER_STEPS] == 3
    assert metrics["num-examples"] == 3
    assert metrics[NOISE_STD] == 0.0


def test_cg_ng_adds_noise_once_in_the_final_step():
    # Prepare: a model whose gradient depends on the weights; same data order.
    model = nn.Linear(3, 2)
    noisy, clean = copy.deepcopy(model), copy.deepcopy(model)
    shapes = [p.shape for p in model.parameters()]

    # Execute
    train(clean, regression_data(), FrontLoadedDP("cg-ng", 0.5, 0.0), epochs=3, seed=7)
    train(noisy, regression_data(), FrontLoadedDP("cg-ng", 0.5, 0.3), epochs=3, seed=7)

    # Assert: the runs differ by -lr x the first noise drawn (noise in step 3 only).
    (noise,) = draws(7, shapes)
    for p_noisy, p_clean, xi in zip(noisy.parameters(), clean.parameters(), noise, strict=True):
        torch.testing.assert_close(p_noisy - p_clean, -LR * 0.3 * xi, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "dp", [FrontLoadedDP("cg-ng", 1.0, 0.1), FrontLoadedDP("cg-np", 1.0, 0.1),
           FrontLoadedDP("cg-ng", 1.0, 0.1, per_example=True)],
)  # fmt: skip
def test_one_optimizer_step_per_local_epoch(dp):
    # Prepare
    model = nn.Linear(3, 2)
    optimizer = CountingSGD(model.parameters(), lr=LR)

    # Execute
    metrics = train(model, regression_data(), dp, epochs=4, state={}, optimizer=optimizer)

    # Assert: 4 batches per epoch, still 4 steps.
    assert optimizer.steps == 4
    assert metrics[OPTIMIZER_STEPS] == 4


def test_cg_np_noises_every_parameter_with_std_sigma_and_no_buffer():
    # Prepare: 10 000 weights + 100 biases; a buffer that must not change.
    model = nn.Linear(100, 100)
    model.register_buffer("marker", torch.arange(5.0))
    noisy, clean = copy.deepcopy(model), copy.deepcopy(model)
    data = [(torch.ones(4, 100), torch.zeros(4, 100))]

    # Execute
    train(clean, data, FrontLoadedDP("cg-np", 1.0, 0.0), epochs=2)
    train(noisy, data, FrontLoadedDP("cg-np", 1.0, 0.2), epochs=2)

    # Assert
    noise = torch.cat([(a - b).flatten() for a, b in
                       zip(noisy.parameters(), clean.parameters(), strict=True)])  # fmt: skip
    assert noise.numel() == 10_100
    assert abs(noise.std().item() / 0.2 - 1) < 0.03
    assert abs(noise.mean().item()) < 3 * 0.2 / 100
    torch.testing.assert_close(noisy.marker, torch.arange(5.0))


def test_training_reproducible_from_generator_and_global_rng_untouched():
    # Prepare
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    second.load_state_dict(first.state_dict())
    rng_before = torch.get_rng_state()

    # Execute
    for model in (first, second):
        train(model, regression_data(), FrontLoadedDP("cg-np", 0.5, 0.1), epochs=2, seed=5)

    # Assert
    assert torch.equal(torch.get_rng_state(), rng_before)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


# --- per-example clipping (CG-NG) -----------------------------------------------------


def test_per_example_clips_each_example_gradient():
    # Prepare: per-example gradients x: [3, 4] -> [0.6, 0.8]; [0.3, 0.4] kept;
    # [0, 2] -> [0, 1]. Mean over the 3 examples (per batch it would be [0.3, 0.9]).
    model = zero_linear()
    data = batches([[3.0, 4.0], [0.3, 0.4]], [[0.0, 2.0]])
    dp = FrontLoadedDP("cg-ng", clip=1.0, sigma=0.0, per_example=True)

    # Execute
    metrics = train(model, data, dp, state={}, loss_fn=mean_output)

    # Assert
    clipped = [torch.tensor([3.0, 4.0]) / (5 + 1e-6), torch.tensor([0.3, 0.4]),
               torch.tensor([0.0, 2.0]) / (2 + 1e-6)]  # fmt: skip
    torch.testing.assert_close(model.weight.detach()[0], -LR * sum(clipped) / 3)
    assert metrics[CLIP_FRACTION] == pytest.approx(2 / 3)
    assert not [n for p in model.parameters() for n in ("grad_sample", "_forward_counter")
                if hasattr(p, n)] and not model._forward_hooks  # fmt: skip


def test_per_example_adds_noise_in_every_step():
    # Prepare: constant gradients, so the 3 steps' noises add up linearly.
    dp_clean = FrontLoadedDP("cg-ng", 1.0, 0.0, per_example=True)
    dp_noisy = FrontLoadedDP("cg-ng", 1.0, 0.05, per_example=True)
    clean, noisy = zero_linear(), zero_linear()
    data = batches([[3.0, 4.0], [0.3, 0.4]])

    # Execute
    for model, dp in ((clean, dp_clean), (noisy, dp_noisy)):
        train(model, data, dp, epochs=3, seed=11, state={}, loss_fn=mean_output)

    # Assert
    steps = draws(11, [noisy.weight.shape], times=3)
    expected = -LR * 0.05 * sum(step[0] for step in steps)
    torch.testing.assert_close(noisy.weight - clean.weight, expected, atol=1e-7, rtol=0)


def test_per_example_epsilon_is_cumulative_full_batch_rdp():
    # Prepare: n = 8 examples, sigma = 0.25, C = 1 -> noise multiplier z = 2.
    dp = FrontLoadedDP("cg-ng", clip=1.0, sigma=0.25, per_example=True, delta=1e-5)
    model, data, state = nn.Linear(3, 2), regression_data(), {}

    # Execute: two rounds of 2 epochs; the state travels as JSON.
    first = train(model, data, dp, epochs=2, state=state)["local-epsilon"]
    state = json.loads(json.dumps(state))
    second = train(model, data, dp, epochs=2, seed=1, state=state)["local-epsilon"]

    # Assert
    assert state[HISTORY_KEY] == [[2.0, 1.0, 4]]
    assert 0 < first < second
    assert second == pytest.approx(epsilon_from_history([[2.0, 1.0, 4]], 1e-5))
    orders = [float(a) for a in range(2, 64)]
    accountant = dp_rdp.RdpAccountant(orders=orders)
    accountant.compose(dp_accounting.GaussianDpEvent(2.0), 4)
    assert epsilon_from_history(state[HISTORY_KEY], 1e-5, orders) == pytest.approx(
        accountant.get_epsilon(1e-5), abs=1e-6
    )


def test_per_example_needs_the_client_state():
    dp = FrontLoadedDP("cg-ng", 1.0, 0.1, per_example=True)
    with pytest.raises(ValueError, match="state"):
        train(zero_linear(), batches([[1.0, 0.0]]), dp, state=None, loss_fn=mean_output)


# --- CP-NP ------------------------------------------------------------------------------


def test_cp_np_clips_the_update_by_hand():
    # Prepare: ||dw|| = ||(3, 0, 4)|| = 5 > C = 1.
    delta = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]

    # Execute
    noisy, metrics = clip_and_noise_delta(delta, clip=1.0, sigma=0.0, generator=torch.Generator())

    # Assert: scaled by min(1, 1 / (5 + 1e-6)); input untouched.
    factor = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(noisy[0], torch.tensor([3.0 * factor, 0.0]))
    torch.testing.assert_close(noisy[1], torch.tensor([[4.0 * factor]]))
    assert torch.linalg.vector_norm(torch.cat([t.flatten() for t in noisy])) <= 1.0
    assert metrics == {UPDATE_NORM: 5.0, CLIPPED: 1.0, NOISE_STD: 0.0}
    assert delta[0].tolist() == [3.0, 0.0]


def test_cp_np_keeps_a_small_update():
    delta = [torch.tensor([0.3, 0.4])]
    noisy, metrics = clip_and_noise_delta(delta, clip=1.0, sigma=0.0, generator=torch.Generator())
    assert torch.equal(noisy[0], delta[0])
    assert metrics[CLIPPED] == 0.0
    assert metrics[UPDATE_NORM] == pytest.approx(0.5)


def test_cp_np_scales_an_update_of_norm_exactly_c_by_the_seed_formula():
    # min(1, C / (||dw|| + 1e-6)) < 1 even at ||dw|| = C (float64 to see the 1e-6).
    delta = [torch.tensor([0.6, 0.8], dtype=torch.float64)]
    noisy, metrics = clip_and_noise_delta(delta, clip=1.0, sigma=0.0, generator=torch.Generator())
    torch.testing.assert_close(noisy[0], delta[0] / (1.0 + 1e-6), rtol=1e-15, atol=0)
    assert metrics[CLIPPED] == 1.0


def test_cp_np_adds_noise_with_std_sigma_from_the_generator():
    # Prepare
    delta = [torch.full((100, 100), 0.01), torch.zeros(100)]
    rng_before = torch.get_rng_state()

    # Execute
    noisy, metrics = clip_and_noise_delta(
        delta, clip=1.0, sigma=0.3, generator=torch.Generator().manual_seed(4)
    )

    # Assert: clipped (norm 1.0 -> factor 1 / (1 + 1e-6)) plus the generator's draws.
    factor = 1.0 / (1.0 + 1e-6)
    noise = draws(4, [t.shape for t in delta])[0]
    for out, d, xi in zip(noisy, delta, noise, strict=True):
        torch.testing.assert_close(out, d * factor + 0.3 * xi)
    sample = torch.cat([(o - d * factor).flatten() for o, d in zip(noisy, delta, strict=True)])
    assert abs(sample.std().item() / 0.3 - 1) < 0.03
    assert metrics[NOISE_STD] == 0.3 and metrics[CLIPPED] == 1.0
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_cp_np_rejects_bad_settings():
    with pytest.raises(ConfigError, match=r"'dp\.clip-norm'"):
        clip_and_noise_delta([torch.ones(2)], clip=0.0, sigma=0.1, generator=torch.Generator())


def test_metric_names_are_the_tasks():
    """privacy/ sits below tasks/, so it spells the task metrics it reports itself."""
    from privacy import dpsgd, frontloaded
    from tasks import base

    assert (frontloaded.NUM_EXAMPLES, frontloaded.TRAIN_LOSS) == (
        base.NUM_EXAMPLES,
        base.TRAIN_LOSS,
    )
    assert dpsgd.LOCAL_EPSILON == base.LOCAL_EPSILON == "local-epsilon"
