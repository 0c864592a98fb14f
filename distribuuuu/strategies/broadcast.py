"""Rank 0's values on every rank: the weights a strategy starts from (each
rank built the model from its own seed), the buffers it evaluates with."""

from __future__ import annotations

import torch
from torch import nn

from distribuuuu.dist import group as du
from distribuuuu.models.wrappers import unwrap_model


def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank.

    After the last training step each rank has updated its running statistics
    with its own batch; evaluating with rank 0's copy everywhere makes the
    distributed evaluation equal to evaluating the saved checkpoint.
    """
    if du.is_distributed():
        for buffer in unwrap_model(model).buffers():
            torch.distributed.broadcast(buffer, src)


def broadcast_model(model: nn.Module) -> None:
    """Every rank's model made rank 0's (parameters and buffers), for a
    strategy that cuts the model up itself after building it on each rank
    from its own seed."""
    if du.is_distributed():
        for tensor in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(tensor.data, 0)
