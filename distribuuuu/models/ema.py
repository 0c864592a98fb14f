"""Exponential moving average (EMA) of a model's weights.

The average is kept as plain tensors beside the wrapped model, one per
parameter and floating-point buffer, shaped like the model's own: whole
tensors under DDP and ZeRO-1, this rank's DTensor shards under FSDP.  So an
update is a local ``torch._foreach_lerp_`` with no communication, and to
evaluate or save the average it is copied into the model for a while
(:meth:`ModelEma.swapped_in`), where evaluation and the model's state_dict
(gathered under FSDP) work as they do for the raw weights.

Under DDP every rank averages its own BatchNorm running statistics; as for
the raw model, evaluation and checkpoints use rank 0's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from distribuuuu import checkpoint as cp
from distribuuuu.models.wrappers import unwrap_model

logger = logging.getLogger(__name__)


def warmed_up_decay(decay: float, updates: int) -> float:
    """``decay``, lowered while few updates were made: min(decay, (1+n)/(10+n)).

    The early average then follows the fast-changing weights instead of
    remembering the random initialisation for thousands of steps.  The ramp
    is that of TensorFlow's ``tf.train.ExponentialMovingAverage`` given
    ``num_updates`` (0.1 at the first update, 0.91 after 90, 0.991 after 990).
    """
    return min(decay, (1 + updates) / (10 + updates))


def _averaged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter or floating buffer of ``model`` that the EMA follows.

    The names are those of the model's state_dict (without a DDP prefix).
    Integer buffers (BatchNorm's ``num_batches_tracked``) are counters, not
    weights, and stay the raw model's.  A tensor shared under two names
    (tied weights) is followed once.
    """
    tensors, seen = {}, set()
    for name, tensor in unwrap_model(model).state_dict(keep_vars=True).items():
        if tensor.is_floating_point() and id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    return tensors


def _drop_gathered_parameters(model: nn.Module) -> None:
    """FSDP: free the whole parameters a forward pass left gathered.

    FSDP2 keeps the root module's parameters gathered after a forward pass
    (``reshard_after_forward`` defaults to False for the root); the next
    forward pass would use them instead of gathering the shards again, and
    so miss a change to the shards.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores (its shard for a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach()


class ModelEma:
    """The EMA of a wrapped model, updated after optimizer steps.

    Args:
        model: the model as wrapped for the run (plain, DDP or FSDP); its
            parameters must stay the same objects for the whole run.
        decay: weight of the old average at each optimizer step (timm and
            torchvision's references use 0.9998-0.9999).
        warmup: lower the decay during the first updates
            (:func:`warmed_up_decay`).
        every: update every this many optimizer steps, with ``decay ** every``
            so that the average spans the same number of steps (torchvision's
            reference updates every 32 iterations to save time).
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool, every: int = 1):
        self.model, self.decay, self.warmup, self.every = model, decay, warmup, every
        self.steps = 0  # optimizer steps seen
        self.updates = 0  # averages taken (steps // every)
        with torch.no_grad():
            self.live = _averaged_tensors(model)
            self.average = {n: t.detach().clone() for n, t in self.live.items()}

    def reset(self) -> None:
        """Start the average afresh from the model's current weights."""
        self.steps = self.updates = 0
        with torch.no_grad():
            torch._foreach_copy_(self._locals(self.average), self._locals(self.live))

    def _locals(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # Looked up at each use rather than kept: FSDP2 may give a parameter a
        # new local tensor (a view of the same storage) when it loads weights.
        return [_local(tensors[name]) for name in self.live]

    def current_decay(self) -> float:
        """The per-step decay of the next update."""
        return warmed_up_decay(self.decay, self.updates) if self.warmup else self.decay

    @torch.no_grad()
    def step(self) -> None:
        """Count an optimizer step; average the weights every ``every`` steps.

        Call it after a step the optimizer took (not after one the GradScaler
        skipped, nor after each micro-batch of gradient accumulation).
        """
        self.steps += 1
        if self.steps % self.every:
            return
        weight = 1 - self.current_decay() ** self.every
        average, live = self._locals(self.average), self._locals(self.live)
        torch._foreach_lerp_(average, live, weight)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside, its own weights again after.

        Not a collective; no forward or backward pass may be running.  A
        state_dict taken inside may alias the model's tensors: save or copy it
        before leaving.
        """
        live = self._locals(self.live)
        _drop_gathered_parameters(self.model)
        with torch.no_grad():
            saved = [t.clone() for t in live]
            torch._foreach_copy_(live, self._locals(self.average))
        try:
            yield
        finally:
            _drop_gathered_parameters(self.model)
            with torch.no_grad():
                torch._foreach_copy_(live, saved)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The average by state_dict name (DTensor shards under FSDP).

        Fit for ``torch.save`` when whole, for ``torch.distributed.checkpoint``
        when sharded; :meth:`load` and :meth:`load_shards` read them back.
        """
        return dict(self.average)

    def counters(self) -> dict:
        """The step counts, which a checkpoint carries beside the tensors."""
        return {"steps": self.steps, "updates": self.updates}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], counters: dict) -> None:
        """Restore an average saved whole (every rank passes all of it).

        Under FSDP each rank cuts its own shard out of the whole tensors (no
        communication), so an average saved by any strategy and world size
        loads.
        """
        missing = sorted(set(self.average) - set(tensors))
        if missing:
            raise ValueError(f"the saved EMA lacks {missing[0]}; another model?")
        for name, average in self.average.items():
            saved = tensors[name]
            if isinstance(average, DTensor):  # cut out this rank's shard locally
                saved = distribute_tensor(
                    saved, average.device_mesh, average.placements, src_data_rank=None
                ).to_local()
            _local(average).copy_(saved)
        self._restore_counters(counters)

    def load_shards(self, directory: str, counters: dict) -> None:
        """Restore the average from a DCP checkpoint holding it as ``"ema"``.

        A collective under FSDP; DCP re-shards it for this world size.
        """
        cp.load_shards({"ema": self.tensors()}, directory)  # in place
        self._restore_counters(counters)

    def _restore_counters(self, counters: dict) -> None:
        self.steps, self.updates = counters["steps"], counters["updates"]
        logger.info("EMA restored (%d updates)", self.updates)
