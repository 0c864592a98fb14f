"""DIST.STRATEGY deepspeed: ZeRO 1-3 and offload train like DDP (AdamW,
accumulation, clipping and the EMA too), and bf16 trains BatchNorm with the EMA
kept in fp32 (the rest: test_deepspeed.py)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import (
    TINY,
    TINY_VAL_SIZE,
    assert_ok,
    needs_deepspeed,
    read_metrics,
    torchrun,
    train_net,
)

# One epoch of LeNet-5 on 768 synthetic images (6 steps of 2 processes x 64),
# validated on 101.
LENET = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1", "RNG_SEED", "3"]
LENET += ["TRAIN.PRINT_FREQ", "100", "DATA.NAME", "synthetic"]
LENET += ["DATA.SYNTHETIC_SIZE", f"[768,{TINY_VAL_SIZE}]"]
DEEPSPEED = ["DIST.STRATEGY", "deepspeed"]


def _final(out: str) -> tuple[dict, dict]:
    """The weights of the epoch-1 checkpoint and the last val record."""
    path = os.path.join(out, "checkpoints", "ckpt_ep_0001.pth")
    return torch.load(path, weights_only=True)["model"], read_metrics(out, "val")[-1]


def _ema(out: str) -> dict:
    path = os.path.join(out, "checkpoints", "ckpt_ep_0001.pth")
    return torch.load(path, weights_only=True)["ema"]


def _assert_best_ema_is_the_average(out: str) -> None:
    """best_ema.pth of a one-epoch run (its evaluation is the best so far)
    holds the EMA of the epoch-1 checkpoint, not the raw weights of best.pth."""
    ema = _ema(out)
    best_ema, best = (
        torch.load(os.path.join(out, name), weights_only=True)["model"]
        for name in ("best_ema.pth", "best.pth")
    )
    for name, average in ema.items():
        torch.testing.assert_close(best_ema[name], average, rtol=0, atol=0)
    gap = max((best[name] - ema[name]).abs().max().item() for name in ema)
    assert gap > 1e-5


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The OUT_DIR of a DDP run on 2 ranks with ``more`` keys (run once each)."""
    runs: dict[tuple, str] = {}

    def run(more: tuple[str, ...]) -> str:
        if more not in runs:
            out = str(tmp_path_factory.mktemp("ddp"))
            assert_ok(torchrun(2, *LENET, *more, "OUT_DIR", out))
            runs[more] = out
        return runs[more]

    return run


# AdamW (2 parameter groups), accumulation, clipping and an EMA at once.
RECIPE = ("OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.003", "TRAIN.ACCUM_STEPS")
RECIPE += ("2", "OPTIM.CLIP_GRAD_NORM", "0.5", "MODEL.EMA", "True")


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, offload, more",
    [
        (1, [], ()),
        (2, [], ()),
        (3, [], ()),
        (2, ["OFFLOAD_OPTIMIZER"], ()),
        (3, ["OFFLOAD_OPTIMIZER", "OFFLOAD_PARAMS"], ()),
        (2, [], RECIPE),
    ],
    ids=[
        "zero1",
        "zero2",
        "zero3",
        "zero2-offload-optimizer",
        "zero3-offload",
        "zero2-adamw-accum-clip-ema",
    ],
)
def test_zero_stages_train_like_ddp(tmp_path, ddp_run, stage, offload, more):
    """One epoch on 2 ranks ends with DDP's weights (1e-5) and val loss (1e-4)."""
    out = str(tmp_path)
    keys = [*DEEPSPEED, "DIST.DEEPSPEED.ZERO_STAGE", str(stage), *more]
    for key in offload:
        keys += [f"DIST.DEEPSPEED.{key}", "cpu"]
    result = torchrun(2, *LENET, *keys, "OUT_DIR", out)
    assert_ok(result)
    reference = ddp_run(more)
    expected, expected_val = _final(reference)
    weights, val = _final(out)
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-5)
    if "MODEL.EMA" in more:
        ema, expected_ema = _ema(out), _ema(reference)
        for key, value in expected_ema.items():
            torch.testing.assert_close(ema[key], value, rtol=0, atol=1e-5)
        _assert_best_ema_is_the_average(out)
    assert val["loss"] == pytest.approx(expected_val["loss"], rel=1e-4)
    assert val["samples"] == TINY_VAL_SIZE
    with open(os.path.join(out, "ds_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert config["train_micro_batch_size_per_gpu"] == 64
    assert config["gradient_accumulation_steps"] == (2 if more else 1)
    sections = {
        "OFFLOAD_OPTIMIZER": "offload_optimizer",
        "OFFLOAD_PARAMS": "offload_param",
    }
    for key, section in sections.items():
        assert zero[section]["device"] == ("cpu" if key in offload else "none")
    assert f"strategy deepspeed ZeRO-{stage}" in result.stdout
    assert "MiB of gradients" in result.stdout
    assert "MiB of optimizer state on the fullest process" in result.stdout


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_trains_batchnorm_and_keeps_the_ema_in_fp32(tmp_path):
    """resnet8 (BatchNorm) in bf16 on 2 ranks trains: autocast over fp32
    weights, where DeepSpeed's bf16 mode failed in BatchNorm ("expected scalar
    type BFloat16 but found Float"); the EMA is averaged in fp32 (in bf16 a
    small step rounds away) and best_ema.pth holds it."""
    out = str(tmp_path)
    keys = [*TINY, "MODEL.ARCH", "resnet8", *DEEPSPEED, "MODEL.EMA", "True"]
    keys += ["TRAIN.MIXED_PRECISION", "bf16"]
    assert_ok(torchrun(2, *keys, "OUT_DIR", out))
    val = read_metrics(out, "val")[-1]
    assert val["samples"] == TINY_VAL_SIZE and math.isfinite(val["loss"])
    weights, ema = _final(out)[0], _ema(out)
    assert {tensor.dtype for tensor in ema.values()} == {torch.float32}
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {
        torch.float32
    }
    _assert_best_ema_is_the_average(out)
    with open(os.path.join(out, "ds_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]


@needs_deepspeed
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_default_precision_trains_batchnorm_on_a_gpu(tmp_path):
    """TRAIN.MIXED_PRECISION auto (bf16 from Ampere on) on one GPU: the engine
    keeps the GPU chosen and resnet8 with an EMA trains."""
    out = str(tmp_path)
    keys = [*TINY, "MODEL.ARCH", "resnet8", *DEEPSPEED, "MODEL.EMA", "True"]
    result = train_net(*keys, "DEVICE", "cuda", "OUT_DIR", out, timeout=1200)
    assert_ok(result)
    assert read_metrics(out, "val")[-1]["samples"] == TINY_VAL_SIZE
    assert {tensor.dtype for tensor in _ema(out).values()} == {torch.float32}
    _assert_best_ema_is_the_average(out)
