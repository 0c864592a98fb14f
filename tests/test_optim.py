"""Learning-rate policies and warmup."""

from __future__ import annotations

import math

import pytest
import torch

from distribuuuu.config import load_cfg
from distribuuuu.optim import build_optimizer, lr_at


def test_cos_with_per_iteration_warmup():
    optim = load_cfg(
        None,
        [
            "OPTIM.MAX_EPOCH",
            "10",
            "OPTIM.WARMUP_EPOCHS",
            "2",
            "OPTIM.WARMUP_FACTOR",
            "0.1",
            "OPTIM.BASE_LR",
            "1.0",
        ],
    ).OPTIM
    assert lr_at(optim, 0.0) == pytest.approx(0.1)
    cos_1 = 0.5 * (1 + math.cos(math.pi * 0.1))
    assert lr_at(optim, 1.0) == pytest.approx(cos_1 * 0.55)  # half-way: 0.1 -> 1
    # warmup changes inside an epoch, not only at its start
    assert lr_at(optim, 0.25) > lr_at(optim, 0.0)
    assert lr_at(optim, 2.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_at(optim, 10.0) == pytest.approx(0.0)


def test_cos_ends_at_min_lr():
    optim = load_cfg(None, ["OPTIM.MIN_LR", "0.01", "OPTIM.WARMUP_EPOCHS", "0"]).OPTIM
    assert lr_at(optim, optim.MAX_EPOCH) == pytest.approx(0.01)
    assert lr_at(optim, 0) == pytest.approx(optim.BASE_LR)


def test_steps_policy():
    optim = load_cfg(
        None,
        [
            "OPTIM.LR_POLICY",
            "steps",
            "OPTIM.STEPS",
            "[3, 6]",
            "OPTIM.LR_MULT",
            "0.1",
            "OPTIM.WARMUP_EPOCHS",
            "0",
            "OPTIM.BASE_LR",
            "1.0",
        ],
    ).OPTIM
    assert [lr_at(optim, e) for e in (0, 2.9, 3, 5.5, 6, 9)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01]
    )


def test_sgd_uses_the_compatibility_keys():
    cfg = load_cfg(
        None,
        [
            "OPTIM.MOMENTUM",
            "0.8",
            "OPTIM.NESTEROV",
            "False",
            "OPTIM.DAMPENING",
            "0.1",
            "OPTIM.WEIGHT_DECAY",
            "0.01",
        ],
    )
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg.OPTIM)
    group = opt.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["dampening"]) == (
        0.8,
        False,
        0.1,
    )
    assert group["weight_decay"] == 0.01
