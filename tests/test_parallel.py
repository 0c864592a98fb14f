"""Strategies and memory: ZeRO-1 equals DDP, resumes anywhere, and uses less
memory; activation checkpointing changes nothing but memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_ok, read_metrics, torchrun, train_net
from distributed_utils import run_on_ranks

from distribuuuu.models import build_model
from distribuuuu.parallel import (
    enable_activation_checkpointing,
    optimizer_state_dict,
    shard_optimizer,
    wrap_model,
)

STEPS, BATCH = 4, 6  # optimizer steps; samples per rank per step


def _batches(world: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        images = torch.randn(world * BATCH, 3, 28, 28, generator=generator)
        yield images, torch.randint(0, 10, (world * BATCH,), generator=generator)


def _train_lenet(rank: int, world: int, strategy: str) -> dict:
    torch.manual_seed(0)
    model = wrap_model(build_model("lenet5", 10), torch.device("cpu"), False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy == "zero1":
        optimizer = shard_optimizer(optimizer)
    for images, targets in _batches(world):
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        F.cross_entropy(model(images[part]), targets[part]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer_state_dict(optimizer)  # a collective for ZeRO
    if strategy == "zero1":
        assert 0 < len(optimizer.optim.state) < len(list(model.parameters()))
    return {"model": model.module.state_dict(), "optimizer": state}


def test_zero1_reaches_the_parameters_of_ddp(tmp_path):
    ddp = run_on_ranks(2, _train_lenet, ("ddp",), tmp_path / "ddp")
    zero = run_on_ranks(2, _train_lenet, ("zero1",), tmp_path / "zero")
    for key, value in ddp[0]["model"].items():
        torch.testing.assert_close(zero[0]["model"][key], value)
        torch.testing.assert_close(zero[1]["model"][key], value)
    momentum = zero[0]["optimizer"]["state"]  # consolidated on rank 0
    for index, state in ddp[0]["optimizer"]["state"].items():
        torch.testing.assert_close(
            momentum[index]["momentum_buffer"], state["momentum_buffer"]
        )


# A small ResNet on a few synthetic images.
SMALL = [
    "MODEL.ARCH", "resnet8", "DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE",
    "[96, 32]", "TRAIN.BATCH_SIZE", "12", "TRAIN.PRINT_FREQ", "2",
]  # fmt: skip


def test_zero1_checkpoints_resume_on_2_and_on_1_process(tmp_path):
    out = str(tmp_path)
    first = torchrun(2, *SMALL, "DIST.STRATEGY", "zero1", "MODEL.ACT_CKPT", "True",
                     "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out)  # fmt: skip
    assert_ok(first)
    assert "ZeRO-1: optimizer state sharded over 2 ranks" in first.stdout
    assert "activation checkpointing: 3 blocks recompute" in first.stdout
    state = torch.load(f"{out}/checkpoints/ckpt_ep_0001.pth", weights_only=True)
    parameters = list(build_model("resnet8", 10).parameters())
    assert len(state["optimizer"]["state"]) == len(parameters)  # consolidated
    # Two more epochs: one on 2 ranks, one on a single process without ZeRO.
    second = torchrun(2, *SMALL, "DIST.STRATEGY", "zero1",
                      "OPTIM.MAX_EPOCH", "2", "OUT_DIR", out)  # fmt: skip
    assert_ok(second)
    assert "resumed from" in second.stdout
    third = train_net(*SMALL, "OPTIM.MAX_EPOCH", "3", "OUT_DIR", out)
    assert_ok(third)
    assert "resumed from" in third.stdout
    val = read_metrics(out, "val")
    assert [r["epoch"] for r in val] == [1, 2, 3]
    assert [r["world_size"] for r in val] == [2, 2, 1]
    assert all(r["train_samples"] == 96 for r in val)


def test_zero1_reports_less_peak_memory_than_ddp(tmp_path):
    """AlexNet (61 M parameters): its SGD momentum is 244 MB on every DDP rank
    and half of that with ZeRO-1 on 2 ranks."""
    peaks = {}
    for strategy in ("ddp", "zero1"):
        out = str(tmp_path / strategy)
        result = torchrun(
            2, "MODEL.ARCH", "alexnet", "DATA.NAME", "synthetic",
            "DATA.SYNTHETIC_SIZE", "[8, 4]", "TRAIN.BATCH_SIZE", "2",
            "TRAIN.IM_SIZE", "64", "TEST.IM_SIZE", "64", "OPTIM.MAX_EPOCH", "1",
            "DIST.STRATEGY", strategy, "OUT_DIR", out,
        )  # fmt: skip
        assert_ok(result)
        (val,) = read_metrics(out, "val")
        peaks[strategy] = val["peak_mem_mb"]
    print("peak memory per rank (MiB):", peaks)
    assert max(peaks["zero1"]) < min(peaks["ddp"])


@pytest.mark.parametrize("arch", ["resnet8", "resnet18"])
def test_activation_checkpointing_changes_nothing_but_memory(arch):
    torch.manual_seed(0)
    plain = build_model(arch, 10)
    recomputed = copy.deepcopy(plain)
    assert enable_activation_checkpointing(recomputed) > 0
    images, targets = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    losses = []
    for model in (plain, recomputed):
        loss = F.cross_entropy(model(images), targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    # Same names, and BatchNorm statistics updated once, not twice.
    expected = plain.state_dict()
    for key, value in recomputed.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=key)
