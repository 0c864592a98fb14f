"""``DIST.STRATEGY zero1``: DDP, with the optimizer state sharded across ranks
(ZeRO stage 1, PyTorch's ``ZeroRedundancyOptimizer``).

Each rank keeps the optimizer state of its share of the parameters and
updates that share; the updated parameters are broadcast to the others, one
bucket per rank (``parameters_as_bucket_view``: the parameters become views
of flat buffers, each in its own layout again, see :func:`restore_strides`).
Checkpoints hold the whole optimizer state, consolidated on rank 0.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from distribuuuu.dist import group as du
from distribuuuu.strategies.ddp import DDPStrategy
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import MICRO_BATCH_AUTO

logger = logging.getLogger(__name__)


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` rebuilt as a ZeroRedundancyOptimizer (ZeRO stage 1).

    Each rank keeps the state of its share of the parameters only; the
    parameter groups and hyper-parameters stay those of ``optimizer``.  Without
    a process group there is nothing to shard and ``optimizer`` is returned.
    """
    if not du.is_distributed():
        logger.info("DIST.STRATEGY zero1 in one process: nothing to shard")
        return optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layouts = [(param, param.stride()) for param in params]
    bucketed = fit_one_bucket(params)
    sharded = ZeroRedundancyOptimizer(
        [dict(group) for group in optimizer.param_groups],
        optimizer_class=type(optimizer),
        parameters_as_bucket_view=bucketed,
        **constructor_options(optimizer),
    )
    restored = restore_strides(layouts) if bucketed else 0
    logger.info(
        "ZeRO-1: optimizer state sharded over %d ranks; %s",
        du.get_world_size(),
        f"the parameters views of one bucket per rank ({restored} re-strided)"
        if bucketed
        else "the parameters broadcast one by one (several dtypes, or sparse)",
    )
    return sharded


def fit_one_bucket(params: list[torch.Tensor]) -> bool:
    """Whether ``parameters_as_bucket_view`` may copy ``params`` into flat
    buckets: dense tensors of one dtype (torch makes each device's bucket of
    the dtype of its last parameter)."""
    dense = all(param.layout == torch.strided for param in params)
    return dense and len({param.dtype for param in params}) == 1


def restore_strides(layouts: list[tuple[torch.Tensor, tuple[int, ...]]]) -> int:
    """Each parameter laid out again in its own strides, in its slot of the
    bucket that ``parameters_as_bucket_view`` made of it; how many moved.

    torch copies a parameter into its bucket flattened (in logical order) and
    views its slot with contiguous strides: a channels-last weight keeps its
    values and loses its layout, so its convolutions mix layouts and DDP,
    whose gradient buckets were laid out when it wrapped the model, warns
    ("Grad strides do not match bucket view strides") and copies.  A dense
    layout, as ``.to(memory_format=...)`` makes, fills exactly the slot's
    numel places, so the values are written back into the same slot in the
    old strides.  Every rank does the same, so each broadcast bucket's bytes
    land where every rank reads them.  (torch builds the buckets again only
    where the trainable parameters change, which training here never does.)
    """
    restored = 0
    for param, stride in layouts:
        if param.stride() == stride or not is_dense(param.shape, stride):
            continue
        values = param.detach().clone()
        param.data = param.data.as_strided(param.shape, stride)
        param.data.copy_(values)
        restored += 1
    return restored


def is_dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` fills its ``numel``
    places of storage exactly once, in some order of its dimensions."""
    expected = 1
    for step, size in sorted((s, n) for n, s in zip(shape, stride) if n != 1):
        if step != expected:
            return False
        expected *= size
    return True


def constructor_options(optimizer: torch.optim.Optimizer) -> dict:
    """The hyper-parameters that build ``optimizer`` again: its defaults that
    its class's constructor takes (torch's AdamW records
    ``decoupled_weight_decay`` among its defaults but refuses it as an
    argument)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def consolidate_on_rank_0(optimizer: ZeroRedundancyOptimizer) -> None:
    """What ``optimizer.consolidate_state_dict(to=0)`` does, in one gather.

    torch's own broadcasts each rank's shard to every rank and makes a tensor
    of its pickled bytes through a Python sequence (``torch.ByteTensor`` of a
    bytearray): about 0.1 s per MB here, 11 s of each save of AlexNet's SGD
    momentum on 2 ranks, minutes for a large model's AdamW state.
    Here each shard, moved to the CPU, goes to rank 0 only, in one gather
    through host memory (:func:`distribuuuu.dist.group.gather_object_on_main`).
    Rank 0 keeps the shards where ``optimizer.state_dict()`` reads them, the
    private ``_all_state_dicts`` (tests/strategies/test_parallel.py checks
    that the result equals torch's consolidation).
    """
    local = optimizer.optim.state_dict()
    local["state"] = {
        index: {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
        for index, state in local["state"].items()
    }
    shards = du.gather_object_on_main(local)
    if shards is not None:
        optimizer._all_state_dicts = shards  # type: ignore[attr-defined]


@register
class Zero1Strategy(DDPStrategy):
    """DDP with a ZeroRedundancyOptimizer."""

    name = "zero1"
    takes_tensor_parallel = False
    refused = {
        MICRO_BATCH_AUTO: "DIST.STRATEGY zero1 (its optimizer step broadcasts "
        "each rank's share of the parameters: no rank can try a step alone)"
    }

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return shard_optimizer(super().build_optimizer(model))

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict:
        """The whole state, consolidated on rank 0 ({} elsewhere); a collective."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):  # one process
            return optimizer.state_dict()
        consolidate_on_rank_0(optimizer)
        return optimizer.state_dict() if du.is_main_process() else {}
