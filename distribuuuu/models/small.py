"""ResNets for 28-32 px inputs (He et al., "Deep Residual Learning", 2016, sec. 4.2).

``resnet{6n+2}``: a 3x3 stem with 16 channels, then three stages of ``n`` basic
blocks with 16, 32 and 64 channels at 32, 16 and 8 px (28, 14, 7 px for
digits), global average pooling and a linear head.  ResNet-20 has 0.27 M
parameters.  ``resnet18_cifar`` is ResNet-18's four stages (64-512 channels)
behind a 3x3 stride-1 stem without max pooling, the usual CIFAR adaptation.
``lenet5`` is the classic digit classifier, small and without BatchNorm.

``dropout`` (MODEL.DROPOUT) drops the input of the last linear layer, as timm's
``drop_rate`` does; ``drop_path`` (MODEL.DROP_PATH) is the stochastic depth of
the ResNets' last block, the others' rising linearly to it from none at the
first (:func:`~distribuuuu.models.regularize.drop_path_rates`).
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.ops import StochasticDepth

from distribuuuu.models.regularize import drop_path_rates


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (1x1 projection when
    needed); stochastic depth ``drop_path`` on the convolutions' branch."""

    def __init__(
        self, in_channels: int, channels: int, stride: int = 1, drop_path: float = 0.0
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.drop_path = StochasticDepth(drop_path, "row")
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False),
                nn.BatchNorm2d(channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.drop_path(self.bn2(self.conv2(out)))
        return self.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet of basic blocks for small images (no stride in the stem)."""

    def __init__(
        self,
        blocks_per_stage: list[int],
        widths: list[int],
        num_classes: int = 10,
        in_channels: int = 3,
        *,
        dropout: float = 0.0,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages, channels = [], widths[0]
        rates = iter(drop_path_rates(drop_path, sum(blocks_per_stage)))
        for index, (blocks, width) in enumerate(zip(blocks_per_stage, widths)):
            stride = 1 if index == 0 else 2
            layers = []
            for block in range(blocks):
                step = stride if block == 0 else 1
                layers.append(BasicBlock(channels, width, step, next(rates)))
                channels = width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(
                    module.weight, mode="fan_out", nonlinearity="relu"
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(self.dropout(torch.flatten(self.pool(x), 1)))


def cifar_resnet(
    depth: int, num_classes: int = 10, dropout: float = 0.0, drop_path: float = 0.0
) -> SmallResNet:
    """ResNet-``depth`` of He et al. for CIFAR; ``depth`` is 6n + 2."""
    if (depth - 2) % 6:
        raise ValueError(f"depth must be 6n + 2, got {depth}")
    n = (depth - 2) // 6
    return SmallResNet(
        [n, n, n], [16, 32, 64], num_classes, dropout=dropout, drop_path=drop_path
    )


def resnet18_cifar(
    num_classes: int = 10, dropout: float = 0.0, drop_path: float = 0.0
) -> SmallResNet:
    """ResNet-18's stages behind a 3x3 stem for 32 px images (11.2 M parameters)."""
    widths = [64, 128, 256, 512]
    return SmallResNet(
        [2, 2, 2, 2], widths, num_classes, dropout=dropout, drop_path=drop_path
    )


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling; no BatchNorm.

    Built for 28 px digits; other sizes are pooled to the 5x5 maps it expects.
    """

    def __init__(
        self, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.0
    ):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(5),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )
        self.dropout = nn.Dropout(dropout)  # before the last linear layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.features(x), 1)
        *hidden, last = self.classifier
        for layer in hidden:
            x = layer(x)
        return last(self.dropout(x))
