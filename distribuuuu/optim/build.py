"""Optimizer, parameter groups and learning-rate policy (set per iteration).

The optimizer is SGD, AdamW, RMSProp (TensorFlow's), LAMB or LARS over the
trainable parameters, in one group, or in two with ``OPTIM.NO_DECAY_NORM_BIAS``
(normalization parameters and biases without weight decay; LAMB and LARS
always split them off, without trust ratio).  :func:`lr_at` gives the
learning rate at a fractional epoch from the ``OPTIM.LR_POLICY`` function of
:data:`LR_POLICY_FUNCTIONS`, times the linear warmup; the trainer sets it with
:func:`set_lr` before every optimizer step (at the epoch :func:`lr_epoch`
says).  :func:`reference_lr_scale` is the linear scaling rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from yacs.config import CfgNode

from distribuuuu.optim.optimizers import Lamb, Lars, RMSpropTF

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
    decay, no_decay, seen = [], [], set()
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


def build_param_groups(model: nn.Module, optim_cfg: CfgNode) -> list:
    """The optimizer's parameters: one list, or groups.

    With ``OPTIM.NO_DECAY_NORM_BIAS`` the decayed parameters, then those with
    ``weight_decay`` 0 (norm layers, biases).  lamb and lars always split those
    off, without trust ratio (and without weight decay only with
    NO_DECAY_NORM_BIAS).  ``OPTIM.LAYER_DECAY`` < 1 splits each of these by
    layer, each group with its ``lr_scale``.  Empty groups are left out; with
    none of the three, the trainable parameters as one list, as before the
    switches existed.
    """
    trust = optim_cfg.OPTIMIZER in TRUST_RATIO
    split = optim_cfg.NO_DECAY_NORM_BIAS or trust
    layered = optim_cfg.LAYER_DECAY < 1
    if not (split or layered):
        return [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = split_weight_decay(model)
    plain: dict = {}
    if optim_cfg.NO_DECAY_NORM_BIAS:
        plain["weight_decay"] = 0.0
    if trust:
        plain["trust_ratio"] = False
    kinds = [(decay, {}), (no_decay, plain)] if split else [(decay + no_decay, {})]
    scales = layer_scales(model, optim_cfg.LAYER_DECAY) if layered else {}
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


def _sgd(params: list, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """SGD with the original Distribuuuu keys."""
    return torch.optim.SGD(
        params,
        lr=optim_cfg.BASE_LR,
        momentum=optim_cfg.MOMENTUM,
        dampening=optim_cfg.DAMPENING,
        nesterov=optim_cfg.NESTEROV,
        weight_decay=optim_cfg.WEIGHT_DECAY,
    )


def _adamw(params: list, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019): weight decay decoupled from the gradient."""
    beta1, beta2 = optim_cfg.BETAS
    return torch.optim.AdamW(
        params,
        lr=optim_cfg.BASE_LR,
        betas=(float(beta1), float(beta2)),
        eps=optim_cfg.EPS,
        weight_decay=optim_cfg.WEIGHT_DECAY,
    )


def _rmsprop(params: list, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """TensorFlow's RMSProp (EfficientNet's optimizer)."""
    return RMSpropTF(
        params,
        lr=optim_cfg.BASE_LR,
        alpha=optim_cfg.RMSPROP_ALPHA,
        eps=optim_cfg.EPS,
        momentum=optim_cfg.MOMENTUM,
        weight_decay=optim_cfg.WEIGHT_DECAY,
    )


def _lamb(params: list, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """LAMB: AdamW's update scaled per tensor by its trust ratio."""
    beta1, beta2 = optim_cfg.BETAS
    return Lamb(
        params,
        lr=optim_cfg.BASE_LR,
        betas=(float(beta1), float(beta2)),
        eps=optim_cfg.EPS,
        weight_decay=optim_cfg.WEIGHT_DECAY,
    )


def _lars(params: list, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """LARS: momentum SGD with a per-tensor local learning rate."""
    return Lars(
        params,
        lr=optim_cfg.BASE_LR,
        momentum=optim_cfg.MOMENTUM,
        weight_decay=optim_cfg.WEIGHT_DECAY,
        eta=optim_cfg.LARS_ETA,
    )


# OPTIM.OPTIMIZER -> constructor from (parameters or groups, OPTIM section).
OPTIMIZERS: dict[str, Callable[[list, CfgNode], torch.optim.Optimizer]] = {
    "sgd": _sgd,
    "adamw": _adamw,
    "rmsprop": _rmsprop,
    "lamb": _lamb,
    "lars": _lars,
}


def state_tensors(optim_cfg: CfgNode) -> int:
    """Tensors of optimizer state per parameter tensor (the size of memory
    that OPTIM's optimizer keeps, in parameters)."""
    if optim_cfg.OPTIMIZER == "sgd":
        return int(optim_cfg.MOMENTUM > 0)
    return {"adamw": 2, "rmsprop": 2, "lamb": 2, "lars": 1}[optim_cfg.OPTIMIZER]


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


def build_optimizer(model: nn.Module, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """The ``OPTIM.OPTIMIZER`` over the trainable parameters; logs its groups."""
    name = optim_cfg.OPTIMIZER
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown OPTIM.OPTIMIZER {name!r}")
    optimizer = OPTIMIZERS[name](build_param_groups(model, optim_cfg), optim_cfg)
    logger.info("optimizer %s, %s", name, describe_param_groups(optimizer))
    return optimizer


def _anneal(start: float, end: float, fraction: float) -> float:
    """Half a cosine from ``start`` (fraction 0) to ``end`` (fraction 1)."""
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * fraction))


def cos_lr(optim_cfg: CfgNode, epoch: float) -> float:
    """Cosine from BASE_LR (epoch 0) to MIN_LR (MAX_EPOCH and after)."""
    progress = min(epoch / optim_cfg.MAX_EPOCH, 1.0)
    return _anneal(optim_cfg.BASE_LR, optim_cfg.MIN_LR, progress)


def steps_lr(optim_cfg: CfgNode, epoch: float) -> float:
    """BASE_LR * LR_MULT ** (number of STEPS <= epoch)."""
    passed = sum(1 for step in optim_cfg.STEPS if epoch >= step)
    return optim_cfg.BASE_LR * optim_cfg.LR_MULT**passed


def exp_lr(optim_cfg: CfgNode, epoch: float) -> float:
    """BASE_LR * LR_GAMMA ** epoch, continuous in the fractional epoch."""
    return optim_cfg.BASE_LR * optim_cfg.LR_GAMMA**epoch


def linear_lr(optim_cfg: CfgNode, epoch: float) -> float:
    """Straight line from BASE_LR (epoch 0) to MIN_LR (MAX_EPOCH and after)."""
    progress = min(epoch / optim_cfg.MAX_EPOCH, 1.0)
    return optim_cfg.BASE_LR + (optim_cfg.MIN_LR - optim_cfg.BASE_LR) * progress


def onecycle_lr(optim_cfg: CfgNode, epoch: float) -> float:
    """One cycle: a cosine rise to BASE_LR, then a cosine fall to MIN_LR.

    From BASE_LR / ONECYCLE_DIV_FACTOR at epoch 0 to BASE_LR at epoch
    ONECYCLE_PCT_START * MAX_EPOCH, then to MIN_LR at MAX_EPOCH: torch's
    OneCycleLR with anneal_strategy "cos" in continuous epochs, ending at
    MIN_LR instead of a divided initial rate.
    """
    peak = optim_cfg.ONECYCLE_PCT_START * optim_cfg.MAX_EPOCH
    if epoch < peak:
        start = optim_cfg.BASE_LR / optim_cfg.ONECYCLE_DIV_FACTOR
        return _anneal(start, optim_cfg.BASE_LR, epoch / peak)
    progress = min((epoch - peak) / (optim_cfg.MAX_EPOCH - peak), 1.0)
    return _anneal(optim_cfg.BASE_LR, optim_cfg.MIN_LR, progress)


# OPTIM.LR_POLICY -> learning rate at a fractional epoch, before warmup.
LR_POLICY_FUNCTIONS: dict[str, Callable[[CfgNode, float], float]] = {
    "cos": cos_lr,
    "steps": steps_lr,
    "exp": exp_lr,
    "linear": linear_lr,
    "onecycle": onecycle_lr,
}


def lr_at(optim_cfg: CfgNode, epoch: float) -> float:
    """Learning rate at fractional ``epoch`` (e.g. 2.5 = half-way through epoch 2).

    The ``OPTIM.LR_POLICY`` function of :data:`LR_POLICY_FUNCTIONS`; during the
    first WARMUP_EPOCHS it is multiplied by a factor rising linearly from
    WARMUP_FACTOR to 1 (every policy, onecycle included).
    """
    policy = LR_POLICY_FUNCTIONS.get(optim_cfg.LR_POLICY)
    if policy is None:
        raise ValueError(f"unknown OPTIM.LR_POLICY {optim_cfg.LR_POLICY!r}")
    lr = policy(optim_cfg, epoch)
    if epoch < optim_cfg.WARMUP_EPOCHS:
        alpha = epoch / optim_cfg.WARMUP_EPOCHS
        lr *= optim_cfg.WARMUP_FACTOR * (1.0 - alpha) + alpha
    return lr


def reference_lr_scale(optim_cfg: CfgNode, global_batch: int) -> float:
    """Linear scaling rule: global_batch / REFERENCE_BATCH (1.0 when it is 0).

    Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): BASE_LR is then the
    learning rate of REFERENCE_BATCH images.
    """
    if optim_cfg.REFERENCE_BATCH <= 0:
        return 1.0
    return global_batch / optim_cfg.REFERENCE_BATCH


def lr_epoch(optim_cfg: CfgNode, epoch: int, fraction: float) -> float:
    """Where in the schedule a step ``fraction`` of the way into ``epoch``
    takes its learning rate: there (``OPTIM.LR_STEP iter``), or at the
    epoch's start (``epoch``, as timm's and torchvision's scripts step it)."""
    return epoch + fraction if optim_cfg.LR_STEP == "iter" else float(epoch)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (times its
    ``lr_scale`` under OPTIM.LAYER_DECAY)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
