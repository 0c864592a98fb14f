"""Nothing hidden changes the maths: our training epoch and a plain PyTorch
loop, fed the same initial weights, batches and per-step learning rates, end
50 steps with the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from distribuuuu.config import load_cfg
from distribuuuu.dist import group as du
from distribuuuu.engine.loop import train_epoch
from distribuuuu.engine.specs import loop_spec
from distribuuuu.engine.trainer import build_train_state
from distribuuuu.reporting.writer import MetricsWriter

STEPS = 50
# 1,600 synthetic images in batches of 32: 50 steps, no augmentation.
DATA = ["MODEL.ARCH", "resnet8", "MODEL.DUMMY_INPUT", "True"]
DATA += ["DATA.SYNTHETIC_SIZE", "[1600,10]", "TRAIN.BATCH_SIZE", "32"]
DATA += ["TRAIN.IM_SIZE", "28", "TEST.IM_SIZE", "28", "RNG_SEED", "5"]


def _plain_optimizer(name: str, params, cfg) -> torch.optim.Optimizer:
    """The optimizer written out by hand from the config's values."""
    optim = cfg.OPTIM
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.0, momentum=optim.MOMENTUM,
                               nesterov=optim.NESTEROV,
                               weight_decay=optim.WEIGHT_DECAY)  # fmt: skip
    betas = tuple(optim.BETAS)
    return torch.optim.AdamW(params, lr=0.0, betas=betas, eps=optim.EPS,
                             weight_decay=optim.WEIGHT_DECAY)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_train_epoch_equals_a_plain_loop(tmp_path, name):
    base_lr = "0.05" if name == "sgd" else "0.002"
    cfg = load_cfg(None, [*DATA, "OPTIM.OPTIMIZER", name, "OPTIM.BASE_LR", base_lr,
                          "OUT_DIR", str(tmp_path)])  # fmt: skip
    info, device = du.detect_launch(), torch.device("cpu")
    writer = MetricsWriter(cfg.OUT_DIR, enabled=False)
    state, loader, _ = build_train_state(cfg, info, device, writer)
    plain = copy.deepcopy(state.model)  # the same initial weights
    seen = []  # (images, targets, lr) of every step, as our step received them
    step = state.strategy.train_step

    def recording(state, micro_batches, meter, loss_fn):
        micro = list(micro_batches)
        lr = state.optimizer.param_groups[0]["lr"]
        seen.extend((images, targets, lr) for images, targets, _ in micro)
        return step(state, micro, meter, loss_fn)

    state.strategy.train_step = recording
    train_epoch(state, loader, loop_spec(cfg), after_step=lambda: len(seen) == STEPS)
    assert len(seen) == STEPS
    assert len({lr for _, _, lr in seen}) > 1  # warmup: the rate moved
    optimizer = _plain_optimizer(name, plain.parameters(), cfg)
    plain.train()
    for images, targets, lr in seen:  # the plain loop
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(plain(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ours = state.model.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-6, msg=key)
