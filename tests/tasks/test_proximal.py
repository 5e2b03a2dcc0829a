"""FedProx proximal term: value and gradient against hand computations."""

import pytest
import torch
from torch import nn

from tasks.proximal import proximal_term, snapshot_parameters


def _small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _perturb(model: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator))


def test_gradient_is_mu_times_drift():
    # Prepare
    model = _small_model()
    snapshot = snapshot_parameters(model)
    _perturb(model)
    mu = 0.3

    # Execute
    proximal_term(model, snapshot, mu).backward()

    # Assert: d/dw (mu/2)||w - w_g||^2 = mu (w - w_g)
    for p, g in zip(model.parameters(), snapshot, strict=True):
        torch.testing.assert_close(p.grad, mu * (p.detach() - g))


def test_gradient_matches_autograd_of_explicit_formula():
    # Prepare
    model = _small_model()
    snapshot = snapshot_parameters(model)
    _perturb(model)
    mu = 0.7
    explicit_model = _small_model()
    explicit_model.load_state_dict(model.state_dict())

    # Execute
    proximal_term(model, snapshot, mu).backward()
    explicit = 0.0
    for w, g in zip(explicit_model.parameters(), snapshot, strict=True):
        explicit = explicit + (mu / 2) * torch.sum((w - g) ** 2)
    explicit.backward()

    # Assert
    for p, q in zip(model.parameters(), explicit_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_value_on_two_parameter_model():
    # Prepare: w = (1, 2) [weight, bias], w_global = (0.5, -1)
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(2.0)
    snapshot = [torch.tensor([[0.5]]), torch.tensor([-1.0])]

    # Execute
    value = proximal_term(model, snapshot, mu=0.4)

    # Assert: (0.4 / 2) * (0.5^2 + 3^2) = 0.2 * 9.25 = 1.85
    assert value.item() == pytest.approx(1.85)


def test_zero_at_snapshot():
    model = _small_model()

    assert proximal_term(model, snapshot_parameters(model), mu=1.0).item() == 0.0


def test_mismatched_snapshot_raises():
    # Prepare
    model = _small_model()
    snapshot = snapshot_parameters(model)[:-1]

    # Execute / Assert
    with pytest.raises(ValueError, match="trainable tensors"):
        proximal_term(model, snapshot, mu=0.1)
