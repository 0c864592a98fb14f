"""Ways of spreading one model over devices and processes, one file each.

``DIST.STRATEGY`` picks one through :data:`STRATEGIES`.  Every strategy
implements the contract of :class:`~distribuuuu.strategies.base.Strategy`.
Adding one means: its file here, one line below, its name among the config's
choices (``distribuuuu/config``), and its tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

import torch
from yacs.config import CfgNode

from distribuuuu.strategies.base import Strategy, unwrap_model

# Name -> (module of distribuuuu.strategies, class).  A strategy's module is
# imported when the strategy is first asked for: the pipeline's engine
# (torch.distributed.pipelining, with flex attention) and DCP take about
# 0.4 s to import, which a DDP run does not need.
_WHERE = {
    "dp": ("dp", "DataParallelStrategy"),
    "ddp": ("ddp", "DDPStrategy"),
    "zero1": ("zero1", "Zero1Strategy"),
    "fsdp": ("fsdp", "FSDPStrategy"),
    "pipeline": ("pipeline", "PipelineStrategy"),
    "deepspeed": ("deepspeed", "DeepSpeedStrategy"),
    "tensor": ("tensor", "TensorParallelStrategy"),  # DIST.TENSOR_PARALLEL > 1
}


class _Registry(Mapping):
    """DIST.STRATEGY name -> strategy class, each imported on first use."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def __getitem__(self, name: str) -> type[Strategy]:
        if name not in self.names:
            raise KeyError(name)
        module, cls = _WHERE[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


STRATEGIES: Mapping[str, type[Strategy]] = _Registry(
    ("dp", "ddp", "zero1", "fsdp", "pipeline", "deepspeed")
)


def strategy_class(cfg: CfgNode) -> type[Strategy]:
    """The strategy class that ``DIST.STRATEGY`` names; tensor parallelism
    (``DIST.TENSOR_PARALLEL`` > 1) wraps ddp or fsdp over its replicas."""
    if cfg.DIST.TENSOR_PARALLEL > 1:
        return _Registry(("tensor",))["tensor"]
    return STRATEGIES[cfg.DIST.STRATEGY]


def build_strategy(
    cfg: CfgNode, device: torch.device, amp_dtype: torch.dtype | None = None
) -> Strategy:
    """The strategy of ``cfg`` for this process's ``device`` and autocast dtype."""
    return strategy_class(cfg)(cfg, device, amp_dtype)


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "strategy_class", "unwrap_model"]
