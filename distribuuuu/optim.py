"""Optimizer and learning-rate policy (set per iteration, with linear warmup)."""

from __future__ import annotations

import math

import torch
from torch import nn
from yacs.config import CfgNode


def build_optimizer(model: nn.Module, optim_cfg: CfgNode) -> torch.optim.Optimizer:
    """SGD over the trainable parameters, configured by ``cfg.OPTIM``."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(
        params,
        lr=optim_cfg.BASE_LR,
        momentum=optim_cfg.MOMENTUM,
        dampening=optim_cfg.DAMPENING,
        nesterov=optim_cfg.NESTEROV,
        weight_decay=optim_cfg.WEIGHT_DECAY,
    )


def lr_at(optim_cfg: CfgNode, epoch: float) -> float:
    """Learning rate at fractional ``epoch`` (e.g. 2.5 = half-way through epoch 2).

    ``cos``: MIN_LR + (BASE_LR - MIN_LR) * (1 + cos(pi * epoch / MAX_EPOCH)) / 2.
    ``steps``: BASE_LR * LR_MULT ** (number of STEPS <= epoch).
    During the first WARMUP_EPOCHS the rate is multiplied by a factor rising
    linearly from WARMUP_FACTOR to 1.
    """
    if optim_cfg.LR_POLICY == "cos":
        progress = min(epoch / optim_cfg.MAX_EPOCH, 1.0)
        span = optim_cfg.BASE_LR - optim_cfg.MIN_LR
        lr = optim_cfg.MIN_LR + span * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif optim_cfg.LR_POLICY == "steps":
        passed = sum(1 for step in optim_cfg.STEPS if epoch >= step)
        lr = optim_cfg.BASE_LR * optim_cfg.LR_MULT**passed
    else:
        raise ValueError(f"unknown OPTIM.LR_POLICY {optim_cfg.LR_POLICY!r}")
    if epoch < optim_cfg.WARMUP_EPOCHS:
        alpha = epoch / optim_cfg.WARMUP_EPOCHS
        lr *= optim_cfg.WARMUP_FACTOR * (1.0 - alpha) + alpha
    return lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
