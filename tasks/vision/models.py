"""Image classifiers for 8x8 to 32x32 inputs, Opacus-compatible (no BatchNorm).

Design notes: ``docs/notes.md``, ``tasks.vision.models``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch
from torch import nn

MODEL_NAMES = (
    "mlp",
    "lenet",
    "cnn",
    "cnn-complex-2",
    "cnn-complex-3",
    "resnet18",
    "mobilenet_v2",
)
MLP_HIDDEN = 64  # the peer workload's hidden width
SMALL_IMAGE_MAX = 64  # images up to this side use the CIFAR-style stem


def group_norm(num_channels: int) -> nn.GroupNorm:
    """GroupNorm with ``gcd(num_channels, 32)`` groups (32 where the channels allow)."""
    return nn.GroupNorm(math.gcd(num_channels, 32), num_channels)


def init_he(module: nn.Module) -> None:
    """He-normal weights and zero biases for the conv and linear layers (ReLU nets)."""
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


def flattened_size(features: nn.Module, in_channels: int, image_size: int) -> int:
    """Number of features ``features`` outputs for one image (dummy forward pass)."""
    with torch.no_grad():
        out = features(torch.zeros(1, in_channels, image_size, image_size))
    return int(out.numel())


class LeNet5(nn.Module):
    """LeNet-5: conv5x5(6) - pool - conv5x5(16) - pool - fc120 - fc84 - fc.

    Parameters
    ----------
    in_channels, num_classes, image_size : int
        Input channels, output classes and image side (>= 8).
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        # 32x32 runs the classic unpadded stack; 28x28 pads conv1 (as for MNIST);
        # below 16 pixels both convolutions keep the spatial size.
        pad1 = 0 if image_size >= 32 else 2
        pad2 = 0 if image_size >= 16 else 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=pad1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=pad2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(flattened_size(self.features, in_channels, image_size), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )
        init_he(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.classifier(self.features(x))


class SmallCNN(nn.Module):
    """Three conv-GroupNorm-ReLU-maxpool blocks (32, 64, 128) and an MLP head.

    Parameters
    ----------
    in_channels, num_classes, image_size : int
        Input channels, output classes and image side (>= 8).
    dropout : float
        Dropout before the last layer.
    """

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, dropout: float = 0.25
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for width in (32, 64, 128):
            layers += [
                nn.Conv2d(channels, width, kernel_size=3, padding=1),
                group_norm(width),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            channels = width
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.classifier = nn.Sequential(
            nn.Linear(flattened_size(self.features, in_channels, image_size), 256),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(256, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.classifier(self.features(x))


class CifarCNN2Conv(nn.Module):
    """frontloaded-dp-hfl's ``cnn_complex_2``: conv5x5(64)-pool-conv5x5(64)-pool-fc(200)-fc.

    Parameters
    ----------
    in_channels, num_classes, image_size : int
        Input channels, output classes and image side (>= 8).
    hidden : int
        Units of the hidden layer (200 in frontloaded-dp-hfl).
    """

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, hidden: int = 200
    ) -> None:
        super().__init__()
        pad = 0 if image_size >= 16 else 2  # 16x16 and up: frontloaded-dp-hfl's unpadded stack
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=5, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, kernel_size=5, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(flattened_size(self.features, in_channels, image_size), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.classifier(self.features(x))


def conv_block(channels: tuple[int, int, int], dropout: float = 0.0) -> list[nn.Module]:
    """conv3x3-GroupNorm-ReLU-conv3x3-ReLU-maxpool(2) [-Dropout2d], ``(in, mid, out)``."""
    c_in, c_mid, c_out = channels
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_mid, kernel_size=3, padding=1),
        group_norm(c_mid),
        nn.ReLU(),
        nn.Conv2d(c_mid, c_out, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
    ]
    return [*layers, nn.Dropout2d(dropout)] if dropout > 0 else layers


class CifarCNN3Conv(nn.Module):
    """frontloaded-dp-hfl's ``cnn_complex_3``: three two-conv blocks and a 1024-512 MLP head.

    Parameters
    ----------
    in_channels, num_classes, image_size : int
        Input channels, output classes and image side (>= 8).
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *conv_block((in_channels, 32, 64)),
            *conv_block((64, 128, 128), dropout=0.05),
            *conv_block((128, 256, 256)),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.1),
            nn.Linear(flattened_size(self.features, in_channels, image_size), 1024),
            nn.ReLU(),
            nn.Linear(1024, 512),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.classifier(self.features(x))


def out_of_place(model: nn.Module) -> nn.Module:
    """``model`` with every in-place module (torchvision's ``ReLU(inplace=True)`` and
    ``ReLU6``) computing out of place, in place; returns it.

    Opacus' per-example gradient hooks are full backward hooks: each hooked layer's
    output is a view made by a custom autograd Function, and modifying it in place
    fails PyTorch's check ("Output 0 of BackwardHookFunction is a view and is being
    modified inplace"), so DP-SGD could not train these models.
    """
    for module in model.modules():
        if getattr(module, "inplace", False):
            module.inplace = False
    return model


def resnet18(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """torchvision ResNet-18 with GroupNorm and a stem fitted to the image size, its
    residual sums out of place (``tasks.vision.resnet``: Opacus needs that)."""
    # Here, not at the top: torchvision's import costs ~1.5 s per process.
    from tasks.vision.resnet import resnet18_out_of_place

    model = resnet18_out_of_place(num_classes, group_norm)
    if image_size <= SMALL_IMAGE_MAX:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    else:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return out_of_place(model)


def mobilenet_v2(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """torchvision MobileNetV2 with GroupNorm; stride-1 first conv for small images."""
    import torchvision

    model = torchvision.models.mobilenet_v2(
        weights=None, num_classes=num_classes, norm_layer=group_norm
    )
    first = model.features[0][0]
    stride = 1 if image_size <= SMALL_IMAGE_MAX else 2
    conv = nn.Conv2d(
        in_channels, first.out_channels, kernel_size=3, stride=stride, padding=1, bias=False
    )
    nn.init.kaiming_normal_(conv.weight, mode="fan_out")
    model.features[0][0] = conv
    return out_of_place(model)


class MLP(nn.Module):
    """The flattened image through one hidden ReLU layer: 64 -> 64 -> 10 on digits, the
    model of the shared peer workload (the peer workload's description; pfl-research's and
    bare Flower's digits MLP), with PyTorch's default initialisation as theirs.

    Parameters
    ----------
    in_channels, num_classes, image_size : int
        Input channels, output classes and image side: ``in_channels * image_size**2``
        inputs.
    hidden : int
        Width of the hidden layer.
    """

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, hidden: int = MLP_HIDDEN
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


BUILDERS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "mlp": MLP,
    "lenet": LeNet5,
    "cnn": SmallCNN,
    "cnn-complex-2": CifarCNN2Conv,
    "cnn-complex-3": CifarCNN3Conv,
    "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2,
}


def build_model(
    name: str, in_channels: int, num_classes: int, image_size: int, seed: int
) -> nn.Module:
    """Build model ``name`` with weights drawn from ``seed``; the global RNG is untouched.

    Parameters
    ----------
    name : str
        One of ``MODEL_NAMES``.
    in_channels, num_classes, image_size : int
        Input channels, output classes and (square) image side.
    seed : int
        Seed of the weight initialisation.

    Returns
    -------
    torch.nn.Module
        The model, on the CPU.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BUILDERS[name](in_channels, num_classes, image_size)


def head_parameter_names(model: nn.Module) -> tuple[str, ...]:
    """Names (= state-dict keys) of the head's parameters: weight and bias of the last
    ``nn.Linear`` in ``model.modules()`` order.

    Raises
    ------
    ValueError
        If ``model`` has no ``nn.Linear``.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to use as its head")
    prefix, head = linears[-1]
    return tuple(f"{prefix}.{name}" if prefix else name for name, _ in head.named_parameters())


@contextmanager
def train_head_only(model: nn.Module, head_names: Collection[str]) -> Iterator[None]:
    """Inside the block only the parameters ``head_names`` train; the body is frozen.

    Every other parameter gets ``requires_grad = False`` (optimizers then skip it),
    and every module holding none of the head's parameters runs in eval mode: a
    forward pre-hook on ``model`` sets it before each forward pass, so a training
    loop's ``model.train()`` does not undo it (BatchNorm statistics and dropout of
    the body stay frozen). On exit the ``requires_grad`` flags are restored, the hook
    is removed and the body modules take ``model``'s mode again.

    Raises
    ------
    ValueError
        If a name in ``head_names`` is not a parameter of ``model``.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(head_names) - set(params))
    if missing:
        raise ValueError(f"{type(model).__name__} has no parameter(s) {', '.join(missing)}")
    head = {id(params[name]) for name in head_names}
    body = [m for m in model.modules() if not any(id(p) in head for p in m.parameters())]
    saved = {name: p.requires_grad for name, p in params.items()}
    for name, p in params.items():
        if name not in head_names:
            p.requires_grad_(False)

    def body_to_eval(module: nn.Module, args: tuple[object, ...]) -> None:
        for m in body:
            m.training = False

    handle = model.register_forward_pre_hook(body_to_eval)
    try:
        yield
    finally:
        handle.remove()
        for name, p in params.items():
            p.requires_grad_(saved[name])
        for m in body:
            m.training = model.training
