"""Wrap a model for the run: device placement, SyncBN, DDP."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distribuuuu import distributed as du
from distribuuuu.syncbn import GroupSyncBatchNorm

logger = logging.getLogger(__name__)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP (or DataParallel) wrapper."""
    return model.module if hasattr(model, "module") else model


def wrap_model(
    model: nn.Module, device: torch.device, syncbn: bool, mode: str = "ddp"
) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it for the process group, if any.

    Args:
        model: the plain model.
        device: this process's one device.
        syncbn: convert BatchNorm to synchronized BatchNorm: PyTorch's
            ``nn.SyncBatchNorm`` on CUDA, :class:`GroupSyncBatchNorm` elsewhere.
        mode: "ddp", or "dp" for DataParallel over all visible GPUs in this
            one process (falls back to ``device`` alone with fewer than 2).
    """
    if mode == "dp":
        return _wrap_data_parallel(model, device)
    distributed = du.is_distributed()
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


def _wrap_data_parallel(model: nn.Module, device: torch.device) -> nn.Module:
    if du.get_world_size() > 1:
        raise ValueError(
            "DIST.MODE dp runs in one process; with several processes use "
            "DIST.MODE ddp (the default)"
        )
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    model = model.to(device)
    if gpus < 2:
        logger.warning(
            "DIST.MODE dp: DataParallel needs 2 or more CUDA devices, found %d; "
            "falling back to one device (%s)",
            gpus,
            device,
        )
        return model
    logger.info("DataParallel over %d GPUs (batch split across them)", gpus)
    return nn.DataParallel(model)


def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank.

    After the last training step each rank has updated its running statistics
    with its own batch; evaluating with rank 0's copy everywhere makes the
    distributed evaluation equal to evaluating the saved checkpoint.
    """
    if du.is_distributed():
        for buffer in unwrap_model(model).buffers():
            torch.distributed.broadcast(buffer, src)
