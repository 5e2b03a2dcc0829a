"""Models: output shape on digits and CIFAR-sized inputs, seeded initialisation."""

import pytest
import torch
from torch import nn

from tasks.vision.models import MODEL_NAMES, build_model

INPUTS = [(1, 8), (3, 32)]  # (channels, image side): digits and CIFAR-10


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize(("channels", "side"), INPUTS)
def test_model_outputs_logits_per_class(name, channels, side):
    # Prepare
    model = build_model(name, channels, num_classes=10, image_size=side, seed=0)
    images = torch.randn(4, channels, side, side)

    # Execute
    logits = model.eval()(images)

    # Assert
    assert logits.shape == (4, 10)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_same_weights_different_seed_different(name):
    # Prepare / Execute
    first = _weights(build_model(name, 1, 10, 8, seed=7))
    again = _weights(build_model(name, 1, 10, 8, seed=7))
    other = _weights(build_model(name, 1, 10, 8, seed=8))

    # Assert
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_build_model_leaves_global_rng_untouched():
    # Prepare
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    # Execute
    build_model("lenet", 1, 10, 8, seed=0)

    # Assert
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_no_batchnorm(name):
    # Opacus (DP-SGD) needs per-example gradients: BatchNorm is replaced by GroupNorm.
    model = build_model(name, 3, 10, 32, seed=0)

    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg", 1, 10, 8, seed=0)
