"""Nothing lost: exact resume after SIGKILL and torn checkpoints, and a
preemption signal to one rank stopping all at a step with a checkpoint
(the strategies killed mid-run: test_resume_strategies.py; resuming on
another number of processes: test_resume_world_size.py)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from helpers import (
    assert_ok,
    kill_session,
    launch_command,
    read_metrics,
    read_text,
    sigkill_then_rerun_matches_uninterrupted,
    start,
    torchrun,
    worker_pid,
)

# 2 ranks of 64: 4,096 images make 32 steps (12 after the second checkpoint).
TWO_RANKS = ("DATA.SYNTHETIC_SIZE", "[4096,200]")


@pytest.mark.slow
def test_sigkill_and_a_torn_checkpoint_then_rerun_is_bitwise_identical(tmp_path):
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 1, tear=True)


@pytest.mark.slow
def test_sigkill_two_ranks_then_rerun_is_bitwise_identical(tmp_path):
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, TWO_RANKS)


@pytest.mark.slow
def test_sigkill_then_rerun_of_a_class_balanced_run_is_bitwise_identical(tmp_path):
    """DATA.SAMPLER balanced (draws with replacement) resumes mid-epoch at the
    next draw of the same epoch's draws, on 1 rank."""
    balanced = ("DATA.SAMPLER", "balanced")
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 1, tear=False, more=balanced)


# Two epochs of resnet8 on synthetic images, 24 steps of 64 each on 2 ranks
# of one replica (DDP: 3,072 images; 2 pipeline stages: 1,536).
STOPPED = ["MODEL.ARCH", "resnet8", "DATA.NAME", "synthetic"]
STOPPED += ["OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "10"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "more",
    [
        ["DATA.SYNTHETIC_SIZE", "[3072,200]"],
        ["DATA.SYNTHETIC_SIZE", "[1536,200]", "DIST.STRATEGY", "pipeline"],
    ],
    ids=["", "pipeline"],
)
def test_sigusr1_to_one_rank_stops_all_at_a_step_with_a_checkpoint(tmp_path, more):
    out = str(tmp_path)
    # The ranks agree every 8 steps (not on the print steps, every 10): rank 1
    # is signalled after step 10, the ranks stop at step 16, 8 before the end
    # of the epoch.
    check = 8
    args = [*STOPPED, "DIST.STOP_CHECK_STEPS", str(check)]
    args += [*more, "OUT_DIR", out]
    proc = start(launch_command(2, args))
    try:
        deadline = time.time() + 120
        log = os.path.join(out, "log_rank1.txt")
        while (
            proc.poll() is None
            and time.time() < deadline
            and not (os.path.exists(log) and "train ep 1/2 it 10/" in read_text(log))
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
