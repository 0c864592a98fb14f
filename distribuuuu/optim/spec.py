"""What the optimizer and the learning-rate schedule need to know of a run.

:class:`OptimizerSpec` is the optimizer and its parameter groups,
:class:`ScheduleSpec` the learning rate over the epochs.  The engine fills
both from the OPTIM section of the config (:mod:`distribuuuu.engine.specs`);
a test or a tool may build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer, its hyper-parameters and its parameter groups."""

    name: str  # OPTIM.OPTIMIZER: sgd, adamw, rmsprop, lamb or lars
    base_lr: float  # OPTIM.BASE_LR (the schedule sets it before every step)
    weight_decay: float  # OPTIM.WEIGHT_DECAY
    momentum: float  # OPTIM.MOMENTUM (sgd, rmsprop, lars)
    dampening: float  # OPTIM.DAMPENING (sgd)
    nesterov: bool  # OPTIM.NESTEROV (sgd)
    betas: tuple[float, float]  # OPTIM.BETAS (adamw, lamb)
    eps: float  # OPTIM.EPS (adamw, rmsprop, lamb)
    rmsprop_alpha: float  # OPTIM.RMSPROP_ALPHA
    lars_eta: float  # OPTIM.LARS_ETA
    no_decay_norm_bias: bool  # OPTIM.NO_DECAY_NORM_BIAS
    layer_decay: float  # OPTIM.LAYER_DECAY; 1: off


@dataclass(frozen=True)
class ScheduleSpec:
    """The learning rate at a fractional epoch: a policy, then warmup."""

    policy: str  # OPTIM.LR_POLICY: cos, steps, exp, linear or onecycle
    step: str  # OPTIM.LR_STEP: iter (every step) or epoch (its start)
    base_lr: float  # OPTIM.BASE_LR
    min_lr: float  # OPTIM.MIN_LR (cos, linear, onecycle)
    max_epoch: int  # OPTIM.MAX_EPOCH
    steps: tuple[float, ...]  # OPTIM.STEPS (steps)
    lr_mult: float  # OPTIM.LR_MULT (steps)
    lr_gamma: float  # OPTIM.LR_GAMMA (exp)
    onecycle_pct_start: float  # OPTIM.ONECYCLE_PCT_START
    onecycle_div_factor: float  # OPTIM.ONECYCLE_DIV_FACTOR
    warmup_epochs: float  # OPTIM.WARMUP_EPOCHS
    warmup_factor: float  # OPTIM.WARMUP_FACTOR
    reference_batch: int  # OPTIM.REFERENCE_BATCH; 0: no linear scaling
