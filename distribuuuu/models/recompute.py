"""Activation checkpointing (``MODEL.ACT_CKPT``): recompute each block's
activations in the backward pass instead of keeping them, trading compute for
memory; BatchNorm running statistics are not updated twice."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from distribuuuu.models import find_blocks

logger = logging.getLogger(__name__)


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
            return checkpoint(
                super().forward,
                *args,
                use_reentrant=False,
                context_fn=contexts,
                **kwargs,
            )

    Recomputed.__name__, Recomputed.__qualname__ = cls.__name__, cls.__qualname__
    return Recomputed


def _keeps_running_statistics(model: nn.Module) -> bool:
    """True when a layer of ``model`` keeps running statistics in buffers
    (BatchNorm's ``running_mean``/``running_var``, timm's EvoNorm ``running_var``)."""
    return any(
        name.rpartition(".")[2].startswith("running_")
        for name, _ in model.named_buffers()
    )


def _switch_on_timm_checkpointing(model: Any) -> int:
    """timm's own activation checkpointing; the number of modules it switched on
    (``model``: a timm model, whose set_grad_checkpointing torch does not type).

    Several timm models refuse with ``assert not enable`` (0 then, also under
    ``python -O``, where that assert vanishes and nothing is switched on).
    """
    with contextlib.suppress(AssertionError):
        model.set_grad_checkpointing(enable=True)
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
        # A class is hashable; mypy checks Module's __hash__ (an instance's).
        block.__class__ = _recomputed_class(type(block))  # type: ignore[arg-type]
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
