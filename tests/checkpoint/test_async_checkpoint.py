"""CHECKPOINT.ASYNC: checkpoints written in the background.

A run killed while its saves are written ends, once run again, bitwise
where a run with saves at once ends (one process, and FSDP on 2 ranks);
``last`` never names a checkpoint whose files are incomplete; a background
failure is raised; the copy is taken before training goes on.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import (
    KILLED_RUN,
    TRAIN_NET,
    assert_ok,
    final_model,
    kill_session,
    read_metrics,
    read_text,
    slow_fsync_env,
    start,
    torchrun,
    train_net,
    wait_for_file,
)

from distribuuuu import checkpoint as cp

ASYNC = ("CHECKPOINT.ASYNC", "True")


def _start_slow(tmp_path, nproc: int, args: list[str]):
    """The run of ``args`` on ``nproc`` processes, its background fsyncs slow
    (0.5 s each), so that the kill surely lands while a save is written."""
    env = slow_fsync_env(str(tmp_path / "slow"), background_only=True)
    if nproc == 1:
        return start([sys.executable, TRAIN_NET, *args], env)
    launch = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]
    return start([sys.executable, *launch, TRAIN_NET, *args], env)


def _killed_while_writing(tmp_path, nproc: int, more: tuple[str, ...], tmp: str):
    """Kill the run while its second mid-epoch checkpoint (``tmp``: its
    temporary name) is written in the background; rerun it; the final model
    equals that of a run saving at once."""
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    launch = (lambda *a: torchrun(nproc, *a)) if nproc > 1 else train_net
    assert_ok(launch(*KILLED_RUN, *more, "OUT_DIR", reference))
    args = [*KILLED_RUN, *more, *ASYNC, "OUT_DIR", killed]
    proc = _start_slow(tmp_path, nproc, args)
    try:
        wait_for_file(os.path.join(killed, "checkpoints", tmp), proc)
    finally:
        kill_session(proc)
    # The save in flight is not named: last is the checkpoint before.
    last = read_text(killed, "checkpoints", "last").strip()
    assert last == "ckpt_ep_0000_it_0010.pth", last
    rerun = launch(*args)
    assert_ok(rerun)
    assert f"resumed from {os.path.join(killed, 'checkpoints', last)}" in rerun.stdout
    assert "training blocked for" in rerun.stdout
    assert "written in the background in" in rerun.stdout
    expected, actual = final_model(reference), final_model(killed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} is not bitwise equal"
    top1 = [read_metrics(out, "val")[-1]["top1"] for out in (reference, killed)]
    assert top1[0] == top1[1]


@pytest.mark.slow
def test_one_process_killed_while_saving_in_the_background_resumes_bitwise(
    tmp_path,
):
    _killed_while_writing(tmp_path, 1, (), ".ckpt_ep_0000_it_0020.pth.tmp*")


@pytest.mark.slow
def test_fsdp_ranks_killed_while_saving_in_the_background_resume_bitwise(tmp_path):
    fsdp = ("DIST.STRATEGY", "fsdp", "MODEL.EMA", "True")
    _killed_while_writing(tmp_path, 2, fsdp, "ckpt_ep_0000_it_0020.dcp.tmp")


def test_the_copy_is_taken_before_training_goes_on(tmp_path):
    """A weight changed right after save() returns is saved as it was; the
    next save reuses the copy's memory and saves the new value."""
    weight = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    with cp.CheckpointWriter(str(tmp_path), background=True) as writer:
        writer.save((0, 1), {"model": {"w": weight}}, cp.Retention(), None, 0.0)
        weight.add_(1)
        writer.save((0, 2), {"model": {"w": weight}}, cp.Retention(), None, 0.0)
    first = cp.load_file(str(tmp_path / "checkpoints" / "ckpt_ep_0000_it_0001.pth"))
    second = cp.load_file(str(tmp_path / "checkpoints" / "ckpt_ep_0000_it_0002.pth"))
    assert torch.equal(first["model"]["w"], torch.zeros(2, 3, 4, 5))
    assert torch.equal(second["model"]["w"], torch.ones(2, 3, 4, 5))
    assert second["model"]["w"].stride() == weight.stride()
    assert read_text(str(tmp_path), "checkpoints", "last").strip().endswith("0002.pth")


def test_a_failed_background_write_is_raised_and_last_is_kept(tmp_path):
    """The background write of the second checkpoint fails (its name is a
    folder): the next wait raises it, and ``last`` still names the first."""
    state = {"model": {"w": torch.ones(2)}}
    writer = cp.CheckpointWriter(str(tmp_path), background=True)
    writer.save((0, 1), state, cp.Retention(), None, 0.0)
    writer.finish()
    os.makedirs(tmp_path / "checkpoints" / "ckpt_ep_0000_it_0002.pth")
    writer.save((0, 2), state, cp.Retention(), None, 0.0)
    with pytest.raises(cp.OutputPathError, match="ckpt_ep_0000_it_0002.pth"):
        writer.finish()
    last = read_text(str(tmp_path), "checkpoints", "last").strip()
    assert last == "ckpt_ep_0000_it_0001.pth"


def test_deepspeed_refuses_async_checkpoints(tmp_path):
    result = train_net(
        "DIST.STRATEGY", "deepspeed", *ASYNC, "OUT_DIR", str(tmp_path / "out")
    )
    assert result.returncode == 2
    assert "error: CHECKPOINT.ASYNC True is invalid" in result.stderr
    assert "DIST.STRATEGY deepspeed" in result.stderr
    assert not os.path.exists(tmp_path / "out")
