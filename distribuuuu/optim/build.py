"""Optimizer, parameter groups and learning-rate policy (set per iteration).

The optimizer is SGD, AdamW, RMSProp (TensorFlow's), LAMB or LARS over the
trainable parameters, in one group, or in two with ``OPTIM.NO_DECAY_NORM_BIAS``
(normalization parameters and biases without weight decay; LAMB and LARS
always split them off, without trust ratio).  :func:`lr_at` gives the
learning rate at a fractional epoch from the ``OPTIM.LR_POLICY`` function of
:data:`LR_POLICY_FUNCTIONS`, times the linear warmup; the trainer sets it with
:func:`set_lr` before every optimizer step (at the epoch :func:`lr_epoch`
says).  :func:`reference_lr_scale` is the linear scaling rule.  What they
read of the OPTIM section comes in :mod:`distribuuuu.optim.spec`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from distribuuuu.optim.optimizers import Lamb, Lars, RMSpropTF
from distribuuuu.optim.spec import OptimizerSpec, ScheduleSpec

logger = logging.getLogger(__name__)

# Module types whose own parameters are normalization scales and shifts.
# _BatchNorm covers BatchNorm1d/2d/3d, nn.SyncBatchNorm and distribuuuu's
# GroupSyncBatchNorm; the LayerNorm2d of torchvision's ConvNeXt and timm's norm
# layers subclass these types.
NORM_LAYERS = (_BatchNorm, _InstanceNorm, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


def _is_bias(name: str) -> bool:
    """Whether a parameter's name inside its own module names a bias.

    ``bias`` (Linear, Conv, norms) or ``*_bias`` (``in_proj_bias`` of
    nn.MultiheadAttention, as in torchvision's ViT; ``q_bias`` of timm's BEiT).
    """
    return name == "bias" or name.endswith("_bias")


def split_weight_decay(
    model: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters as (decayed, not decayed: norm layers' and biases).

    Norm layers are found by module type (:data:`NORM_LAYERS`), never by name.
    Class tokens and position embeddings of ViTs are neither, so they are
    decayed, as in torchvision's reference recipes, which exempt them with a
    separate switch (``--transformer-embedding-decay``).  Each list keeps the
    order of ``model.parameters()``; a shared parameter is counted once.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen = set()
    for module in model.modules():
        is_norm = isinstance(module, NORM_LAYERS)
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if is_norm or _is_bias(name) else decay).append(param)
    return decay, no_decay


# Optimizers that scale each tensor's update by a trust ratio, which the norm
# layers and biases do without.
TRUST_RATIO = ("lamb", "lars")


def layer_scales(model: nn.Module, decay: float) -> dict[int, float]:
    """OPTIM.LAYER_DECAY: each parameter's (by id) learning-rate factor
    ``decay ** (L + 1 - layer id)``; ValueError for a model without layer ids."""
    from distribuuuu.models.layers import layer_ids

    model = getattr(model, "module", model)  # inside a DDP or DataParallel
    found = layer_ids(model)
    if found is None:
        raise ValueError(
            f"OPTIM.LAYER_DECAY: {type(model).__name__} has no layer ids (ViTs "
            "and ConvNeXt have); set it to 1 (off)"
        )
    ids, blocks = found
    return {
        id(param): decay ** (blocks + 1 - ids[name])
        for name, param in model.named_parameters()
    }


def build_param_groups(model: nn.Module, spec: OptimizerSpec) -> list:
    """The optimizer's parameters: one list, or groups.

    With ``OPTIM.NO_DECAY_NORM_BIAS`` the decayed parameters, then those with
    ``weight_decay`` 0 (norm layers, biases).  lamb and lars always split those
    off, without trust ratio (and without weight decay only with
    NO_DECAY_NORM_BIAS).  ``OPTIM.LAYER_DECAY`` < 1 splits each of these by
    layer, each group with its ``lr_scale``.  Empty groups are left out; with
    none of the three, the trainable parameters as one list, as before the
    switches existed.
    """
    trust = spec.name in TRUST_RATIO
    split = spec.no_decay_norm_bias or trust
    layered = spec.layer_decay < 1
    if not (split or layered):
        return [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = split_weight_decay(model)
    plain: dict = {}
    if spec.no_decay_norm_bias:
        plain["weight_decay"] = 0.0
    if trust:
        plain["trust_ratio"] = False
    kinds = [(decay, {}), (no_decay, plain)] if split else [(decay + no_decay, {})]
    scales = layer_scales(model, spec.layer_decay) if layered else {}
    groups: list[dict] = []
    for params, options in kinds:
        by_scale: dict[float, dict] = {}
        for param in params:
            scale = scales.get(id(param), 1.0)
            if scale not in by_scale:
                extra = {"lr_scale": scale} if layered else {}
                by_scale[scale] = {"params": [], **options, **extra}
                groups.append(by_scale[scale])
            by_scale[scale]["params"].append(param)
    return groups


def _sgd(params: list, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """SGD with the original Distribuuuu keys."""
    return torch.optim.SGD(
        params,
        lr=spec.base_lr,
        momentum=spec.momentum,
        dampening=spec.dampening,
        nesterov=spec.nesterov,
        weight_decay=spec.weight_decay,
    )


def _adamw(params: list, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019): weight decay decoupled from the gradient."""
    beta1, beta2 = spec.betas
    return torch.optim.AdamW(
        params,
        lr=spec.base_lr,
        betas=(float(beta1), float(beta2)),
        eps=spec.eps,
        weight_decay=spec.weight_decay,
    )


def _rmsprop(params: list, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """TensorFlow's RMSProp (EfficientNet's optimizer)."""
    return RMSpropTF(
        params,
        lr=spec.base_lr,
        alpha=spec.rmsprop_alpha,
        eps=spec.eps,
        momentum=spec.momentum,
        weight_decay=spec.weight_decay,
    )


def _lamb(params: list, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """LAMB: AdamW's update scaled per tensor by its trust ratio."""
    beta1, beta2 = spec.betas
    return Lamb(
        params,
        lr=spec.base_lr,
        betas=(float(beta1), float(beta2)),
        eps=spec.eps,
        weight_decay=spec.weight_decay,
    )


def _lars(params: list, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """LARS: momentum SGD with a per-tensor local learning rate."""
    return Lars(
        params,
        lr=spec.base_lr,
        momentum=spec.momentum,
        weight_decay=spec.weight_decay,
        eta=spec.lars_eta,
    )


# OPTIM.OPTIMIZER -> constructor from (parameters or groups, spec).
OPTIMIZERS: dict[str, Callable[[list, OptimizerSpec], torch.optim.Optimizer]] = {
    "sgd": _sgd,
    "adamw": _adamw,
    "rmsprop": _rmsprop,
    "lamb": _lamb,
    "lars": _lars,
}


def state_tensors(spec: OptimizerSpec) -> int:
    """Tensors of optimizer state per parameter tensor (the size of memory
    that the optimizer keeps, in parameters)."""
    if spec.name == "sgd":
        return int(spec.momentum > 0)
    return {"adamw": 2, "rmsprop": 2, "lamb": 2, "lars": 1}[spec.name]


def describe_param_groups(optimizer: torch.optim.Optimizer) -> str:
    """One line: each group's weight decay, tensors and parameters."""
    parts = [
        f"weight decay {group['weight_decay']:g}"
        + " without trust ratio" * (group.get("trust_ratio") is False)
        + (f", lr x {group['lr_scale']:.4g}" if "lr_scale" in group else "")
        + f" on {len(group['params'])} tensors "
        f"({sum(p.numel() for p in group['params']):,} parameters)"
        for group in optimizer.param_groups
    ]
    return f"{len(parts)} parameter group(s): " + "; ".join(parts)


def build_optimizer(model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The ``OPTIM.OPTIMIZER`` over the trainable parameters; logs its groups."""
    name = spec.name
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown OPTIM.OPTIMIZER {name!r}")
    optimizer = OPTIMIZERS[name](build_param_groups(model, spec), spec)
    logger.info("optimizer %s, %s", name, describe_param_groups(optimizer))
    return optimizer


def _anneal(start: float, end: float, fraction: float) -> float:
    """Half a cosine from ``start`` (fraction 0) to ``end`` (fraction 1)."""
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * fraction))


def cos_lr(spec: ScheduleSpec, epoch: float) -> float:
    """Cosine from BASE_LR (epoch 0) to MIN_LR (MAX_EPOCH and after)."""
    progress = min(epoch / spec.max_epoch, 1.0)
    return _anneal(spec.base_lr, spec.min_lr, progress)


def steps_lr(spec: ScheduleSpec, epoch: float) -> float:
    """BASE_LR * LR_MULT ** (number of STEPS <= epoch)."""
    passed = sum(1 for step in spec.steps if epoch >= step)
    return spec.base_lr * spec.lr_mult**passed


def exp_lr(spec: ScheduleSpec, epoch: float) -> float:
    """BASE_LR * LR_GAMMA ** epoch, continuous in the fractional epoch."""
    return spec.base_lr * spec.lr_gamma**epoch


def linear_lr(spec: ScheduleSpec, epoch: float) -> float:
    """Straight line from BASE_LR (epoch 0) to MIN_LR (MAX_EPOCH and after)."""
    progress = min(epoch / spec.max_epoch, 1.0)
    return spec.base_lr + (spec.min_lr - spec.base_lr) * progress


def onecycle_lr(spec: ScheduleSpec, epoch: float) -> float:
    """One cycle: a cosine rise to BASE_LR, then a cosine fall to MIN_LR.

    From BASE_LR / ONECYCLE_DIV_FACTOR at epoch 0 to BASE_LR at epoch
    ONECYCLE_PCT_START * MAX_EPOCH, then to MIN_LR at MAX_EPOCH: torch's
    OneCycleLR with anneal_strategy "cos" in continuous epochs, ending at
    MIN_LR instead of a divided initial rate.
    """
    peak = spec.onecycle_pct_start * spec.max_epoch
    if epoch < peak:
        start = spec.base_lr / spec.onecycle_div_factor
        return _anneal(start, spec.base_lr, epoch / peak)
    progress = min((epoch - peak) / (spec.max_epoch - peak), 1.0)
    return _anneal(spec.base_lr, spec.min_lr, progress)


# OPTIM.LR_POLICY -> learning rate at a fractional epoch, before warmup.
LR_POLICY_FUNCTIONS: dict[str, Callable[[ScheduleSpec, float], float]] = {
    "cos": cos_lr,
    "steps": steps_lr,
    "exp": exp_lr,
    "linear": linear_lr,
    "onecycle": onecycle_lr,
}


def lr_at(spec: ScheduleSpec, epoch: float) -> float:
    """Learning rate at fractional ``epoch`` (e.g. 2.5 = half-way through epoch 2).

    The ``OPTIM.LR_POLICY`` function of :data:`LR_POLICY_FUNCTIONS`; during the
    first WARMUP_EPOCHS it is multiplied by a factor rising linearly from
    WARMUP_FACTOR to 1 (every policy, onecycle included).
    """
    policy = LR_POLICY_FUNCTIONS.get(spec.policy)
    if policy is None:
        raise ValueError(f"unknown OPTIM.LR_POLICY {spec.policy!r}")
    lr = policy(spec, epoch)
    if epoch < spec.warmup_epochs:
        alpha = epoch / spec.warmup_epochs
        lr *= spec.warmup_factor * (1.0 - alpha) + alpha
    return lr


def reference_lr_scale(spec: ScheduleSpec, global_batch: int) -> float:
    """Linear scaling rule: global_batch / REFERENCE_BATCH (1.0 when it is 0).

    Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): BASE_LR is then the
    learning rate of REFERENCE_BATCH images.
    """
    if spec.reference_batch <= 0:
        return 1.0
    return global_batch / spec.reference_batch


def lr_epoch(spec: ScheduleSpec, epoch: int, fraction: float) -> float:
    """Where in the schedule a step ``fraction`` of the way into ``epoch``
    takes its learning rate: there (``OPTIM.LR_STEP iter``), or at the
    epoch's start (``epoch``, as timm's and torchvision's scripts step it)."""
    return epoch + fraction if spec.step == "iter" else float(epoch)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (times its
    ``lr_scale`` under OPTIM.LAYER_DECAY)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
