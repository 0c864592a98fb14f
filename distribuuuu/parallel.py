"""Wrap a model for the run: device placement, SyncBN, DDP, ZeRO-1, FSDP2,
activation checkpointing; and the state of whatever wraps it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from distribuuuu import checkpoint as cp
from distribuuuu import distributed as du
from distribuuuu.models import find_blocks
from distribuuuu.syncbn import GroupSyncBatchNorm

logger = logging.getLogger(__name__)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP (or DataParallel) wrapper."""
    return model.module if hasattr(model, "module") else model


def wrap_model(
    model: nn.Module,
    device: torch.device,
    syncbn: bool,
    mode: str = "ddp",
    strategy: str = "ddp",
    cpu_offload: bool = False,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it for the process group, if any.

    Args:
        model: the plain model.
        device: this process's one device.
        syncbn: convert BatchNorm to synchronized BatchNorm: PyTorch's
            ``nn.SyncBatchNorm`` on CUDA, :class:`GroupSyncBatchNorm` elsewhere.
        mode: "ddp", or "dp" for DataParallel over all visible GPUs in this
            one process (falls back to ``device`` alone with fewer than 2).
        strategy: "ddp" and "zero1" wrap the model in DDP; "fsdp" shards it
            with FSDP2 ``fully_shard``.
        cpu_offload: FSDP only: keep parameters and gradients in host memory.
        param_dtype: FSDP only: the dtype of the gathered parameters that the
            forward and backward passes compute with (None: as stored).
    """
    if mode == "dp":
        return _wrap_data_parallel(model, device)
    distributed = du.is_distributed()
    if strategy == "fsdp" and distributed:
        return _shard_fully(model.to(device), device, cpu_offload, param_dtype)
    if syncbn and distributed:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            logger.info("SyncBN: torch.nn.SyncBatchNorm across processes")
        else:
            model = GroupSyncBatchNorm.convert_sync_batchnorm(model)
            logger.info("SyncBN: CPU SyncBN active (all_reduce over %s)", device.type)
    model = model.to(device)
    if distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    return model


def _shard_fully(
    model: nn.Module,
    device: torch.device,
    cpu_offload: bool,
    param_dtype: torch.dtype | None,
) -> nn.Module:
    """FSDP2 (ZeRO-3): shard every block, then the rest, over all ranks."""
    options = {
        "mesh": init_device_mesh(device.type, (du.get_world_size(),)),
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
        du.get_world_size(),
        len(blocks),
        "; parameters and gradients kept in host memory" * cpu_offload,
    )
    return model


def is_sharded(model: nn.Module) -> bool:
    """True for a model sharded with FSDP, whose forward is a collective."""
    return isinstance(model, FSDPModule)


def _wrap_data_parallel(model: nn.Module, device: torch.device) -> nn.Module:
    if du.get_world_size() > 1:
        raise ValueError(
            "DIST.STRATEGY dp runs in one process; with several processes use "
            "DIST.STRATEGY ddp (the default)"
        )
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    model = model.to(device)
    if gpus < 2:
        logger.warning(
            "DIST.STRATEGY dp: DataParallel needs 2 or more CUDA devices, found %d; "
            "falling back to one device (%s)",
            gpus,
            device,
        )
        return model
    logger.info("DataParallel over %d GPUs (batch split across them)", gpus)
    return AutocastDataParallel(model)


class AutocastDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose replicas compute in the caller's autocast dtype.

    DataParallel runs each replica in a thread of its own, and torch's
    ``parallel_apply`` enters autocast there with the caller's enabled flag
    only (torch/nn/parallel/parallel_apply.py); the autocast dtype is per
    thread, and a new thread starts with float16 on CUDA
    (pytorch/pytorch#125186).  So a bf16 run would compute its replicas in
    float16, without the loss scaling float16 needs.  Here each replica
    enters autocast again, inside its thread, with the caller's dtype.
    """

    def parallel_apply(self, replicas, inputs, kwargs):
        replicas = replicas_under_autocast(replicas, self.src_device_obj.type)
        return super().parallel_apply(replicas, inputs, kwargs)


class _UnderAutocast:
    """Calls ``module`` under autocast of ``device_type`` in ``dtype``."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def replicas_under_autocast(replicas: list, device_type: str) -> list:
    """``replicas``, made to run under this thread's autocast (if it is on for
    ``device_type``) in whatever thread calls them."""
    if not torch.is_autocast_enabled(device_type):
        return list(replicas)
    dtype = torch.get_autocast_dtype(device_type)
    return [_UnderAutocast(replica, device_type, dtype) for replica in replicas]


def model_devices(model: nn.Module, device: torch.device) -> list[torch.device]:
    """The devices this process's ``model`` runs on: every GPU of a
    DataParallel (DIST.STRATEGY dp), else this process's ``device``."""
    if isinstance(model, nn.DataParallel) and model.device_ids:
        return [torch.device("cuda", index) for index in model.device_ids]
    return [device]


def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank.

    After the last training step each rank has updated its running statistics
    with its own batch; evaluating with rank 0's copy everywhere makes the
    distributed evaluation equal to evaluating the saved checkpoint.
    """
    if du.is_distributed():
        for buffer in unwrap_model(model).buffers():
            torch.distributed.broadcast(buffer, src)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Backward passes inside synchronize gradients across ranks only if ``sync``.

    For the micro-batches of gradient accumulation: DDP's ``no_sync``.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif sync or not isinstance(model, DistributedDataParallel):
        yield
    else:
        with model.no_sync():
            yield


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` rebuilt as a ZeroRedundancyOptimizer (ZeRO stage 1).

    Each rank keeps the state of its share of the parameters only; the
    parameter groups and hyper-parameters stay those of ``optimizer``.  Without
    a process group there is nothing to shard and ``optimizer`` is returned.
    """
    if not du.is_distributed():
        logger.info("DIST.STRATEGY zero1 in one process: nothing to shard")
        return optimizer
    sharded = ZeroRedundancyOptimizer(
        [dict(group) for group in optimizer.param_groups],
        optimizer_class=type(optimizer),
        **optimizer.defaults,
    )
    logger.info("ZeRO-1: optimizer state sharded over %d ranks", du.get_world_size())
    return sharded


# Whole (unsharded) state dicts, gathered on the CPU of rank 0.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state_dict(model: nn.Module) -> dict:
    """The whole model's state_dict, without wrapper prefixes.

    A collective for FSDP (rank 0 gets it, the others {}).
    """
    if isinstance(model, FSDPModule):
        return get_model_state_dict(model, options=_FULL)
    return unwrap_model(model).state_dict()


def load_model_state(model: nn.Module, weights: dict, strict: bool = True) -> None:
    """Load a whole state_dict (every rank passes it) into the wrapped model.

    ``strict=False`` lets keys be missing (fine-tuning leaves out a new head);
    those keep their values.
    """
    if isinstance(model, FSDPModule):
        options = dataclasses.replace(_FULL, strict=strict)
        set_model_state_dict(model, weights, options=options)
    else:
        unwrap_model(model).load_state_dict(weights, strict=strict)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole optimizer state on rank 0 ({} elsewhere for ZeRO and FSDP).

    A collective for ZeRO (consolidated on rank 0) and FSDP (gathered, keyed
    by parameter name instead of index).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if du.is_main_process() else {}
    if isinstance(model, FSDPModule):
        return get_optimizer_state_dict(model, optimizer, options=_FULL)
    return optimizer.state_dict()


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


def _rekey(state: dict, old: list, new: list) -> dict:
    """An optimizer state_dict with its parameter keys ``old`` renamed ``new``."""
    rename = dict(zip(old, new))
    groups = [
        {**group, "params": [rename[key] for key in group["params"]]}
        for group in state["param_groups"]
    ]
    states = {rename[key]: value for key, value in state["state"].items()}
    return {"state": states, "param_groups": groups}


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a state of :func:`optimizer_state_dict` (every rank passes it).

    States keyed by parameter index (DDP, ZeRO) and by parameter name (FSDP)
    are converted into each other, so a run can change strategy on resume.
    """
    owner = {param: name for name, param in unwrap_model(model).named_parameters()}
    names = [owner[p] for group in optimizer.param_groups for p in group["params"]]
    indices = list(range(len(names)))
    saved = [key for group in state["param_groups"] for key in group["params"]]
    by_name = any(isinstance(key, str) for key in saved)
    if isinstance(model, FSDPModule):
        full = state if by_name else _rekey(state, indices, names)
        set_optimizer_state_dict(model, optimizer, full, options=_FULL)
    else:
        optimizer.load_state_dict(_rekey(state, names, indices) if by_name else state)


@contextlib.contextmanager
def _frozen_norm_statistics(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers of ``module`` leave their running statistics alone.

    Used while activation checkpointing recomputes a block's forward pass,
    which would otherwise update the running statistics a second time.
    """
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    saved = [(m.momentum, m.num_batches_tracked) for m in norms]
    for norm in norms:
        norm.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
        if norm.num_batches_tracked is not None:
            norm.num_batches_tracked = norm.num_batches_tracked.clone()
    try:
        yield
    finally:
        for norm, (momentum, tracked) in zip(norms, saved):
            norm.momentum, norm.num_batches_tracked = momentum, tracked


def _recompute_contexts(block: nn.Module) -> tuple:
    """``checkpoint``'s (forward, recomputation) contexts for ``block``."""
    return contextlib.nullcontext(), _frozen_norm_statistics(block)


@functools.cache
def _recomputed_class(cls: type) -> type:
    """``cls`` with its forward pass recomputed in the backward pass
    (non-reentrant ``checkpoint``, running statistics frozen meanwhile).

    A subclass, put in place of a block's class: a ``forward`` set on the
    instance would be bound to that block, and DataParallel's replicas copy
    the instance's ``__dict__`` (``Module._replicate_for_data_parallel``), so
    every replica would run the original block's weights, on cuda:0.  A
    method of the class finds the module it is called on.
    """
    if getattr(cls, "_recomputes_forward", False):
        return cls

    class Recomputed(cls):
        _recomputes_forward = True

        def forward(self, *args, **kwargs):
            contexts = functools.partial(_recompute_contexts, self)
            return checkpoint(super().forward, *args, use_reentrant=False,
                              context_fn=contexts, **kwargs)  # fmt: skip

    Recomputed.__name__, Recomputed.__qualname__ = cls.__name__, cls.__qualname__
    return Recomputed


def _keeps_running_statistics(model: nn.Module) -> bool:
    """True when a layer of ``model`` keeps running statistics in buffers
    (BatchNorm's ``running_mean``/``running_var``, timm's EvoNorm ``running_var``)."""
    return any(
        name.rpartition(".")[2].startswith("running_")
        for name, _ in model.named_buffers()
    )


def _switch_on_timm_checkpointing(model: nn.Module) -> int:
    """timm's own activation checkpointing; the number of modules it switched on.

    Several timm models refuse with ``assert not enable`` (0 then, also under
    ``python -O``, where that assert vanishes and nothing is switched on).
    """
    with contextlib.suppress(AssertionError):
        model.set_grad_checkpointing(True)
    return sum(getattr(m, "grad_checkpointing", False) is True for m in model.modules())


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in the backward pass; blocks wrapped.

    Non-reentrant ``torch.utils.checkpoint`` around the forward of every block
    found by :func:`distribuuuu.models.find_blocks`, timm models included.
    Parameter names and results stay the same: the recomputation does not
    update BatchNorm running statistics again.

    A timm model none of whose blocks we know gets timm's own switch
    (``set_grad_checkpointing``; the count is then of the timm modules switched
    on) only when no layer keeps running statistics: timm's recomputation would
    update them a second time.  Otherwise, like any model without known blocks,
    it logs a warning and runs without activation checkpointing (0).
    """
    blocks = find_blocks(model)
    for block in blocks:
        block.__class__ = _recomputed_class(type(block))
    if blocks:
        return len(blocks)
    name, why = type(model).__name__, ""
    if hasattr(model, "set_grad_checkpointing"):  # a timm model
        if _keeps_running_statistics(model):
            why = (
                " (timm's own checkpointing would update its BatchNorm running "
                "statistics twice per step)"
            )
        elif switched := _switch_on_timm_checkpointing(model):
            logger.info(
                "MODEL.ACT_CKPT: %s: timm's own checkpointing (no running "
                "statistics to update twice)",
                name,
            )
            return switched
        else:
            why = " (timm does not support checkpointing it)"
    logger.warning(
        "MODEL.ACT_CKPT: %s has no residual or transformer blocks to "
        "checkpoint; nothing changes%s",
        name,
        why,
    )
    return 0
