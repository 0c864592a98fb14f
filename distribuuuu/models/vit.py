"""Vision Transformers written for tensor parallelism.

``vit_tiny_patch4``: a small ViT for 28-32 px inputs (patch 4, hidden 192,
depth 6, MLP 768; pre-norm blocks, class token) with 4 heads of 48 channels
(DeiT-Tiny's 3 heads could not be split over 2 tensor-parallel ranks).  Its
attention keeps
q, k and v as separate linear layers and finds its number of heads from the
width of its q projection, so Megatron's column- and row-parallel plans apply
by module name and each rank runs its own heads.  The position embedding is
the fixed 2-D sine-cosine one of MAE and MoCo v3 (He et al. 2022; Chen et al.
2021), computed for the input's grid: the model has no parameter that depends
on the image size, so it runs at any TRAIN.IM_SIZE divisible by the patch.
``drop_path`` (MODEL.DROP_PATH) is the stochastic depth of both residual
branches of the last block, the others' rising linearly to it from none at
the first, as in DeiT; ``dropout`` (MODEL.DROPOUT) drops the class token's
features before the head, as timm's ``drop_rate``.  Under tensor parallelism
the ranks of a block draw the same masks (see
:mod:`~distribuuuu.models.tensor_parallel`).

:class:`SplitAttention` stands in for the fused ``nn.MultiheadAttention`` of
torchvision's ViT blocks (:func:`split_torchvision_attention`): the same
computation, q, k and v apart, and it reads and writes torchvision's
``in_proj_weight`` / ``in_proj_bias`` keys, so checkpoints stay interchangeable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import StochasticDepth

from distribuuuu.checkpoint.format import fuse_qkv
from distribuuuu.models.regularize import drop_path_rates


class SplitAttention(nn.Module):
    """Multi-head self-attention with separate q, k, v and output projections.

    The heads are counted at run time from the q projection's output width, so
    a rank that holds a column shard of q, k and v runs its share of them.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), dropout_p=p
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class TorchvisionAttention(SplitAttention):
    """A SplitAttention in the place of torchvision's ``nn.MultiheadAttention``:
    called and answering as it is (``attn(x, x, x, need_weights=False)`` ->
    ``(out, None)``), and saving and loading its fused ``in_proj_*`` keys
    (plain tensors; sharded ones keep their q, k, v keys)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__(dim, heads, dropout)
        self._register_state_dict_hook(_fuse_on_save)
        self._register_load_state_dict_pre_hook(_split_on_load)

    def forward(self, query, key=None, value=None, need_weights=False):
        return super().forward(query), None


def _fuse_on_save(module, state: dict, prefix: str, local_metadata) -> None:
    fuse_qkv(state, prefix)


def _split_on_load(state: dict, prefix: str, *args) -> None:
    split_qkv(state, prefix)


def split_qkv(state: dict, prefix: str | None = None) -> dict:
    """The inverse of :func:`fuse_qkv`: torchvision's ``in_proj_*`` entries
    (under ``prefix``, or every ``self_attention.`` one) cut into q, k, v."""
    if prefix is None:
        ends = "self_attention.in_proj_weight"
        prefixes = [
            key[: -len("in_proj_weight")] for key in state if key.endswith(ends)
        ]
    else:
        prefixes = [prefix]
    for start in prefixes:
        for kind in ("weight", "bias"):
            fused = state.pop(f"{start}in_proj_{kind}", None)
            if fused is not None:
                for name, part in zip("qkv", fused.chunk(3)):
                    state[f"{start}{name}.{kind}"] = part
    return state


def split_torchvision_attention(model: nn.Module) -> int:
    """Replace each ``nn.MultiheadAttention`` of torchvision's ViT blocks by an
    equal :class:`TorchvisionAttention` holding the same weights; how many."""
    from torchvision.models.vision_transformer import EncoderBlock

    count = 0
    for block in model.modules():
        if not isinstance(block, EncoderBlock) or isinstance(
            block.self_attention, TorchvisionAttention
        ):
            continue
        fused = block.self_attention
        split = TorchvisionAttention(fused.embed_dim, fused.num_heads, fused.dropout)
        split.to(fused.in_proj_weight.device, fused.in_proj_weight.dtype)
        split.load_state_dict(fused.state_dict())  # in_proj_* split by the hook
        block.self_attention = split
        count += 1
    return count


class Block(nn.Module):
    """Pre-norm transformer block: attention, then an MLP, each residual, each
    branch dropped per sample with probability ``drop_path``."""

    def __init__(self, dim: int, heads: int, mlp: int, drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SplitAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.act, self.fc2 = (
            nn.Linear(dim, mlp),
            nn.GELU(),
            nn.Linear(mlp, dim),
        )
        self.drop_path = StochasticDepth(drop_path, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.fc2(self.act(self.fc1(self.norm2(x)))))


def sincos_position_embedding(rows: int, cols: int, dim: int) -> torch.Tensor:
    """The fixed 2-D sine-cosine embedding of a ``rows`` x ``cols`` grid,
    ``(rows * cols, dim)``: a quarter of the channels each for sin and cos of
    the row and of the column, at geometric frequencies."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    row, col = torch.meshgrid(
        torch.arange(rows, dtype=torch.float64),
        torch.arange(cols, dtype=torch.float64),
        indexing="ij",
    )
    parts = []
    for grid in (row.flatten(), col.flatten()):
        angles = grid[:, None] * omega[None, :]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()


def embed_patches(
    patch_embed: nn.Module, cls_token: torch.Tensor, images: torch.Tensor
) -> torch.Tensor:
    """Patch tokens with their positions, after the class token."""
    x = patch_embed(images)
    rows, cols = x.shape[-2:]
    x = x.flatten(2).transpose(1, 2)
    position = sincos_position_embedding(rows, cols, x.shape[-1])
    x = x + position.to(x.device, x.dtype)
    return torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1)


class VisionTransformer(nn.Module):
    """A ViT: patches, class token, fixed position embedding, pre-norm blocks,
    a final norm and a linear head on the class token (``dropout`` before it;
    ``drop_path``: the stochastic depth of the last block)."""

    def __init__(
        self,
        patch: int,
        dim: int,
        depth: int,
        heads: int,
        mlp: int,
        num_classes: int,
        in_channels: int = 3,
        dropout: float = 0.0,
        drop_path: float = 0.0,
    ):
        super().__init__()
        if dim % 4:
            raise ValueError(f"hidden size {dim} must be divisible by 4")
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.Sequential(
            *[Block(dim, heads, mlp, p) for p in drop_path_rates(drop_path, depth)]
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head_dropout = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes)
        nn.init.normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        fan_in = in_channels * patch * patch
        nn.init.trunc_normal_(self.patch_embed.weight, std=math.sqrt(1 / fan_in))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(embed_patches(self.patch_embed, self.cls_token, images))
        return self.head(self.head_dropout(self.norm(x)[:, 0]))


def vit_tiny_patch4(
    num_classes: int = 10, dropout: float = 0.0, drop_path: float = 0.0
) -> VisionTransformer:
    """ViT-Tiny for 28-32 px images: patch 4, hidden 192, depth 6, 4 heads."""
    return VisionTransformer(
        patch=4,
        dim=192,
        depth=6,
        heads=4,
        mlp=768,
        num_classes=num_classes,
        dropout=dropout,
        drop_path=drop_path,
    )
