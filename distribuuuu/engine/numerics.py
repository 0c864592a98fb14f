"""Finite numbers only: the checks that stop a run whose loss or weights became
NaN or infinite before anything non-finite is saved."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distribuuuu.dist import group as du
from distribuuuu.errors import NonFiniteError

logger = logging.getLogger(__name__)

NONFINITE_ADVICE = (
    "lower OPTIM.BASE_LR or set OPTIM.CLIP_GRAD_NORM, and check that "
    "MODEL.WEIGHTS (if set) holds finite values"
)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point value of ``tensors`` is finite on every rank.

    A collective: each rank checks what it stores (its shard of a DTensor)
    and the answer is agreed over all ranks.  The tensors may lie on several
    devices (FSDP's CPU offload keeps the parameter shards in host memory and
    the buffers on the GPU): one reduction and one host synchronization per
    device, so call it at saves and print steps, not at every step.
    """
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            flags.setdefault(held.device, []).append(torch.isfinite(held).all())
    finite = all(bool(torch.stack(same).all()) for same in flags.values())
    return du.all_reduce_max_int(int(not finite)) == 0


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of a plain module, as this rank holds them."""
    return [*module.parameters(), *module.buffers()]


def check_weights_finite(tensors: list[torch.Tensor], what: str) -> None:
    """Raise NonFiniteError (on every rank) unless ``tensors`` are finite;
    ``what`` says where the run stands, for the message.  A collective."""
    if not all_finite(tensors):
        raise NonFiniteError(
            f"the weights became nan or inf by {what}; they were not saved; "
            + NONFINITE_ADVICE
        )


def nonfinite_loss(
    loss: float, scaled: bool, weights_finite, epoch: int, step: int, window: int
) -> None:
    """The window's loss (summed over all ranks, so the same on every rank) is
    NaN or inf: raise NonFiniteError, unless a GradScaler skipped those steps.

    With fp16 loss scaling (``scaled``) a step whose gradients overflow is
    skipped and the weights stay as they were: a non-finite loss then is a
    warning as long as ``weights_finite()`` (a collective).  Without it the
    step has already spoiled them.  ``epoch`` and ``step`` are 1-based;
    ``window``: the optimizer steps the loss was summed over.
    """
    if scaled and weights_finite():
        logger.warning(
            "the training loss was %s in epoch %d up to iteration %d; the "
            "GradScaler skipped those steps and the weights are finite; if this "
            "repeats, the fp16 forward pass overflows: use TRAIN.MIXED_PRECISION "
            "bf16 or none",
            loss,
            epoch,
            step,
        )
        return
    earlier = f" (or earlier, from iteration {step + 1 - window})" * (window > 1)
    raise NonFiniteError(
        f"the training loss became {loss} at epoch {epoch}, iteration "
        f"{step}{earlier}; nothing non-finite was saved; " + NONFINITE_ADVICE
    )
