"""BoTNet-50: "Bottleneck Transformers for Visual Recognition" (Srinivas et
al. 2021, arXiv 2101.11605).

A ResNet-50 whose last stage (c5) replaces the 3x3 convolution of each of its
three bottleneck blocks by all-to-all multi-head self-attention (4 heads) with
2-D relative position encodings: the logit of query (i, j) and key (k, l) is
``q . k + q . r_h[k - i] + q . r_w[l - j]`` (relative height and width
logits, as in Bello et al. 2019 and the paper's Figure 4).  The first c5
block downsamples by 2x2 average pooling after the attention; BatchNorm and
ReLU sit where the ResNet bottleneck has them.  20,852,008 parameters with
a 1000-way head (the paper: 20.8 M; the original Distribuuuu's botnet50 kept
c5 at 14x14, without the stride, hence 7,168 more position parameters).

The position tables are learnt for the feature maps of a 224 px input (14x14
in the first c5 block, 7x7 after its pooling).  A smaller input uses the
central offsets of the same tables (every offset it needs was learnt); an
input larger than 224 px per side needs offsets that were never learnt and is
refused (:data:`MAX_INPUT_SIZE`).
"""

from __future__ import annotations

import torch
from torch import nn

# The largest input side: a ResNet stem and c2-c4 take 224 px to 14x14.
MAX_INPUT_SIZE = 224
C4_SIZE = MAX_INPUT_SIZE // 16


def _relative_index(length: int, largest: int, device: torch.device) -> torch.Tensor:
    """``[i, k] -> k - i + largest - 1``: the row of the offset from position
    i to position k in a table of the ``2 * largest - 1`` offsets."""
    positions = torch.arange(length, device=device)
    return positions[None, :] - positions[:, None] + largest - 1


class RelativeSelfAttention(nn.Module):
    """Multi-head self-attention over every position of an H x W feature map,
    with learnt relative height and width logits (shared by the heads).

    Args:
        channels: input channels, also the channels of queries, keys, values
            and of the output (split evenly among the heads).
        heads: number of attention heads.
        size: the largest feature map (height, width) it takes.
    """

    def __init__(self, channels: int, heads: int, size: tuple[int, int]) -> None:
        super().__init__()
        if channels % heads:
            raise ValueError(f"{channels} channels do not split into {heads} heads")
        self.heads, self.size = heads, size
        head_channels = channels // heads
        self.scale = head_channels**-0.5
        self.qkv = nn.Conv2d(channels, 3 * channels, 1, bias=False)
        self.rel_height = nn.Parameter(
            torch.randn(2 * size[0] - 1, head_channels) * self.scale
        )
        self.rel_width = nn.Parameter(
            torch.randn(2 * size[1] - 1, head_channels) * self.scale
        )

    def relative_logits(self, q: torch.Tensor, height: int, width: int):
        """``q . r_h[k - i] + q . r_w[l - j]`` for every query (i, j) and key
        (k, l); ``q``: (batch, heads, H*W, d) -> (batch, heads, H*W, H*W)."""
        batch, heads, _, channels = q.shape
        q = q.reshape(batch, heads, height, width, channels)
        rows = self.rel_height[_relative_index(height, self.size[0], q.device)]
        columns = self.rel_width[_relative_index(width, self.size[1], q.device)]
        by_row = torch.einsum("bnijd,ikd->bnijk", q, rows)
        by_column = torch.einsum("bnijd,jld->bnijl", q, columns)
        logits = by_row[..., :, None] + by_column[..., None, :]  # (b n i j k l)
        return logits.reshape(batch, heads, height * width, height * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        if height > self.size[0] or width > self.size[1]:
            raise ValueError(
                f"botnet50: a {height}x{width} feature map is larger than the "
                f"{self.size[0]}x{self.size[1]} its position encodings cover "
                f"(inputs up to {MAX_INPUT_SIZE} px per side)"
            )
        qkv = self.qkv(x).reshape(batch, 3, self.heads, -1, height * width)
        q, k, v = qkv.transpose(-1, -2).unbind(1)  # (batch, heads, H*W, d)
        q = q * self.scale
        logits = q @ k.transpose(-1, -2) + self.relative_logits(q, height, width)
        out = logits.softmax(dim=-1) @ v
        return out.transpose(-1, -2).reshape(batch, channels, height, width)


class AttentionBottleneck(nn.Module):
    """The bottleneck block of c5: 1x1 conv, BN, ReLU, self-attention (then
    2x2 average pooling when ``stride`` is 2), BN, ReLU, 1x1 conv, BN, plus
    the shortcut (a strided 1x1 conv and BN when the shape changes), ReLU.

    Args:
        in_channels: channels of the input.
        width: channels inside the block (the output has 4x as many).
        size: the largest feature map (height, width) of the attention.
        heads: attention heads.
        stride: 1, or 2 to halve the feature map.
    """

    expansion = 4

    def __init__(
        self,
        in_channels: int,
        width: int,
        size: tuple[int, int],
        heads: int = 4,
        stride: int = 1,
    ) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.attention = RelativeSelfAttention(width, heads, size)
        self.pool = nn.AvgPool2d(2, 2) if stride == 2 else nn.Identity()
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        for module in self.modules():  # as torchvision initialises its ResNets
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(
                    module.weight, mode="fan_out", nonlinearity="relu"
                )

    def zero_init_last(self) -> None:
        """Start as the identity (MODEL.ZERO_INIT_RESIDUAL), as timm's blocks."""
        nn.init.zeros_(self.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.pool(self.attention(out))))
        out = self.bn3(self.conv3(out))
        return self.relu(out + shortcut)


def botnet50(num_classes: int = 1000) -> nn.Module:
    """BoTNet-50: torchvision's ResNet-50 with the attention blocks as c5
    (``layer4``); the stem, c2-c4, pooling and head are torchvision's."""
    from torchvision.models import resnet50

    model = resnet50(num_classes=num_classes)
    half = C4_SIZE // 2
    model.layer4 = nn.Sequential(
        AttentionBottleneck(1024, 512, (C4_SIZE, C4_SIZE), stride=2),
        AttentionBottleneck(2048, 512, (half, half)),
        AttentionBottleneck(2048, 512, (half, half)),
    )
    return model
