"""``DIST.STRATEGY dp``: one process drives every visible GPU with DataParallel.

The batch is split across the GPUs in each forward pass and the gradients are
summed on the first; there is one process, one optimizer and one copy of the
state.  With fewer than two GPUs it falls back to the one device.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from distribuuuu.dist import group as du
from distribuuuu.strategies.base import Strategy, check_current_device
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import MICRO_BATCH_AUTO

logger = logging.getLogger(__name__)


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


class UnderAutocast:
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
    return [UnderAutocast(replica, device_type, dtype) for replica in replicas]


def gpus_from(device: torch.device, gpus: int) -> list[int]:
    """The indices of ``gpus`` CUDA devices, ``device``'s first: DataParallel
    keeps the module on its first device and gathers the outputs there, which
    must be where this process put the model and its batches."""
    first = 0 if device.index is None else device.index
    return [first, *(index for index in range(gpus) if index != first)]


@register
class DataParallelStrategy(Strategy):
    """DataParallel over all visible GPUs of one process."""

    name = "dp"
    one_device_per_process = False
    refused = {
        MICRO_BATCH_AUTO: "DIST.STRATEGY dp (DataParallel splits each batch over "
        "the GPUs of one process; a step tried on one GPU would not be the run's)"
    }

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if du.get_world_size() > 1:
            raise ValueError(
                "DIST.STRATEGY dp runs in one process; with several processes use "
                "DIST.STRATEGY ddp (the default)"
            )
        device = self.device
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        model = model.to(device)
        if gpus < 2:
            logger.warning(
                "DIST.STRATEGY dp: DataParallel needs 2 or more CUDA devices, found "
                "%d; falling back to one device (%s)",
                gpus,
                device,
            )
            return model
        logger.info("DataParallel over %d GPUs (batch split across them)", gpus)
        ids = gpus_from(device, gpus)
        wrapped = AutocastDataParallel(model, device_ids=ids, output_device=ids[0])
        check_current_device(device, "DataParallel")
        return wrapped

    def devices(self, model: nn.Module) -> list[torch.device]:
        """Every GPU of the DataParallel (or the one device it fell back to)."""
        if isinstance(model, nn.DataParallel) and model.device_ids:
            return [torch.device("cuda", index) for index in model.device_ids]
        return [self.device]
