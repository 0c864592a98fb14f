"""Ways of spreading one model over devices and processes, one file each.

``DIST.STRATEGY`` picks one through :data:`STRATEGIES`.  Every strategy
implements the contract of :class:`~distribuuuu.strategies.base.Strategy`.
Adding one means: its file here, one line below, its name among the config's
choices (``distribuuuu/config``), and its tests.
"""

from __future__ import annotations

import torch
from yacs.config import CfgNode

from distribuuuu.strategies.base import Strategy, unwrap_model
from distribuuuu.strategies.ddp import DDPStrategy
from distribuuuu.strategies.deepspeed import DeepSpeedStrategy
from distribuuuu.strategies.dp import DataParallelStrategy
from distribuuuu.strategies.fsdp import FSDPStrategy
from distribuuuu.strategies.pipeline import PipelineStrategy
from distribuuuu.strategies.tensor import TensorParallelStrategy
from distribuuuu.strategies.zero1 import Zero1Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "zero1": Zero1Strategy,
    "fsdp": FSDPStrategy,
    "pipeline": PipelineStrategy,
    "deepspeed": DeepSpeedStrategy,
}


def strategy_class(cfg: CfgNode) -> type[Strategy]:
    """The strategy class that ``DIST.STRATEGY`` names; tensor parallelism
    (``DIST.TENSOR_PARALLEL`` > 1) wraps ddp or fsdp over its replicas."""
    if cfg.DIST.TENSOR_PARALLEL > 1:
        return TensorParallelStrategy
    return STRATEGIES[cfg.DIST.STRATEGY]


def build_strategy(
    cfg: CfgNode, device: torch.device, amp_dtype: torch.dtype | None = None
) -> Strategy:
    """The strategy of ``cfg`` for this process's ``device`` and autocast dtype."""
    return strategy_class(cfg)(cfg, device, amp_dtype)


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "strategy_class", "unwrap_model"]
