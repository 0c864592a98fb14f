"""``DIST.STRATEGY fsdp``: parameters, gradients and optimizer state sharded
over all ranks with FSDP2's ``fully_shard`` (ZeRO stage 3), block by block.

Each block's parameters are gathered for its forward and backward pass and
freed again.  Checkpoints are written sharded: every rank saves its pieces
with ``torch.distributed.checkpoint`` (DCP), nothing is gathered, and DCP
re-shards on load, so a run resumes on any world size.  ``DIST.FSDP_CPU_OFFLOAD``
keeps the shards in host memory.  In one process there is nothing to shard:
the model runs as under ddp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.modules.batchnorm import _BatchNorm
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import sharded_entries
from distribuuuu.dist import group as du
from distribuuuu.models import find_blocks
from distribuuuu.strategies.base import (
    Strategy,
    broadcast_model,
    keyed_by_name,
    parameter_names,
    rekey_optimizer_state,
)

logger = logging.getLogger(__name__)

# Whole (unsharded) state dicts, gathered on the CPU of rank 0.
WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_fully(
    model: nn.Module,
    device: torch.device,
    cpu_offload: bool,
    param_dtype: torch.dtype | None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2 (ZeRO-3): shard every block, then the rest, over all ranks (or
    over the 1-D ``mesh``).

    ``param_dtype``: the dtype of the gathered parameters that the forward and
    backward passes compute with (None: as stored).
    """
    mesh = mesh or init_device_mesh(device.type, (du.get_world_size(),))
    options = {
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
    logger.info(
        "FSDP: parameters, gradients and optimizer state sharded over %d ranks "
        "in %d blocks + the rest%s",
        mesh.size(),
        len(blocks),
        "; parameters and gradients kept in host memory" * cpu_offload,
    )
    return model


def is_sharded(model: nn.Module) -> bool:
    """True for a model sharded with FSDP, whose forward is a collective."""
    return isinstance(model, FSDPModule)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards of an FSDP model and its optimizer, for DCP to save."""
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: str
) -> None:
    """Load a DCP checkpoint of :func:`sharded_state` into an FSDP model.

    A collective.  DCP reads the pieces of this rank's shards, whatever the
    world size that saved them.
    """
    state = sharded_state(model, optimizer)
    cp.load_shards(state, directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


class FSDPStrategy(Strategy):
    """FSDP2 ``fully_shard`` per block; sharded checkpoints."""

    name = "fsdp"
    supports_channels_last = False  # FSDP shards contiguous tensors

    @classmethod
    def cpu_collectives(cls, cfg: CfgNode) -> bool:
        """FSDP's CPU offload clips gradients that live in host memory."""
        return bool(cfg.DIST.FSDP_CPU_OFFLOAD)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not du.is_distributed():
            return model
        # fully_shard keeps each rank's own slice of its own model: rank 0's
        # first, so that the run starts where DDP and one process start.
        broadcast_model(model)
        offload = self.cfg.DIST.FSDP_CPU_OFFLOAD
        return shard_fully(model, self.device, offload, self.amp_dtype)

    def spread(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights are DTensors spread over the ranks (its
        state then goes through DCP and torch's distributed state_dict API)."""
        return is_sharded(model)

    def forward_is_collective(self, model: nn.Module) -> bool:
        return self.spread(model)

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

    def model_state_dict(self, model: nn.Module) -> dict:
        """Gathered on rank 0's CPU ({} elsewhere); a collective."""
        if not self.spread(model):
            return super().model_state_dict(model)
        return get_model_state_dict(model, options=WHOLE)

    def load_model_state(self, model: nn.Module, weights: dict, strict=True) -> None:
        if not self.spread(model):
            super().load_model_state(model, weights, strict)
            return
        options = dataclasses.replace(WHOLE, strict=strict)
        set_model_state_dict(model, weights, options=options)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict:
        """Gathered, keyed by parameter name instead of index; a collective."""
        if not self.spread(model):
            return super().optimizer_state_dict(model, optimizer)
        return get_optimizer_state_dict(model, optimizer, options=WHOLE)

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """A state keyed by index (saved under DDP or ZeRO) is renamed first."""
        if not self.spread(model):
            super().load_optimizer_state(model, optimizer, state)
            return
        if not keyed_by_name(state):
            names = parameter_names(model, optimizer)
            state = rekey_optimizer_state(state, list(range(len(names))), names)
        set_optimizer_state_dict(model, optimizer, state, options=WHOLE)

    def save_weights(self, model, optimizer, ema, out_dir: str, name: str) -> dict:
        """Every rank writes its shards (the EMA's too); nothing is gathered."""
        if not self.spread(model):
            return super().save_weights(model, optimizer, ema, out_dir, name)
        shards = sharded_state(model, optimizer)
        if ema is not None:
            shards["ema"] = ema.tensors()
        folder, manifest = cp.save_sharded(out_dir, name, shards)
        return sharded_entries(folder, manifest)

    def load_weights(self, model, optimizer, saved, ema) -> bool:
        """Each rank reads its own shards of a sharded checkpoint."""
        if not (saved.is_sharded and self.spread(model)):
            return super().load_weights(model, optimizer, saved, ema)
        directory = cp.shards_of(saved.path, saved.state)
        load_sharded_state(model, optimizer, directory)
        if ema is None or not saved.has_ema:
            return False
        ema.load_shards(directory, saved.ema_counters)
        return True
