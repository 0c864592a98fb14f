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

from distribuuuu.checkpoint.format import COMM_HOOK, SavedRun
from distribuuuu.dist import group as du
from distribuuuu.models.ema import ModelEma
from distribuuuu.models.syncbn import GroupSyncBatchNorm
from distribuuuu.strategies import comm_hooks
from distribuuuu.strategies.base import Strategy
from distribuuuu.strategies.gradients import average_gradients
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import StrategySpec

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
    takes_comm_hook = True
    # DIST.DDP.COMM_HOOK powersgd's state, saved with the checkpoint.
    powersgd: comm_hooks.PowerSGD | None = None

    @classmethod
    def check_layout(cls, spec: StrategySpec, world_size: int, skeleton) -> None:
        hook = spec.comm_hook.name
        if hook == "bf16" and spec.device is not None and spec.device.type != "cuda":
            raise ValueError(
                "DIST.DDP.COMM_HOOK 'bf16' is invalid: torch's bf16 hook needs "
                "NCCL, so CUDA devices; on the CPU use fp16 or powersgd"
            )

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
            self.powersgd = comm_hooks.register(model, self.spec.comm_hook)
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

    def save_weights(self, model, optimizer, ema, writer, name: str) -> dict:
        """The entries of :class:`Strategy`'s, and with PowerSGD every rank's
        state of it (a collective)."""
        entries = super().save_weights(model, optimizer, ema, writer, name)
        if self.powersgd is not None:
            states = du.gather_object_on_main(self.powersgd.state_dict())
            if states is not None:
                entries[COMM_HOOK] = states
        return entries

    def load_weights(
        self, model, optimizer, saved: SavedRun, ema: ModelEma | None
    ) -> bool:
        held_ema = super().load_weights(model, optimizer, saved, ema)
        found = saved.comm_hook_of(du.get_rank(), du.get_world_size())
        if self.powersgd is not None and found is not None:
            state, same_world = found
            if not same_world:
                logger.warning(
                    "%s was saved by another number of processes: PowerSGD's "
                    "error feedback starts at zero",
                    saved.path,
                )
            self.powersgd.load_state_dict(state, with_error=same_world)
        return held_ema

    def describe(self, model: nn.Module) -> str:
        if self.tensor_parallel is None:
            return self.name
        return self.tensor_parallel.describe(self.dims.dp, over="ddp")
