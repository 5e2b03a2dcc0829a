"""torchvision's ResNet-18 with a residual block that adds out of place, so that Opacus
can train it with DP-SGD.

torchvision's ``BasicBlock`` adds the shortcut in place (``out += identity``) onto its
second norm layer's output. Opacus' per-example gradient hooks are full backward hooks,
which make each hooked layer's output a view returned by a custom autograd Function,
and PyTorch refuses to modify such a view in place ("Output 0 of BackwardHookFunction
is a view and is being modified inplace"). The block below is torchvision's with that
one sum out of place: same modules, state-dict keys and initialisation (the ReLUs are
made out of place by ``tasks.vision.models.out_of_place``). Imported only
when a ResNet is built (torchvision's import costs ~1.5 s per process).
"""

from __future__ import annotations

import torch
from torchvision.models.resnet import BasicBlock, ResNet


class OutOfPlaceBasicBlock(BasicBlock):
    """``BasicBlock`` whose shortcut sum does not write in place (its ReLU is made out
    of place with the rest of the model, ``tasks.vision.models.out_of_place``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet18_out_of_place(num_classes: int, norm_layer) -> ResNet:
    """``torchvision.models.resnet18(weights=None, ...)`` built from
    ``OutOfPlaceBasicBlock``."""
    return ResNet(
        OutOfPlaceBasicBlock, [2, 2, 2, 2], num_classes=num_classes, norm_layer=norm_layer
    )
