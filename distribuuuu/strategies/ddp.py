"""``DIST.STRATEGY ddp`` (the default): one process per device, every rank holds
the whole model and optimizer, DistributedDataParallel averages the gradients.

Without a process group (one process) the model simply runs on its device.
Under ``DIST.TENSOR_PARALLEL`` the replicas hold DTensor shards of the blocks,
which DDP does not take: their gradients are averaged over the ``dp`` axis
after backward instead (one all-reduce per step, this rank's shards only).
``MODEL.SYNCBN`` converts BatchNorm to synchronized BatchNorm: PyTorch's
``nn.SyncBatchNorm`` on CUDA, :class:`~distribuuuu.models.syncbn.GroupSyncBatchNorm`
elsewhere (PyTorch's refuses CPU modules).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distribuuuu.dist import group as du
from distribuuuu.models.syncbn import GroupSyncBatchNorm
from distribuuuu.strategies.base import Strategy, average_gradients
from distribuuuu.strategies.registry import register

logger = logging.getLogger(__name__)


def convert_syncbn(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with its BatchNorm synchronized across the processes."""
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        logger.info("SyncBN: torch.nn.SyncBatchNorm across processes")
    else:
        model = GroupSyncBatchNorm.convert_sync_batchnorm(model)
        logger.info("SyncBN: CPU SyncBN active (all_reduce over %s)", device.type)
    return model


@register
class DDPStrategy(Strategy):
    """DistributedDataParallel: replicated weights, all-reduced gradients."""

    name = "ddp"
    compiles = True
    takes_tensor_parallel = True

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if self.tensor_parallel is not None:  # reduce_gradients averages them
            return model
        device, distributed = self.device, du.is_distributed()
        if self.spec.syncbn and distributed:
            model = convert_syncbn(model, device)
        model = model.to(device)
        if distributed:
            device_ids = [device.index] if device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        return model

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """DDP's ``no_sync`` on the micro-batches that must not all-reduce."""
        if sync or not isinstance(model, DistributedDataParallel):
            yield
        else:
            with model.no_sync():
                yield

    def reduce_gradients(self, model: nn.Module) -> None:
        """Under tensor parallelism: this rank's gradient shards averaged over
        the replicas (DDP averaged the others during backward)."""
        if self.tensor_parallel is not None:
            params = list(model.parameters())
            average_gradients(params, self.dp_group, self.dims.dp)

    def describe(self, model: nn.Module) -> str:
        if self.tensor_parallel is None:
            return self.name
        return self.tensor_parallel.describe(self.dims.dp, over="ddp")
