"""Megatron-style tensor parallelism of transformer blocks, with PyTorch's
``torch.distributed.tensor.parallel``.

In each block (Shoeybi et al., "Megatron-LM", 2019, sec. 3): the attention's
q, k and v projections are split by columns, so each rank computes its own
heads, and the output projection by rows; the MLP's first linear layer by
columns and its second by rows.  Each block's forward then needs two
all-reduces of the activations (after the attention, after the MLP), and its
backward two more; embeddings, norms and the head stay whole on every rank.

With sequence parallelism (``DIST.SEQUENCE_PARALLEL``; Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022) the
norms (and torchvision's dropouts) work on each rank's share of the tokens
instead of all of them: each all-reduce becomes a reduce-scatter after the
row-parallel layer and an all-gather before the column-parallel one, the same
traffic, and the activations outside attention and MLP are split too.

Models with a plan: ``vit_tiny_patch4`` and torchvision's ``vit_*`` (whose
fused ``nn.MultiheadAttention`` is replaced by an equal attention with q, k
and v apart, :func:`~distribuuuu.models.vit.split_torchvision_attention`).

The ranks of a block hold its residual stream whole (or their share of its
tokens): what they draw at random there, MODEL.DROP_PATH's per-sample masks,
must be drawn alike on all of them, or the replicated weights drift apart.
:func:`share_random_state` gives them one RNG state.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distribuuuu.models import vit


def _torchvision_vit():
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer


def _blocks(model: nn.Module) -> list[tuple[str, str, tuple, tuple]]:
    """(block, attention, (fc1, fc2), token-wise layers) of each transformer
    block, or [] for a model without a plan."""
    if isinstance(model, vit.VisionTransformer):
        norms = ("norm1", "norm2")
        return [
            (f"blocks.{i}", "attn", ("fc1", "fc2"), norms)
            for i in range(len(model.blocks))
        ]
    if isinstance(model, _torchvision_vit()):
        return [
            (
                f"encoder.layers.{name}",
                "self_attention",
                ("mlp.0", "mlp.3"),
                _token_wise(block),
            )
            for name, block in model.encoder.layers.named_children()
        ]
    return []


def _token_wise(block: nn.Module) -> tuple[str, str, str]:
    """ln_1, the dropout after attention and ln_2 of a torchvision encoder
    block (the MLP's own dropouts follow its row-parallel layer and act on
    local tokens as they are).

    MODEL.DROP_PATH makes that dropout ``Sequential(dropout, drop path)``
    (:mod:`distribuuuu.models.regularize`): only the dropout is named, and the
    drop path, like the MLP's, scales the local tokens of each sample (as a
    sequence-parallel module it would get a DTensor, which torchvision's
    ``stochastic_depth`` multiplies by a plain tensor and fails)."""
    dropout = "dropout.0" if isinstance(block.dropout, nn.Sequential) else "dropout"
    return ("ln_1", dropout, "ln_2")


def _stack(model: nn.Module) -> str:
    """The Sequential of transformer blocks."""
    return "blocks" if isinstance(model, vit.VisionTransformer) else "encoder.layers"


def tokens(model: nn.Module, image_size: int) -> int:
    """The sequence length of ``model`` on ``image_size`` px images."""
    if isinstance(model, vit.VisionTransformer):
        patch = model.patch_embed.kernel_size[0]
        return (image_size // patch) ** 2 + 1
    return cast(int, model.seq_length)  # torchvision's ViT (untyped)


def _sizes(model: nn.Module) -> tuple[int, int, int]:
    """Heads, hidden size and MLP size of the transformer blocks."""
    if isinstance(model, vit.VisionTransformer):
        block = cast(vit.Block, model.blocks[0])
        dim = block.attn.q.in_features
        return dim // block.attn.head_dim, dim, block.fc1.out_features
    torchvision_vit: Any = model  # untyped
    return (
        torchvision_vit.encoder.layers[0].self_attention.num_heads,
        torchvision_vit.hidden_dim,
        torchvision_vit.mlp_dim,
    )


def check_tensor_parallel(
    model: nn.Module, size: int, sequence_parallel: bool = False, image_size: int = 0
) -> None:
    """Raise ValueError unless ``model`` can be split over ``size`` ranks (its
    tokens too, with ``sequence_parallel``, on ``image_size`` px images)."""
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
    count = tokens(model, image_size)
    if sequence_parallel and count % size:
        raise ValueError(
            f"DIST.SEQUENCE_PARALLEL: DIST.TENSOR_PARALLEL {size} must divide the "
            f"{count} tokens (patches + class token) of {image_size} px images"
        )


def parallelize(
    model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False
) -> nn.Module:
    """Split ``model``'s transformer blocks over the 1-D ``mesh``, in place
    (their token-wise layers over the tokens with ``sequence_parallel``)."""
    vit.split_torchvision_attention(model)
    tokens_split = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for block, attention, (fc1, fc2), token_wise in _blocks(model):
        for name in ("q", "k", "v"):
            plan[f"{block}.{attention}.{name}"] = ColwiseParallel()
        plan[f"{block}.{attention}.out_proj"] = RowwiseParallel(
            output_layouts=tokens_split
        )
        plan[f"{block}.{fc1}"] = ColwiseParallel(input_layouts=tokens_split)
        plan[f"{block}.{fc2}"] = RowwiseParallel(output_layouts=tokens_split)
        if sequence_parallel:
            for name in token_wise:
                plan[f"{block}.{name}"] = SequenceParallel(use_local_output=True)
            # torchvision calls its attention with (x, x, x)
            inputs = (Shard(1),) * (3 if attention == "self_attention" else 1)
            plan[f"{block}.{attention}"] = PrepareModuleInput(
                input_layouts=inputs, desired_input_layouts=(Replicate(),) * len(inputs)
            )
    if sequence_parallel:  # the tokens split before the blocks, whole after
        plan[_stack(model)] = PrepareModuleInputOutput(
            input_layouts=Replicate(),
            desired_input_layouts=Shard(1),
            use_local_input=True,
            output_layouts=Shard(1),
            desired_output_layouts=Replicate(),
        )
    return parallelize_module(model, mesh, plan)


def share_random_state(mesh: DeviceMesh, device: torch.device) -> None:
    """Give every rank of the 1-D ``mesh`` the torch RNG state of its first
    rank: the CPU generator's and, on a GPU, that of ``device``.

    The trainer seeds each process apart (RNG_SEED + rank).  The ranks of a
    tensor-parallel group must draw alike what they draw for the activations
    they all hold (drop-path masks), while the groups, data-parallel
    replicas, keep drawing apart: Megatron's "default" RNG state is so, the
    same within a tensor-parallel group and different across groups
    (``megatron/core/tensor_parallel/random.py``,
    ``model_parallel_cuda_manual_seed``).  It is the process's own state, so
    activation checkpointing replays it in the recomputation and checkpoints
    save and restore it per rank as before.
    """
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    dist.broadcast_object_list(
        states, group=mesh.get_group(), device=device, group_src=0
    )
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
