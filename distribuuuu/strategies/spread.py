"""The state of a model whose weights are DTensors spread over the ranks
(sharded by FSDP, split by tensor parallelism, or both).

Whole state dicts are gathered through torch's distributed state_dict API on
rank 0's CPU; a training checkpoint is written sharded instead: every rank
saves its pieces with ``torch.distributed.checkpoint`` (DCP), nothing is
gathered, and DCP re-shards on load, so a run resumes on any world size.
:class:`~distribuuuu.strategies.base.Strategy` takes this way for such a
model; this module is imported only then (DCP takes time to import).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import SavedRun, sharded_entries

if TYPE_CHECKING:
    from distribuuuu.models.ema import ModelEma

# Whole (unsharded) state dicts, gathered on the CPU of rank 0.
WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def whole_model_state(model: nn.Module) -> dict:
    """The whole model, gathered on rank 0's CPU ({} elsewhere); a collective."""
    return get_model_state_dict(model, options=WHOLE)


def load_whole_model_state(model: nn.Module, weights: dict, strict: bool) -> None:
    """Load a whole state_dict (every rank passes it) into the spread model."""
    options = dataclasses.replace(WHOLE, strict=strict)
    set_model_state_dict(model, weights, options=options)


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole optimizer state keyed by parameter name; a collective."""
    return get_optimizer_state_dict(model, optimizer, options=WHOLE)


def load_whole_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a whole optimizer state keyed by parameter name."""
    set_optimizer_state_dict(model, optimizer, state, options=WHOLE)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards of the model and its optimizer, for DCP to save."""
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: str
) -> None:
    """Load a DCP checkpoint of :func:`sharded_state` into the spread model.

    A collective.  DCP reads the pieces of this rank's shards, whatever the
    world size that saved them.
    """
    state = sharded_state(model, optimizer)
    cp.load_shards(state, directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def save_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: ModelEma | None,
    writer: cp.CheckpointWriter,
    name: str,
) -> dict:
    """Every rank has ``writer`` write its shards (the EMA's too) into
    checkpoint ``name``'s DCP folder; the checkpoint entries that name them."""
    shards = sharded_state(model, optimizer)
    if ema is not None:
        shards["ema"] = ema.tensors()
    folder, manifest = writer.sharded(name, shards)
    return sharded_entries(folder, manifest)


def load_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: SavedRun,
    ema: ModelEma | None,
) -> bool:
    """Each rank reads its own shards of the sharded checkpoint ``saved``;
    True if it held an EMA to load into ``ema``."""
    directory = cp.shards_of(saved.path, saved.state)
    load_sharded_state(model, optimizer, directory)
    if ema is None or not saved.has_ema:
        return False
    ema.load_shards(directory, saved.ema_counters)
    return True
