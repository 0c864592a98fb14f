"""Optimizers, parameter groups, learning-rate policies and warmup."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import TINY, assert_ok, read_metrics, train_net
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import LR_POLICIES, get_cfg, load_cfg
from distribuuuu.engine.specs import optimizer_spec, schedule_spec
from distribuuuu.errors import ConfigError
from distribuuuu.models.syncbn import GroupSyncBatchNorm
from distribuuuu.optim.build import (
    LR_POLICY_FUNCTIONS,
    build_optimizer,
    lr_at,
    lr_epoch,
    reference_lr_scale,
    set_lr,
    split_weight_decay,
)
from distribuuuu.optim.spec import OptimizerSpec, ScheduleSpec


def test_cos_with_per_iteration_warmup():
    cfg = load_cfg(
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
    )
    optim = schedule_spec(cfg)
    assert lr_at(optim, 0.0) == pytest.approx(0.1)
    cos_1 = 0.5 * (1 + math.cos(math.pi * 0.1))
    assert lr_at(optim, 1.0) == pytest.approx(cos_1 * 0.55)  # half-way: 0.1 -> 1
    # warmup changes inside an epoch, not only at its start
    assert lr_at(optim, 0.25) > lr_at(optim, 0.0)
    assert lr_at(optim, 2.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_at(optim, 10.0) == pytest.approx(0.0)


def test_cos_ends_at_min_lr():
    cfg = load_cfg(None, ["OPTIM.MIN_LR", "0.01", "OPTIM.WARMUP_EPOCHS", "0"])
    optim, schedule = cfg.OPTIM, schedule_spec(cfg)
    assert lr_at(schedule, optim.MAX_EPOCH) == pytest.approx(0.01)
    assert lr_at(schedule, 0) == pytest.approx(optim.BASE_LR)


def test_steps_policy():
    cfg = load_cfg(
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
    )
    optim = schedule_spec(cfg)
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
    opt = build_optimizer(torch.nn.Linear(2, 2), optimizer_spec(cfg))
    group = opt.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["dampening"]) == (
        0.8,
        False,
        0.1,
    )
    assert group["weight_decay"] == 0.01


# ---------------------------------------------------------------------------- #
# Optimizers, parameter groups, every LR policy, linear scaling rule
# ---------------------------------------------------------------------------- #
def _optim(*opts: str) -> CfgNode:
    """The validated OPTIM section of the defaults with ``KEY VALUE`` overrides."""
    return load_cfg(None, list(opts)).OPTIM


def _optimizer(*opts: str) -> OptimizerSpec:
    """The optimizer spec of the defaults with ``KEY VALUE`` overrides."""
    return optimizer_spec(load_cfg(None, list(opts)))


def _schedule(*opts: str) -> ScheduleSpec:
    """The learning-rate schedule of the defaults with ``KEY VALUE`` overrides."""
    return schedule_spec(load_cfg(None, list(opts)))


# Policy, overrides, {epoch: learning rate by hand}; BASE_LR 1, MIN_LR 0.1,
# MAX_EPOCH 10, no warmup.  cos(0.2 pi) = 0.809017.
POLICY_POINTS = [
    ("cos", [], {0: 1.0, 2: 0.1 + 0.45 * 1.809017, 5: 0.55, 10: 0.1, 12: 0.1}),
    ("linear", [], {0: 1.0, 2: 0.82, 5: 0.55, 10: 0.1, 12: 0.1}),
    (
        "exp",
        ["OPTIM.LR_GAMMA", "0.5"],
        {0: 1.0, 0.5: 0.7071068, 2: 0.25, 5: 0.03125, 10: 0.0009765625},
    ),
    (
        "steps",
        ["OPTIM.STEPS", "[2, 5]", "OPTIM.LR_MULT", "0.5"],
        {0: 1.0, 1.99: 1.0, 2: 0.5, 5: 0.25, 10: 0.25},
    ),
    # Rise 0.1 -> 1 over epochs 0-2 (PCT_START 0.2), fall 1 -> 0.1 over 2-10.
    (
        "onecycle",
        ["OPTIM.ONECYCLE_PCT_START", "0.2", "OPTIM.ONECYCLE_DIV_FACTOR", "10"],
        {0: 0.1, 1: 0.55, 2: 1.0, 6: 0.55, 10: 0.1, 12: 0.1},
    ),
]
_PLAIN = ["OPTIM.BASE_LR", "1.0", "OPTIM.MIN_LR", "0.1", "OPTIM.MAX_EPOCH", "10"]


@pytest.mark.parametrize("policy, opts, points", POLICY_POINTS)
def test_policy_values_by_hand(policy, opts, points):
    optim = _schedule(
        "OPTIM.LR_POLICY", policy, "OPTIM.WARMUP_EPOCHS", "0", *_PLAIN, *opts
    )
    got = {epoch: lr_at(optim, epoch) for epoch in points}
    assert got == pytest.approx(points, rel=1e-6)


def test_every_policy_is_tested_and_dispatched():
    assert set(LR_POLICY_FUNCTIONS) == set(LR_POLICIES)
    assert {policy for policy, _, _ in POLICY_POINTS} == set(LR_POLICIES)


@pytest.mark.parametrize("policy, opts, points", POLICY_POINTS)
def test_warmup_multiplies_every_policy(policy, opts, points):
    common = ["OPTIM.LR_POLICY", policy, *_PLAIN, *opts]
    plain = _schedule(*common, "OPTIM.WARMUP_EPOCHS", "0")
    warm = _schedule(*common, "OPTIM.WARMUP_EPOCHS", "2", "OPTIM.WARMUP_FACTOR", "0.1")
    # factor 0.1 at epoch 0, half-way (0.55) at 1, 1 from epoch 2 on
    for epoch, factor in ((0, 0.1), (0.5, 0.325), (1, 0.55), (2, 1.0), (7, 1.0)):
        assert lr_at(warm, epoch) == pytest.approx(lr_at(plain, epoch) * factor)


def test_unknown_policy_and_optimizer_raise_value_error():
    cfg = get_cfg()
    cfg.OPTIM.LR_POLICY = "triangular"
    with pytest.raises(ValueError, match="unknown OPTIM.LR_POLICY 'triangular'"):
        lr_at(schedule_spec(cfg), 1.0)
    cfg.OPTIM.OPTIMIZER = "lion"
    with pytest.raises(ValueError, match="unknown OPTIM.OPTIMIZER 'lion'"):
        build_optimizer(torch.nn.Linear(2, 2), optimizer_spec(cfg))


def test_default_cos_is_bitwise_the_original_formula():
    cfg = load_cfg(None, ["OPTIM.MIN_LR", "0.003"])
    optim, schedule = cfg.OPTIM, schedule_spec(cfg)
    for epoch in (0.0, 0.37, 1.0, 4.2, 9.99):
        progress = epoch / optim.MAX_EPOCH
        lr = optim.MIN_LR + (optim.BASE_LR - optim.MIN_LR) * 0.5 * (
            1.0 + math.cos(math.pi * progress)
        )
        if epoch < optim.WARMUP_EPOCHS:
            alpha = epoch / optim.WARMUP_EPOCHS
            lr *= optim.WARMUP_FACTOR * (1.0 - alpha) + alpha
        assert lr_at(schedule, epoch) == lr


class _Net(nn.Module):
    """conv (bias) + norm + conv (no bias) + GroupNorm + attention + linear."""

    def __init__(self, norm: type[nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.features = norm(4)  # a norm layer not named like one
        self.conv2 = nn.Conv2d(4, 4, 3, bias=False)
        self.group = nn.GroupNorm(2, 4)
        self.attention = nn.MultiheadAttention(4, 1)  # in_proj_bias, out_proj
        self.head = nn.Linear(4, 2)
        self.norm_scale = nn.Parameter(torch.ones(2))  # named like a norm: decayed
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.group(self.conv2(self.features(self.conv(x))))
        tokens = x.flatten(2).transpose(1, 2)  # N x positions x 4
        tokens = self.attention(tokens, tokens, tokens)[0]
        return self.head(tokens.mean(1)) * self.norm_scale


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 6, 6, generator=generator), torch.arange(8) % 2


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """Three steps of cross-entropy on one fixed batch; the losses."""
    images, labels = _batch()
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _net(norm: type[nn.Module] = nn.BatchNorm2d) -> _Net:
    torch.manual_seed(0)
    return _Net(norm)


def test_sgd_default_is_unchanged():
    optim = _optimizer()
    model, reference = _net(), _net()
    optimizer = build_optimizer(model, optim)
    assert type(optimizer) is torch.optim.SGD
    assert len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert [id(p) for p in group["params"]] == [id(p) for p in trainable]
    expected = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True}
    assert {key: group[key] for key in expected} == expected
    assert group["weight_decay"] == 5e-4
    # the very optimizer of before: same steps, bitwise
    before = torch.optim.SGD(
        [p for p in reference.parameters() if p.requires_grad],
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=True,
        weight_decay=5e-4,
    )
    assert _train(model, optimizer) == _train(reference, before)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def test_adamw_trains_and_is_adamw():
    optim = _optimizer(
        "OPTIM.OPTIMIZER",
        "adamw",
        "OPTIM.BASE_LR",
        "0.01",
        "OPTIM.BETAS",
        "[0.8, 0.99]",
        "OPTIM.EPS",
        "1e-6",
        "OPTIM.WEIGHT_DECAY",
        "0.05",
    )
    model, reference = _net(), _net()
    optimizer = build_optimizer(model, optim)
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == (
        (0.8, 0.99),
        1e-6,
        0.05,
    )
    assert "momentum" not in group
    losses = _train(model, optimizer)
    assert losses[-1] < losses[0]
    direct = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad],
        lr=0.01,
        betas=(0.8, 0.99),
        eps=1e-6,
        weight_decay=0.05,
    )
    assert losses == _train(reference, direct)


def test_adamw_does_not_need_sgd_momentum_for_nesterov():
    assert _optim("OPTIM.OPTIMIZER", "adamw", "OPTIM.MOMENTUM", "0").OPTIMIZER == (
        "adamw"
    )
    with pytest.raises(ConfigError, match="OPTIM.NESTEROV"):
        _optim("OPTIM.MOMENTUM", "0")


class _Records(logging.Handler):
    """Collects the messages of one logger, whatever its propagation."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, GroupSyncBatchNorm])
def test_no_decay_norm_bias_groups(norm):
    model = _net(norm)
    records, log = _Records(), logging.getLogger("distribuuuu.optim.build")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(records)
    try:
        optimizer = build_optimizer(
            model, _optimizer("OPTIM.NO_DECAY_NORM_BIAS", "True")
        )
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    decay, no_decay = optimizer.param_groups
    expected_no_decay = [
        model.conv.bias,
        model.features.weight,
        model.features.bias,
        model.group.weight,
        model.group.bias,
        model.attention.in_proj_bias,
        model.attention.out_proj.bias,
        model.head.bias,
    ]
    expected_decay = [
        model.conv.weight,
        model.conv2.weight,
        model.attention.in_proj_weight,
        model.attention.out_proj.weight,
        model.head.weight,
        model.norm_scale,
    ]
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in expected_no_decay}
    assert {id(p) for p in decay["params"]} == {id(p) for p in expected_decay}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (5e-4, 0.0)
    assert len(records.messages) == 1
    decayed = sum(p.numel() for p in expected_decay)
    assert f"on 6 tensors ({decayed:,} parameters)" in records.messages[0]
    assert "weight decay 0 on 8 tensors" in records.messages[0]
    # set_lr reaches both groups
    set_lr(optimizer, 0.25)
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.25]


def test_no_decay_norm_bias_keeps_the_decay_of_a_model_without_norm_or_bias():
    model = nn.Linear(3, 2, bias=False)
    optimizer = build_optimizer(model, _optimizer("OPTIM.NO_DECAY_NORM_BIAS", "True"))
    assert [len(group["params"]) for group in optimizer.param_groups] == [1]
    assert split_weight_decay(model) == ([model.weight], [])


def test_reference_lr_scale():
    assert reference_lr_scale(_schedule(), 4096) == 1.0
    optim = _schedule("OPTIM.REFERENCE_BATCH", "256")
    assert reference_lr_scale(optim, 1024) == 4.0
    assert reference_lr_scale(optim, 64) == 0.25


@pytest.mark.parametrize(
    "opts, message",
    [
        (
            ["OPTIM.OPTIMIZER", "adam"],
            "OPTIM.OPTIMIZER 'adam' is invalid: choose one of sgd, adamw, rmsprop, "
            "lamb, lars; did you mean adamw?",
        ),
        (["OPTIM.LR_POLICY", "onecycel"], "did you mean onecycle?"),
        (["OPTIM.BETAS", "[0.9]"], "must be [beta1, beta2], both in [0, 1)"),
        (["OPTIM.BETAS", "[0.9, 1.0]"], "must be [beta1, beta2], both in [0, 1)"),
        (["OPTIM.BETAS", "['a', 'b']"], "expected a list of int or float"),
        (["OPTIM.EPS", "0"], "OPTIM.EPS 0.0 is invalid: must be > 0"),
        (["OPTIM.LR_GAMMA", "1.5"], "OPTIM.LR_GAMMA 1.5 is invalid: must be in"),
        (["OPTIM.ONECYCLE_PCT_START", "1"], "must be in (0, 1)"),
        (["OPTIM.ONECYCLE_DIV_FACTOR", "0.5"], "must be >= 1"),
        (["OPTIM.REFERENCE_BATCH", "-1"], "must be >= 0 (0 = off)"),
        (["OPTIM.REFERENCE_BATCH", "0.5"], "expected an integer"),
        (["OPTIM.NO_DECAY_NORM_BIAS", "maybe"], "expected True or False"),
        (["OPTIM.LR_STEP", "batch"], "OPTIM.LR_STEP 'batch' is invalid: choose one"),
        (["OPTIM.RMSPROP_ALPHA", "1"], "must be in [0, 1)"),
        (["OPTIM.LARS_ETA", "0"], "OPTIM.LARS_ETA 0.0 is invalid: must be > 0"),
    ],
)
def test_bad_optim_values_are_refused(opts, message):
    with pytest.raises(ConfigError) as error:
        load_cfg(None, opts)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_lr_step_iter_moves_every_step_and_epoch_once_per_epoch():
    iter_cfg = schedule_spec(load_cfg(None, []))
    epoch_cfg = schedule_spec(load_cfg(None, ["OPTIM.LR_STEP", "epoch"]))
    assert lr_epoch(iter_cfg, 2, 0.5) == 2.5
    assert lr_epoch(epoch_cfg, 2, 0.5) == lr_epoch(epoch_cfg, 2, 0.99) == 2.0
    # warmup too: at epoch 0 the whole first epoch takes the warmup's start
    assert lr_at(epoch_cfg, lr_epoch(epoch_cfg, 0, 0.9)) == pytest.approx(0.01)
    assert lr_at(iter_cfg, lr_epoch(iter_cfg, 0, 0.9)) > 0.08


@pytest.mark.slow
@pytest.mark.parametrize("step", ["iter", "epoch"])
def test_lr_step_in_the_train_records(tmp_path, step):
    result = train_net(*TINY, "OPTIM.MAX_EPOCH", "2", "OPTIM.LR_STEP", step,
                       "OUT_DIR", str(tmp_path))  # fmt: skip
    assert_ok(result)
    rates: dict[int, set] = {}
    for record in read_metrics(str(tmp_path), "train"):
        rates.setdefault(record["epoch"], set()).add(record["lr"])
    assert sorted(rates) == [1, 2]
    if step == "epoch":
        assert [len(r) for r in rates.values()] == [1, 1]
        assert rates[1] != rates[2]
    else:
        assert all(len(r) > 1 for r in rates.values())
