"""``DIST.STRATEGY fsdp``: parameters, gradients and optimizer state sharded
over all ranks with FSDP2's ``fully_shard`` (ZeRO stage 3), block by block.

Each block's parameters are gathered for its forward and backward pass and
freed again.  Checkpoints are written sharded: every rank saves its pieces
with ``torch.distributed.checkpoint`` (DCP), nothing is gathered, and DCP
re-shards on load, so a run resumes on any world size.  ``DIST.FSDP_CPU_OFFLOAD``
keeps the shards in host memory.  In one process there is nothing to shard:
the model runs as under ddp.  Under ``DIST.TENSOR_PARALLEL`` the blocks are
split first and FSDP shards them again over the ``dp`` axis (2-D FSDP x TP,
PyTorch's own recipe), where there is more than one replica.  The state of
sharded weights is :mod:`distribuuuu.strategies.spread`'s.  ``DIST.STRATEGY
hsdp`` (:mod:`distribuuuu.strategies.hsdp`) is this strategy over a 2-D mesh.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.modules.batchnorm import _BatchNorm

from distribuuuu import checkpoint as cp
from distribuuuu.dist import group as du
from distribuuuu.models import find_blocks
from distribuuuu.strategies.base import Strategy
from distribuuuu.strategies.broadcast import broadcast_buffers, broadcast_model
from distribuuuu.strategies.mesh import axis
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import FP16, MICRO_BATCH_AUTO, SYNCBN, StrategySpec

if TYPE_CHECKING:  # imported for the annotations only
    from distribuuuu.models.ema import ModelEma

logger = logging.getLogger(__name__)


def shard_fully(
    model: nn.Module,
    device: torch.device,
    cpu_offload: bool,
    param_dtype: torch.dtype | None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2 (ZeRO-3): shard every block, then the rest, over all ranks (or
    over the 1-D ``mesh``; a 2-D ``mesh`` replicate x shard makes it HSDP).

    ``param_dtype``: the dtype of the gathered parameters that the forward and
    backward passes compute with (None: as stored).
    """
    mesh = mesh or init_device_mesh(device.type, (du.get_world_size(),))
    options: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if cpu_offload
        else OffloadPolicy(),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=torch.float32 if param_dtype is not None else None,
        ),
    }
    if param_dtype is not None:
        # BatchNorm keeps float32 parameters to match its float32 running
        # statistics (CPU kernels refuse a mix of the two); it takes the
        # low-precision activations as they come.
        float32 = {**options, "mp_policy": MixedPrecisionPolicy()}
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                fully_shard(module, **float32)
    blocks = find_blocks(model)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    hybrid = mesh.ndim == 2  # HSDP: shards over the last axis, copies over the first
    logger.info(
        "%s: parameters, gradients and optimizer state sharded over %d ranks%s "
        "in %d blocks + the rest%s",
        "HSDP" if hybrid else "FSDP",
        mesh.size(mesh.ndim - 1),
        f", replicated over {mesh.size(0)} groups of them" * hybrid,
        len(blocks),
        "; parameters and gradients kept in host memory" * cpu_offload,
    )
    return model


def is_sharded(model: nn.Module) -> TypeGuard[FSDPModule]:
    """True for a model sharded with FSDP, whose forward is a collective."""
    return isinstance(model, FSDPModule)


@register
class FSDPStrategy(Strategy):
    """FSDP2 ``fully_shard`` per block; sharded checkpoints."""

    name = "fsdp"
    contiguous_only = "FSDP shards contiguous parameters only"
    compiles = True
    takes_tensor_parallel = True
    refused = {
        SYNCBN: "DIST.STRATEGY fsdp",
        FP16: "DIST.STRATEGY fsdp; use bf16",
        MICRO_BATCH_AUTO: "DIST.STRATEGY fsdp (its forward and backward gather "
        "and scatter the shards: no rank can try a step alone)",
    }

    @classmethod
    def cpu_collectives(cls, spec: StrategySpec) -> bool:
        """FSDP's CPU offload clips gradients that live in host memory."""
        return spec.fsdp_cpu_offload

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.dims.dp == 1:  # one process, or one tensor-parallel replica
            return model
        if self.tensor_parallel is None:
            # fully_shard keeps each rank's own slice of its own model: rank
            # 0's first, so that the run starts where DDP and one process do
            # (the tensor-parallel step gave its shards rank 0's already).
            broadcast_model(model)
        mesh = axis(self.mesh, "dp")
        offload = self.spec.fsdp_cpu_offload
        return shard_fully(model, self.device, offload, self.amp_dtype, mesh)

    def describe(self, model: nn.Module) -> str:
        if self.tensor_parallel is None:
            return self.name
        over = "fsdp" if is_sharded(model) else "ddp"
        return self.tensor_parallel.describe(self.dims.dp, over=over)

    def save_weights(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ema: ModelEma | None,
        writer: cp.CheckpointWriter,
        name: str,
    ) -> dict:
        """The sharded checkpoint, with rank 0's buffers on every rank first.

        FSDP syncs no buffers: each rank updates its own BatchNorm statistics
        from its batches, and DCP writes a tensor that every rank holds from
        whichever rank it picks.  With rank 0's everywhere (those evaluation
        uses), the checkpoint holds rank 0's and a resumed run goes on from
        them as the uninterrupted run does.  Training is unchanged: it
        normalizes with the batch's statistics.
        """
        broadcast_buffers(model)
        return super().save_weights(model, optimizer, ema, writer, name)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """FSDP reduce-scatters the gradients of the last micro-batch only."""
        if not is_sharded(model):
            yield
            return
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
