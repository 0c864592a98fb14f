"""Megatron-style tensor parallelism of transformer blocks, with PyTorch's
``torch.distributed.tensor.parallel``.

In each block (Shoeybi et al., "Megatron-LM", 2019, sec. 3): the attention's
q, k and v projections are split by columns, so each rank computes its own
heads, and the output projection by rows; the MLP's first linear layer by
columns and its second by rows.  Each block's forward then needs two
all-reduces of the activations (after the attention, after the MLP), and its
backward two more; embeddings, norms and the head stay whole on every rank.

Models with a plan: ``vit_tiny_patch4`` and torchvision's ``vit_*`` (whose
fused ``nn.MultiheadAttention`` is replaced by an equal attention with q, k
and v apart, :func:`~distribuuuu.models.vit.split_torchvision_attention`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from distribuuuu.models import vit


def _torchvision_vit():
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer


def _blocks(model: nn.Module) -> list[tuple[str, str, str]]:
    """(block name, attention name, MLP names) of each transformer block,
    or [] for a model without a plan."""
    if isinstance(model, vit.VisionTransformer):
        return [
            (f"blocks.{i}", "attn", ("fc1", "fc2")) for i in range(len(model.blocks))
        ]
    if isinstance(model, _torchvision_vit()):
        return [
            (f"encoder.layers.{name}", "self_attention", ("mlp.0", "mlp.3"))
            for name, _ in model.encoder.layers.named_children()
        ]
    return []


def _sizes(model: nn.Module) -> tuple[int, int, int]:
    """Heads, hidden size and MLP size of the transformer blocks."""
    if isinstance(model, vit.VisionTransformer):
        block = model.blocks[0]
        dim = block.attn.q.in_features
        return dim // block.attn.head_dim, dim, block.fc1.out_features
    return (
        model.encoder.layers[0].self_attention.num_heads,
        model.hidden_dim,
        model.mlp_dim,
    )


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Raise ValueError unless ``model`` can be split over ``size`` ranks."""
    if not _blocks(model):
        raise ValueError(
            f"DIST.TENSOR_PARALLEL {size}: {type(model).__name__} has no tensor-"
            "parallel plan (vit_tiny_patch4 and torchvision's vit_* have one)"
        )
    heads, dim, mlp = _sizes(model)
    for what, value in (("heads", heads), ("hidden size", dim), ("MLP size", mlp)):
        if value % size:
            raise ValueError(
                f"DIST.TENSOR_PARALLEL {size} must divide the model's {what} {value}"
            )


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split ``model``'s transformer blocks over the 1-D ``mesh``, in place."""
    vit.split_torchvision_attention(model)
    plan = {}
    for block, attention, (fc1, fc2) in _blocks(model):
        for name in ("q", "k", "v"):
            plan[f"{block}.{attention}.{name}"] = ColwiseParallel()
        plan[f"{block}.{attention}.out_proj"] = RowwiseParallel()
        plan[f"{block}.{fc1}"] = ColwiseParallel()
        plan[f"{block}.{fc2}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)
