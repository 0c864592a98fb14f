"""Nothing lost: exact resume after SIGKILL, torn checkpoints, preemption
signals, and resuming on another number of processes."""

from __future__ import annotations

import glob
import os
import random
import re
import signal
import sys
import time

import pytest
import torch
from helpers import (
    FAST,
    TRAIN_NET,
    assert_ok,
    kill_session,
    read_metrics,
    read_text,
    start,
    torchrun,
    train_net,
    worker_pid,
)

from distribuuuu.checkpoint import load_full

# Two epochs of the embedded data with a checkpoint every 10 steps.
RUN = [
    *FAST,
    "OPTIM.MAX_EPOCH",
    "2",
    "CHECKPOINT.PERIOD_ITERS",
    "10",
    "CHECKPOINT.KEEP",
    "0",
]


PIPELINE = ["DIST.STRATEGY", "pipeline"]


def _command(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, TRAIN_NET, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        TRAIN_NET,
        *args,
    ]


def _final_model(out_dir: str) -> dict:
    """The model of the run's last checkpoint (its shards read whole)."""
    name = read_text(out_dir, "checkpoints", "last").strip()
    return load_full(os.path.join(out_dir, "checkpoints", name))["model"]


def _wait_for_file(pattern: str, proc, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while not glob.glob(pattern) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert glob.glob(pattern), f"{pattern} never appeared"


def _kill_mid_run(
    nproc: int, args: list[str], out: str, pattern: str, before: str, delay: float
) -> None:
    """Start the run, SIGKILL it (all processes) at a moment up to ``delay``
    s after a checkpoint matching ``pattern`` appears (drawn from a generator
    seeded by the arguments, so a failure repeats); check that checkpoint
    ``before`` was not reached."""
    proc = start(_command(nproc, args))
    seed = f"{nproc} {pattern}"
    pause = random.Random(seed).uniform(0.0, delay)
    # Shown with a failure's output, so that the moment can be replayed.
    print(f"SIGKILL {pause:.3f} s after {pattern} (random.Random({seed!r}))")
    try:
        _wait_for_file(os.path.join(out, "checkpoints", pattern), proc)
        time.sleep(pause)
    finally:
        kill_session(proc)
    assert not os.path.exists(os.path.join(out, "checkpoints", before)), before


def _sigkill_then_rerun_matches_uninterrupted(
    tmp_path, nproc: int, tear: bool, more: tuple[str, ...] = ()
):
    """Kill a one-epoch run (every process) at a random moment after its second
    checkpoint; with ``tear``, also cut its newest checkpoint in half, as a
    crash while writing would without the atomic rename.  The rerun resumes
    (from the checkpoint before the torn one) and ends bitwise where an
    uninterrupted run ends.  ``more``: config overrides of both runs."""
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    # 62 steps, checkpoints every 10
    one_epoch = [*RUN, "OPTIM.MAX_EPOCH", "1", *more]
    launch = (lambda *a: torchrun(nproc, *a)) if nproc > 1 else train_net
    assert_ok(launch(*one_epoch, "OUT_DIR", reference))
    args = [*one_epoch, "OUT_DIR", killed]
    pattern = "ckpt_ep_0000_it_002*.pth"
    # 0.5 s at most: the rest of the epoch (about 40 steps) took under 2 s.
    _kill_mid_run(nproc, args, killed, pattern, "ckpt_ep_0001.pth", 0.5)
    if tear:
        newest = max(glob.glob(os.path.join(killed, "checkpoints", "ckpt_*.pth")))
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) // 2)
    rerun = launch(*args)
    assert_ok(rerun)
    assert "resumed from" in rerun.stdout
    if tear:
        assert f"skipping unreadable checkpoint {newest}" in rerun.stdout
        resumed = rerun.stdout.split("resumed from ", 1)[1].split()[0]
        assert os.path.basename(resumed) < os.path.basename(newest)
    expected, actual = _final_model(reference), _final_model(killed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} is not bitwise equal"
    assert (
        read_metrics(killed, "val")[-1]["top1"]
        == read_metrics(reference, "val")[-1]["top1"]
    )


@pytest.mark.slow
def test_sigkill_and_a_torn_checkpoint_then_rerun_is_bitwise_identical(tmp_path):
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, 1, tear=True)


@pytest.mark.slow
def test_sigkill_two_ranks_then_rerun_is_bitwise_identical(tmp_path):
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, tear=False)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_a_pipeline_then_rerun_is_bitwise_identical(tmp_path):
    """Each of the 2 stages saves its piece; the rerun reads them back."""
    pipeline = ("DIST.STRATEGY", "pipeline", "MODEL.EMA", "True")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, pipeline)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_tensor_parallel_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """vit_tiny_patch4 split over 2 ranks; its DCP shards read back."""
    tensor = ("MODEL.ARCH", "vit_tiny_patch4", "DIST.TENSOR_PARALLEL", "2")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, tensor)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_deepspeed_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """ZeRO-2 with an EMA: DeepSpeed's files of the same layout read back."""
    pytest.importorskip("deepspeed")
    deepspeed = ("DIST.STRATEGY", "deepspeed", "MODEL.EMA", "True")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, deepspeed)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "more", [[], ["DIST.STRATEGY", "pipeline"]], ids=["", "pipeline"]
)
def test_sigusr1_to_one_rank_stops_all_at_a_step_with_a_checkpoint(tmp_path, more):
    out = str(tmp_path)
    check = 8  # the ranks agree every 8 steps (not on the print steps, every 20)
    args = [*FAST, "OPTIM.MAX_EPOCH", "2", "DIST.STOP_CHECK_STEPS", str(check)]
    args += [*more, "OUT_DIR", out]
    proc = start(_command(2, args))
    try:
        deadline = time.time() + 120
        log = os.path.join(out, "log_rank1.txt")
        while (
            proc.poll() is None
            and time.time() < deadline
            and not (os.path.exists(log) and "train ep 1/2 it 20/" in read_text(log))
        ):
            time.sleep(0.05)
        os.kill(worker_pid(proc.pid, 1), signal.SIGUSR1)
        signalled = time.time()
        proc.communicate(timeout=60)
        assert time.time() - signalled < 20
    finally:
        kill_session(proc)
    assert proc.returncode != 0  # stopped, not finished
    last = read_text(out, "checkpoints", "last").strip()
    assert last.startswith("ckpt_ep_0000_it_"), last
    assert "stopped by SIGUSR1 after saving a checkpoint" in read_text(out, "log.txt")
    # Rank 1 got the signal between two checks; both ranks stopped at the next.
    received = re.search(
        r"SIGUSR1 received by this rank before step (\d+)", read_text(log)
    )
    stopped_at = int(last.rsplit("_", 1)[1].split(".")[0])
    assert received, read_text(log)
    assert stopped_at % check == 0
    assert int(received.group(1)) <= stopped_at < int(received.group(1)) + check
    assert "SIGUSR1 received" not in read_text(out, "log.txt")  # rank 0's log
    rerun = torchrun(2, *args)
    assert_ok(rerun)
    assert f"resumed from {out}/checkpoints/{last}" in rerun.stdout
    val = read_metrics(out, "val")
    assert [r["epoch"] for r in val] == [1, 2]
    assert val[0]["train_samples"] == read_metrics(out, "val")[1]["train_samples"]


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_on_2_then_1_then_3_processes(tmp_path):
    out = str(tmp_path)
    # 1,920 images, global batch 24: 12 x 2, then 24 x 1, then 8 x 3 processes.
    args = "MODEL.ARCH resnet8 MODEL.DUMMY_INPUT True DATA.SYNTHETIC_SIZE [1920,30] "
    args += "TRAIN.IM_SIZE 28 TEST.IM_SIZE 28 TRAIN.BATCH_SIZE 12 OPTIM.MAX_EPOCH 3 "
    args += "CHECKPOINT.PERIOD_ITERS 10 CHECKPOINT.KEEP 0"
    args = [*args.split(), "OUT_DIR", out]
    _kill_mid_run(2, args, out, "ckpt_ep_0001_it_*.pth", "ckpt_ep_0002.pth", 0)
    _kill_mid_run(1, args, out, "ckpt_ep_0002_it_*.pth", "ckpt_ep_0003.pth", 0)
    result = torchrun(3, *args)
    assert_ok(result)
    assert (
        "resuming on 3 processes instead of 1: batch 8 per process, global batch 24"
        in result.stdout
    )
    done = {r["epoch"]: r for r in read_metrics(out, "val")}
    assert sorted(done) == [1, 2, 3] and done[3]["world_size"] == 3
    for record in done.values():
        assert record["train_samples"] == 1920  # each sample once per epoch
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
