"""Nothing lost when a job is stopped: the preemption save under real srun, and
a worker killed under torchrun's elastic restarts."""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
import time

import pytest
import torch
from helpers import (
    TRAIN_NET,
    assert_ok,
    kill_session,
    process_table,
    python_command,
    read_text,
    run_command,
    slurm_ready,
    start,
    torchrun,
    torchrun_argv,
    worker_pid,
)

# AlexNet (57 M parameters): its checkpoint with the SGD momentum is 456 MB and
# takes about 1.4 s to write and fsync on the CI machine.  The ranks look for
# a stop every 4 steps (20 by default, 30 s of AlexNet's steps here).
SLOW_SAVE = [
    "MODEL.ARCH",
    "alexnet",
    "DATA.NAME",
    "synthetic",
    "DATA.SYNTHETIC_SIZE",
    "[512,16]",
    "TRAIN.IM_SIZE",
    "64",
    "TEST.IM_SIZE",
    "64",
    "TRAIN.BATCH_SIZE",
    "8",
    "OPTIM.MAX_EPOCH",
    "1",
    "TRAIN.PRINT_FREQ",
    "1",
    "DIST.STOP_CHECK_STEPS",
    "4",
]


def _wait_for_text(path: str, text: str, proc, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while proc.poll() is None and time.time() < deadline:
        if os.path.exists(path) and text in read_text(path):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def _slurm_tasks(out: str) -> dict[int, int]:
    """{rank: pid} of the srun tasks training into ``out``."""
    tasks = {}
    for pid, _, _, _ in process_table():
        try:
            cmdline = read_text("/proc", str(pid), "cmdline").split("\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if TRAIN_NET in cmdline and out in cmdline:
            for item in environ:
                if item.startswith(b"SLURM_PROCID="):
                    tasks[int(item.split(b"=")[1])] = pid
    return tasks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slurm
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(bool(slurm_ready()), reason=slurm_ready() or "ok")
def test_sigusr1_under_srun_kill_on_bad_exit_keeps_the_checkpoint(tmp_path):
    """SIGUSR1 to a 2-task step: no task exits before rank 0's checkpoint is
    complete (srun --kill-on-bad-exit would end the step mid-write), both exit
    128+10, and the checkpoint loads, named by ``last``, with no partial file."""
    out = str(tmp_path / "run")
    checkpoints = os.path.join(out, "checkpoints")
    job_name = f"preempt-{os.getpid()}-{tmp_path.name}"
    cmd = ["srun", "--kill-on-bad-exit=1", "-O", "-n", "2", "-J", job_name,
           "--time=10", sys.executable, TRAIN_NET, *SLOW_SAVE,
           "OUT_DIR", out]  # fmt: skip
    proc = start(cmd)
    job = ""
    try:
        _wait_for_text(os.path.join(out, "log.txt"), "train ep 1/1 it 2/", proc)
        tasks = _slurm_tasks(out)
        assert sorted(tasks) == [0, 1], tasks
        squeue = run_command(["squeue", "-h", "-n", job_name, "-o", "%i"], timeout=30)
        job = squeue.stdout.strip()
        assert job.isdigit(), squeue
        assert run_command(["scancel", "-s", "USR1", job], timeout=30).returncode == 0
        signalled = time.time()
        # What `last` said when each task was seen gone, and when the save ran.
        last_at_exit: dict[int, str] = {}
        exit_times: dict[int, float] = {}
        writing = saved = 0.0
        deadline = time.time() + 120
        while len(last_at_exit) < len(tasks) and time.time() < deadline:
            pointer = os.path.join(checkpoints, "last")
            last = read_text(pointer).strip() if os.path.exists(pointer) else ""
            if not writing and glob.glob(os.path.join(checkpoints, ".ckpt_*.tmp*")):
                writing = time.time()
            if last and not saved:
                saved = time.time()
            for rank, pid in tasks.items():
                if rank not in last_at_exit and not _alive(pid):
                    last_at_exit[rank] = last
                    exit_times[rank] = time.time() - signalled
            time.sleep(0.005)
        _, err = proc.communicate(timeout=60)
    finally:
        if job:
            run_command(["scancel", job], timeout=30)
        kill_session(proc)
    name = read_text(checkpoints, "last").strip()
    path = os.path.join(checkpoints, name)
    size = os.path.getsize(path) / 1e6
    print(
        f"checkpoint {name}: {size:.0f} MB, written in {saved - writing:.2f} s "
        f"(from {writing - signalled:.2f} s after the signal); tasks gone after "
        + ", ".join(f"{t:.2f} s (rank {r})" for r, t in sorted(exit_times.items()))
    )
    assert re.fullmatch(r"ckpt_ep_0000_it_\d{4}\.pth", name), name
    assert last_at_exit == {0: name, 1: name}, "a task exited before the save"
    ends = re.findall(r"srun: error: \S+: tasks? [\d,-]+: (.*)", err)
    assert ends and all(e == "Exited with exit code 138" for e in ends), err
    assert proc.returncode == 138, err
    state = torch.load(path, weights_only=True)
    assert state["consumed"] > 0 and "model" in state and "optimizer" in state
    assert sorted(os.listdir(checkpoints)) == sorted([name, "last"])  # no .tmp
    assert "stopped by SIGUSR1 after saving a checkpoint" in read_text(out, "log.txt")


def _model(path: str) -> dict:
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_ends_bitwise_identical(tmp_path):
    """torchrun --max-restarts=1: SIGKILL rank 0 after the first mid-epoch
    checkpoint; the restarted workers resume from it, the job exits 0, and the
    weights equal those of an uninterrupted run, bit for bit."""
    args = ["MODEL.ARCH", "resnet8", "DATA.NAME", "synthetic",
            "DATA.SYNTHETIC_SIZE", "[512,101]", "TRAIN.BATCH_SIZE", "32",
            "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "2", "RNG_SEED", "7",
            "CHECKPOINT.PERIOD_ITERS", "2", "CHECKPOINT.KEEP", "0"]  # fmt: skip
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    assert_ok(torchrun(2, *args, "OUT_DIR", reference))
    restart = torchrun_argv(2, [*args, "OUT_DIR", killed], "--max-restarts=1")
    proc = start(python_command(restart))
    try:
        first = os.path.join(killed, "checkpoints", "ckpt_ep_0000_it_0002.pth")
        deadline = time.time() + 240
        while not os.path.exists(first) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        os.kill(worker_pid(proc.pid, 0), signal.SIGKILL)
        done = os.path.join(killed, "checkpoints", "ckpt_ep_0002.pth")
        assert not os.path.exists(done), "killed too late: the run had ended"
        out, err = proc.communicate(timeout=300)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}{err[-3000:]}"
    log = read_text(killed, "log.txt")
    assert log.count("launch: torchrun, rank 0 of 2") == 2  # restarted once
    assert "resumed from " in log
    for name in ("best.pth", "checkpoints/ckpt_ep_0002.pth"):
        expected = _model(os.path.join(reference, name))
        actual = _model(os.path.join(killed, name))
        assert expected.keys() == actual.keys()
        for key in expected:
            assert torch.equal(expected[key], actual[key]), f"{name}: {key} differs"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_failed_save_on_rank_0_stops_every_rank_naming_it(tmp_path):
    """Rank 0 cannot write its checkpoint (a file named ``checkpoints`` is in
    the way): the other rank does not wait for it at the next collective, it
    stops at once and its log says why."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("in the way")
    args = ["MODEL.ARCH", "lenet5", "DATA.NAME", "synthetic",
            "DATA.SYNTHETIC_SIZE", "[256,101]", "TRAIN.BATCH_SIZE", "32",
            "OPTIM.MAX_EPOCH", "1", "DIST.INIT_TIMEOUT", "60"]  # fmt: skip
    started = time.time()
    result = torchrun(2, *args, "OUT_DIR", str(out), timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.time() - started < 50  # not a collective's time-out
    assert "error: FileExistsError" in result.stderr
    rank1 = read_text(str(out), "log_rank1.txt")
    assert "rank 0 failed to save the checkpoint (see log.txt)" in rank1
