"""Convolutional networks with BatchNorm as chains of wstream stages: ResNet-18 and a small VGG.

The workloads of vDNN (Rhu et al., 2016) and of most weight-streaming papers before transformers:
deep stacks of convolutions whose activations, not weights, dominate memory. Their BatchNorm
layers carry *buffers* (running mean and variance, a batch count), which wstream streams with the
stage that owns them (DESIGN.md, "Buffers").

ResNet-18 is built by hand rather than taken from torchvision (not a dependency) with torchvision's
structure and parameter names: each stage registers its modules at their torchvision paths
(``conv1``, ``bn1``, ``layer1.0.conv1``, ..., ``fc``), so a stage's names are the names of a
torchvision ``resnet18().state_dict()``, and its weights load either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with BatchNorm and a shortcut (a 1x1
    convolution with BatchNorm where the shape changes)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNetStem(nn.Module):
    """Stage 0: a 7x7 stride-2 convolution, BatchNorm, ReLU and a 3x3 stride-2 max pool."""

    def __init__(self, planes: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, planes, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)


class ResNetLayer(nn.Module):
    """One residual layer (``layer1`` .. ``layer4``): its blocks registered under that name."""

    def __init__(self, index: int, inplanes: int, planes: int, blocks: int, stride: int) -> None:
        super().__init__()
        self.name = f"layer{index}"
        layers = [BasicBlock(inplanes, planes, stride)] + [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        self.add_module(self.name, nn.Sequential(*layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.get_submodule(self.name)(x)
        return out


class ResNetHead(nn.Module):
    """The last stage: global average pooling and the classifier ``fc``."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18_stages(num_classes: int = 1000, *, widths: Sequence[int] = (64, 128, 256, 512)) -> list[nn.Module]:
    """ResNet-18 as six stages: [stem, layer1, layer2, layer3, layer4, head], initialized as
    torchvision initializes it (Kaiming-normal convolutions, BatchNorm at weight 1 and bias 0).
    ``widths``: the four layers' channels (torchvision's by default; smaller ones make a quick
    test model of the same structure)."""
    if len(widths) != 4 or min(widths) < 1:
        raise ValueError(f"widths must be four channel counts >= 1, got {list(widths)}")
    stages: list[nn.Module] = [ResNetStem(widths[0])]
    inplanes = widths[0]
    for k, planes in enumerate(widths):
        stages.append(ResNetLayer(k + 1, inplanes, planes, 2, 1 if k == 0 else 2))
        inplanes = planes
    stages.append(ResNetHead(inplanes, num_classes))
    for stage in stages:
        _init(stage)
    return stages


class VGGBlock(nn.Module):
    """``convs`` 3x3 convolutions with BatchNorm and ReLU, then a 2x2 max pool (VGG-11-BN style)."""

    def __init__(self, inplanes: int, planes: int, convs: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for k in range(convs):
            layers += [nn.Conv2d(inplanes if k == 0 else planes, planes, 3, padding=1, bias=False), nn.BatchNorm2d(planes), nn.ReLU()]
        self.features = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(self.features(x), 2)


class VGGHead(nn.Module):
    """Flatten and a two-layer classifier with dropout."""

    def __init__(self, features: int, hidden: int, num_classes: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.relu(self.fc1(torch.flatten(x, 1))), self.dropout, self.training)
        return self.fc2(h)


def vgg_stages(
    num_classes: int = 10,
    *,
    widths: Sequence[int] = (32, 64, 128, 128),
    convs: Sequence[int] = (1, 1, 2, 2),
    image_size: int = 32,
    hidden: int = 256,
    dropout: float = 0.5,
) -> list[nn.Module]:
    """A VGG-style network with BatchNorm: one stage per block of ``convs[k]`` convolutions of
    ``widths[k]`` channels (each halving the image), then the classifier head; for images of
    ``image_size`` pixels a side."""
    if len(widths) != len(convs) or not widths:
        raise ValueError("widths and convs give one entry per block")
    side = image_size // 2 ** len(widths)
    if side < 1:
        raise ValueError(f"{len(widths)} blocks halve a {image_size}-pixel image below one pixel")
    stages: list[nn.Module] = []
    inplanes = 3
    for planes, n in zip(widths, convs):
        stages.append(VGGBlock(inplanes, planes, n))
        inplanes = planes
    stages.append(VGGHead(inplanes * side * side, hidden, num_classes, dropout))
    for stage in stages:
        _init(stage)
    return stages


def _init(module: nn.Module) -> None:
    """torchvision's initialization of its ResNets and VGGs."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
