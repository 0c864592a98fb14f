"""What a strategy is told about the run: :class:`StrategySpec`.

The few values the strategies read (of DIST, MODEL, TRAIN and OPTIM), the
device chosen for the process and the precision the run resolved, in small
frozen dataclasses.  ``distribuuuu.engine.specs.strategy_spec`` fills them
from the config; nothing here reads it.  The names of what a strategy may
refuse (:data:`SYNCBN`, :data:`FP16`, ...) are pre-flight's words for the
features that the config turns on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Features a strategy may refuse (see Strategy.refusals): pre-flight maps
# each to the key that turns it on.
SYNCBN = "syncbn"
PRECISE_BN = "precise_bn"
LAYER_DECAY = "layer_decay"
EMA = "ema"
FP16 = "fp16"
DISTILLATION = "distillation"
ASYNC_CHECKPOINT = "async_checkpoint"
# TRAIN.MICRO_BATCH auto: each rank tries a step alone, outside any collective.
MICRO_BATCH_AUTO = "micro_batch_auto"
# Each feature's key, and when its value turns the feature on (for pre-flight
# and the planner: engine.specs.turned_on).
SWITCHES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    SYNCBN: ("MODEL.SYNCBN", bool),
    PRECISE_BN: ("TRAIN.PRECISE_BN", bool),
    LAYER_DECAY: ("OPTIM.LAYER_DECAY", lambda value: value != 1),
    EMA: ("MODEL.EMA", bool),
    FP16: ("TRAIN.MIXED_PRECISION", lambda value: value == "fp16"),
    DISTILLATION: ("TRAIN.DISTILL.ARCH", bool),
    ASYNC_CHECKPOINT: ("CHECKPOINT.ASYNC", bool),
    MICRO_BATCH_AUTO: ("TRAIN.MICRO_BATCH", lambda value: value == "auto"),
}


def check_value(ok: bool, key: str, value: Any, allowed: str) -> None:
    """ValueError unless ``ok``, in the config's words: ``KEY value is
    invalid: allowed``."""
    if not ok:
        raise ValueError(f"{key} {value!r} is invalid: {allowed}")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """DIST.PIPELINE: stages, micro-batches (0 resolved to twice the stages),
    schedule, virtual stages per process and the stage starts asked for."""

    stages: int = 2
    micro_batches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: tuple[str, ...] = ()

    @property
    def pieces(self) -> int:
        """Pieces the model is cut into: stages, times the virtual stages
        of an interleaved schedule."""
        interleaved = self.schedule == "interleaved_1f1b"
        return self.stages * (self.virtual_stages if interleaved else 1)


@dataclasses.dataclass(frozen=True)
class DeepSpeedSpec:
    """DIST.DEEPSPEED: the ZeRO stage, what is offloaded where, and a user's
    ``ds_config.json`` ('' for none)."""

    zero_stage: int = 2
    offload_optimizer: str = "none"
    offload_params: str = "none"
    nvme_path: str = ""
    config: str = ""


@dataclasses.dataclass(frozen=True)
class CommHookSpec:
    """DIST.DDP: DDP's communication hook and PowerSGD's rank and first
    compressed step."""

    name: str = "none"
    powersgd_rank: int = 2
    powersgd_start_iter: int = 20


def _no_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    raise ValueError("this StrategySpec was built without an optimizer recipe")


def _no_param_groups(model: nn.Module) -> list:
    raise ValueError("this StrategySpec was built without an optimizer recipe")


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """Everything a strategy reads, built once per run.

    ``device`` is None before the process has chosen one (pre-flight, and
    the launch's own questions); ``precision`` is TRAIN.MIXED_PRECISION as
    the run resolved it (never ``auto`` once the device is known) and
    ``amp_dtype`` its autocast dtype (None: full precision).
    ``build_optimizer`` and ``param_groups`` are OPTIM's optimizer and
    parameter groups over a model; ``optimizer_state_tensors`` the tensors
    of state it keeps per parameter.  ``hsdp_shard_size`` is
    DIST.HSDP.SHARD_SIZE (0: ``local_world_size``, the processes on this
    node, itself 0 where the launch is to tell at run time).
    """

    name: str = "ddp"
    device: torch.device | None = None
    precision: str = "none"
    amp_dtype: torch.dtype | None = None
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    fsdp_cpu_offload: bool = False
    hsdp_shard_size: int = 0
    local_world_size: int = 0
    syncbn: bool = False
    arch: str = ""
    image_size: int = 224
    batch_size: int = 32
    accum_steps: int = 1
    clip_grad_norm: float = 0.0
    activation_checkpointing: bool = False
    channels_last: bool = False
    compile_model: bool = False
    compile_mode: str = "default"
    # TRAIN.PROGRESSIVE: the training crops of the run (1: one size), each
    # of which MODEL.COMPILE compiles once
    train_sizes: int = 1
    pipeline: PipelineSpec = PipelineSpec()
    deepspeed: DeepSpeedSpec = DeepSpeedSpec()
    comm_hook: CommHookSpec = CommHookSpec()
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _no_optimizer
    param_groups: Callable[[nn.Module], list] = _no_param_groups
    optimizer_state_tensors: int = 1
