"""The strategies by name: each registers itself in its own file.

A strategy's module calls :func:`register` on its class.  :data:`LAZY_INDEX`
says which module defines each name, so that asking for one strategy
imports that module alone: the pipeline's engine
(torch.distributed.pipelining, with flex attention), DCP and DeepSpeed's
glue take time to import, which a DDP run does not need.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distribuuuu.strategies.base import Strategy

# DIST.STRATEGY name -> the module of this package that registers it.
LAZY_INDEX = {
    "dp": "dp",
    "ddp": "ddp",
    "zero1": "zero1",
    "fsdp": "fsdp",
    "hsdp": "hsdp",
    "pipeline": "pipeline",
    "deepspeed": "deepspeed",
}

_REGISTERED: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` the strategy of its ``name`` (a class decorator)."""
    _REGISTERED[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``, its module imported on
    first use; KeyError for a name no module registers."""
    if name not in _REGISTERED and name in LAZY_INDEX:
        importlib.import_module(f"distribuuuu.strategies.{LAZY_INDEX[name]}")
    return _REGISTERED[name]


class _Strategies(Mapping):
    """DIST.STRATEGY name -> strategy class, each imported on first use."""

    def __getitem__(self, name: str) -> type[Strategy]:
        return strategy_class(name)

    def __iter__(self) -> Iterator[str]:
        return iter(LAZY_INDEX)

    def __len__(self) -> int:
        return len(LAZY_INDEX)


STRATEGIES: Mapping[str, type[Strategy]] = _Strategies()
