"""Models: output shape on digits and CIFAR-sized inputs, seeded initialisation, a DP-SGD
epoch of each."""

import pytest
import torch
from torch import nn

from privacy.dpsgd import check_compatible
from tasks.base import DPSGD, LocalTraining
from tasks.vision.data import ClientPartition, TensorSplit
from tasks.vision.models import MODEL_NAMES, build_model
from tasks.vision.task import DigitsTask

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


def _conv(c_in: int, c_out: int, k: int) -> int:
    return c_in * c_out * k * k + c_out


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


# frontloaded-dp-hfl's CIFAR-10 CNNs (HierFL): parameter counts from their layer shapes by hand.
# cnn-complex-2 on 32x32: 32 -5-> 28 -pool-> 14 -5-> 10 -pool-> 5, so 64 * 5 * 5 features.
CNN2_CIFAR = _conv(3, 64, 5) + _conv(64, 64, 5) + _linear(64 * 5 * 5, 200) + _linear(200, 10)
# cnn-complex-3 on 32x32: three pools, 256 * 4 * 4 = 4096 features; GroupNorm (like
# frontloaded-dp-hfl's BatchNorm) has a weight and a bias per channel after convs 1, 3 and 5.
CNN3_CIFAR = (
    _conv(3, 32, 3) + 2 * 32 + _conv(32, 64, 3)
    + _conv(64, 128, 3) + 2 * 128 + _conv(128, 128, 3)
    + _conv(128, 256, 3) + 2 * 256 + _conv(256, 256, 3)
    + _linear(4096, 1024) + _linear(1024, 512) + _linear(512, 10)
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "channels", "side", "expected"),
    [("cnn-complex-2", 3, 32, CNN2_CIFAR),
     ("cnn-complex-3", 3, 32, CNN3_CIFAR),
     # MNIST: 28 -5-> 24 -pool-> 12 -5-> 8 -pool-> 4
     ("cnn-complex-2", 1, 28, _conv(1, 64, 5) + _conv(64, 64, 5) + _linear(64 * 4 * 4, 200)
      + _linear(200, 10)),
     # digits: padded convolutions keep 8 -> 8 -pool-> 4 -> 4 -pool-> 2
     ("cnn-complex-2", 1, 8, _conv(1, 64, 5) + _conv(64, 64, 5) + _linear(64 * 2 * 2, 200)
      + _linear(200, 10)),
     # MNIST: 28 -> 14 -> 7 -> 3, so 256 * 3 * 3 features
     ("cnn-complex-3", 1, 28, CNN3_CIFAR - _conv(3, 32, 3) + _conv(1, 32, 3)
      - _linear(4096, 1024) + _linear(256 * 3 * 3, 1024))],
)  # fmt: skip
def test_frontloaded_cifar_cnn_parameter_counts(name, channels, side, expected):
    model = build_model(name, channels, num_classes=10, image_size=side, seed=0)

    assert sum(p.numel() for p in model.parameters()) == expected


def test_cifar_cnn_counts_match_frontloaded_dp_hfl():
    # frontloaded-dp-hfl's cifar_cnn_2conv(10, 200) and cifar_cnn_3conv (BatchNorm counted as 2 per
    # channel) have 429,538 and 5,852,170 parameters.
    assert (CNN2_CIFAR, CNN3_CIFAR) == (429_538, 5_852_170)


@pytest.mark.parametrize("name", ["cnn-complex-2", "cnn-complex-3"])
def test_frontloaded_cifar_cnns_work_with_dp_sgd_and_many_classes(name):
    # Prepare
    model = build_model(name, 1, num_classes=62, image_size=28, seed=0)

    # Execute / Assert: Opacus accepts them (no BatchNorm), and the head fits 62 classes.
    check_compatible(model, name)
    assert model.eval()(torch.randn(2, 1, 28, 28)).shape == (2, 62)


def test_mlp_is_the_peer_workloads_64_64_10():
    # The shared peer workload's model: 64 -> 64 -> 10 ReLU, 4 810 weights, PyTorch's
    # default initialisation (nn.Linear's), so the same seed gives the peers' weights.
    model = build_model("mlp", 1, 10, 8, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 64 * 64 + 64 + 64 * 10 + 10
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    check_compatible(model, "mlp")  # DP-SGD works on it


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_trains_a_dp_sgd_epoch(name):
    # Prepare: a client of 16 random digits-shaped images (small: fast); Opacus' hooks
    # on the model. (torchvision's in-place ReLUs failed here before models.out_of_place.)
    gen = torch.Generator().manual_seed(0)
    split = TensorSplit(torch.randn(16, 1, 8, 8, generator=gen), torch.arange(16) % 10)
    task = DigitsTask({"vision.model": name, "vision.local-epochs": 1, "vision.batch-size": 8})
    model = task.build_model(0)
    before = _weights(model)
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)

    # Execute
    metrics = task.train(
        model, ClientPartition(0, 1, split, split), LocalTraining(1, seed=1, dp_sgd=dp)
    )

    # Assert: noisy steps moved the weights, and the accountant charged them.
    assert metrics["local-epsilon"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert not any(getattr(m, "inplace", False) for m in model.modules())


def test_resnet18_is_torchvisions_with_the_same_weights_and_outputs():
    # Prepare: torchvision's resnet18 as models.resnet18 built it before the out-of-place
    # block (GroupNorm, CIFAR stem), from the same seed.
    import torchvision

    from tasks.vision.models import group_norm

    torch.manual_seed(3)
    reference = torchvision.models.resnet18(weights=None, num_classes=10, norm_layer=group_norm)
    reference.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    reference.maxpool = nn.Identity()
    nn.init.kaiming_normal_(reference.conv1.weight, mode="fan_out", nonlinearity="relu")
    x = torch.randn(2, 3, 32, 32)

    # Execute
    model = build_model("resnet18", 3, 10, 32, seed=3)

    # Assert
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(_weights(model), _weights(reference), strict=True)
    )
    assert torch.allclose(model.eval()(x), reference.eval()(x), atol=1e-6)
