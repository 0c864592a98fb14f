"""Resuming on another number of processes: the global batch kept (the
per-process batch recomputed) or the per-process batch kept (the learning
rate scaled)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_ok, kill_mid_run, read_metrics, torchrun, train_net


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_on_2_then_1_then_3_processes(tmp_path):
    out = str(tmp_path)
    # 960 images, global batch 24 (40 steps): 12 x 2, then 24 x 1, then 8 x 3
    # processes.
    args = "MODEL.ARCH resnet8 MODEL.DUMMY_INPUT True DATA.SYNTHETIC_SIZE [960,30] "
    args += "TRAIN.IM_SIZE 28 TEST.IM_SIZE 28 TRAIN.BATCH_SIZE 12 OPTIM.MAX_EPOCH 3 "
    args += "CHECKPOINT.PERIOD_ITERS 10 CHECKPOINT.KEEP 0"
    args = [*args.split(), "OUT_DIR", out]
    kill_mid_run(2, args, out, "ckpt_ep_0001_it_*.pth", "ckpt_ep_0002.pth", 0)
    kill_mid_run(1, args, out, "ckpt_ep_0002_it_*.pth", "ckpt_ep_0003.pth", 0)
    result = torchrun(3, *args)
    assert_ok(result)
    assert (
        "resuming on 3 processes instead of 1: batch 8 per process, global batch 24"
        in result.stdout
    )
    done = {r["epoch"]: r for r in read_metrics(out, "val")}
    assert sorted(done) == [1, 2, 3] and done[3]["world_size"] == 3
    for record in done.values():
        assert record["train_samples"] == 960  # each sample once per epoch
    path = os.path.join(out, "checkpoints", "ckpt_ep_0003.pth")
    state = torch.load(path, weights_only=True)
    geometry = (state["world_size"], state["global_batch"], state["batch_per_rank"])
    assert geometry == (3, 24, 8)


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_keeping_the_per_process_batch_scales_the_lr(tmp_path):
    out = str(tmp_path)
    args = [
        "MODEL.ARCH",
        "lenet5",
        "MODEL.DUMMY_INPUT",
        "True",
        "DATA.SYNTHETIC_SIZE",
        "[96, 16]",
        "TRAIN.IM_SIZE",
        "28",
        "TEST.IM_SIZE",
        "28",
        "TRAIN.BATCH_SIZE",
        "8",
        "OPTIM.MAX_EPOCH",
        "2",
        "TRAIN.RESUME_BATCH",
        "per_rank",
        "OUT_DIR",
        out,
    ]
    assert_ok(train_net(*args, "OPTIM.MAX_EPOCH", "1"))
    result = torchrun(2, *args)
    assert_ok(result)
    assert "batch 8 per process, global batch 16, LR x 2" in result.stdout
