"""Cluster mistakes get clear answers: srun forgotten, CPUs of a Slurm task, a
stopped peer.

The Slurm tests run real sbatch/srun against the local single-node cluster
(``tools/slurm_local.sh up``) and skip with a reason when there is none.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import (
    REPO,
    TINY,
    TRAIN_NET,
    descendants,
    kill_tree,
    run_command,
    slurm_ready,
    start,
)

import distribuuuu.dist.group as du
from distribuuuu.dist.peers import peer_failure
from distribuuuu.errors import LaunchError

needs_slurm = pytest.mark.skipif(
    bool(slurm_ready()), reason=slurm_ready() or "Slurm is up"
)

# The environment Slurm 22.05 gives a batch script of `sbatch -n 2` (abridged)
# and the one srun adds for its tasks (checked with `env | grep SLURM`).
BATCH_ENV = {
    "SLURM_JOB_ID": "7",
    "SLURM_NODELIST": "vm",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_CPUS_ON_NODE": "2",
}
SRUN_ENV = {
    **BATCH_ENV,
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}


# --------------------------------------------------------------------------- #
# srun forgotten inside sbatch
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "step", [None, "4294967294", "batch"], ids=["no-step", "batch-id", "batch"]
)
def test_detect_launch_refuses_a_batch_script_of_several_tasks(step):
    env = dict(BATCH_ENV)
    if step is not None:
        env["SLURM_STEP_ID"] = step
    with pytest.raises(LaunchError, match="srun") as caught:
        du.detect_launch(env)
    assert "task 0 of 2" in str(caught.value)
    # One task in the batch script is one process; srun's tasks are a job.
    single = du.detect_launch({**BATCH_ENV, "SLURM_NTASKS": "1"})
    assert (single.launcher, single.rank, single.world_size) == ("slurm", 0, 1)
    task = du.detect_launch({**SRUN_ENV, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"})
    assert (task.launcher, task.rank, task.world_size) == ("slurm", 1, 2)


def _sbatch_wait(tmp_path: Path, options: list[str], command: str):
    """``sbatch --wait OPTIONS --wrap COMMAND``: (exit code, seconds, output)."""
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    log = tmp_path / f"{name}.out"
    cmd = ["sbatch", "--wait", f"--job-name={name}", "--time=3", "-O"]
    cmd += [*options, f"--output={log}", "--wrap", command]
    began = time.monotonic()
    try:
        result = run_command(cmd, timeout=150, env={"PYTHONPATH": REPO})
    finally:
        subprocess.run(["scancel", f"--name={name}"], timeout=30, check=False)
    return result.returncode, time.monotonic() - began, log.read_text()


@pytest.mark.slurm
@pytest.mark.distributed
@needs_slurm
@pytest.mark.slow
def test_plain_python_in_sbatch_of_two_tasks_fails_at_once_naming_srun(tmp_path):
    """`sbatch -n 2 --wrap "python train_net.py ..."`: without srun the process
    used to wait DIST.INIT_TIMEOUT (600 s) for a rank 1 that never comes."""
    out = tmp_path / "out"

    def train(*args: str) -> str:
        return shlex.join(
            [sys.executable, TRAIN_NET, *args, *TINY, "OUT_DIR", str(out)]
        )

    code, seconds, text = _sbatch_wait(tmp_path, ["-n", "2"], train())
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert code == 2, text
    assert len(errors) == 1 and "Traceback" not in text, text
    assert "srun python tools/train_net.py" in errors[0]
    assert "task 0 of 2" in errors[0]
    assert seconds < 60
    assert not out.exists()  # nothing written
    # With one task, plain python in the batch script is a run of one process.
    code, _, text = _sbatch_wait(tmp_path, ["-n", "1"], train("--dry-run"))
    assert code == 0, text
    assert "launch: slurm, rank 0 of 1" in text and "dry run passed" in text


# --------------------------------------------------------------------------- #
# CPUs of a Slurm task
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "affinity, local, env, threads",
    [
        (16, 4, {"RANK": "0", "WORLD_SIZE": "4"}, 4),  # torchrun, 16 cores, 4 procs
        (16, 1, {}, 16),  # plain python
        (4, 4, {**SRUN_ENV, "SLURM_CPUS_PER_TASK": "4"}, 4),  # srun binds 4 CPUs
        (16, 4, {**SRUN_ENV, "SLURM_CPUS_PER_TASK": "4"}, 4),  # srun, no binding
        (16, 4, {**SRUN_ENV, "SLURM_CPUS_ON_NODE": "16"}, 4),  # no -c, whole node
        (1, 4, {**SRUN_ENV, "SLURM_CPUS_ON_NODE": "4"}, 1),  # no -c, bound to 1
        (3, 2, {"RANK": "0", "WORLD_SIZE": "2"}, 1),
        # torchrun inside one srun task of 8 CPUs: its 2 processes share them
        (8, 2, {**SRUN_ENV, "SLURM_CPUS_PER_TASK": "8", "RANK": "0"}, 4),
    ],
)
def test_cpu_threads_divide_only_shared_cpus(affinity, local, env, threads):
    assert du.cpu_threads(affinity, local, env) == threads


@pytest.mark.slurm
@pytest.mark.distributed
@needs_slurm
@pytest.mark.slow
def test_srun_tasks_with_cpus_per_task_keep_their_cpus(tmp_path):
    """`srun -n 2 -c 2`: each task owns 2 CPUs and runs 2 threads (it used to
    divide them again by the 2 tasks of the node: 1 thread)."""
    cmd = ["env", "-u", "OMP_NUM_THREADS", "srun", "-O", "-n", "2", "-c", "2"]
    cmd += ["--time=3", sys.executable, TRAIN_NET, "--dry-run", *TINY]
    result = run_command([*cmd, "OUT_DIR", str(tmp_path / "out")], timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    assert "launcher slurm" in text and "2 CPU thread(s) per process" in text


@pytest.mark.slurm
@pytest.mark.distributed
@needs_slurm
@pytest.mark.slow
def test_slurm_train_sh_hands_cpus_per_task_to_srun(tmp_path):
    """Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: the
    ready script hands it on as SRUN_CPUS_PER_TASK."""
    seen = tmp_path / "task_env.txt"
    python = tmp_path / "python"  # records the task's environment, runs python
    python.write_text(f'#!/bin/sh\nenv > {seen}\nexec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    cmd = ["sbatch", "--wait", f"--job-name={name}", "--gres=none", "-O"]
    cmd += ["--ntasks-per-node=1", "--cpus-per-task=2", "--time=3"]
    cmd += [f"--output={tmp_path}/slurm-%j.out", "tools/slurm_train.sh"]
    cmd += ["--dry-run", *TINY, "OUT_DIR", str(tmp_path / "out")]
    try:
        result = run_command(cmd, timeout=150, env={"PYTHON": str(python)})
    finally:
        subprocess.run(["scancel", f"--name={name}"], timeout=30, check=False)
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert result.returncode == 0, logs
    assert "dry run passed" in logs
    task_env = seen.read_text().splitlines()
    assert "SRUN_CPUS_PER_TASK=2" in task_env and "SLURM_CPUS_PER_TASK=2" in task_env


# --------------------------------------------------------------------------- #
# A stopped peer
# --------------------------------------------------------------------------- #


def test_only_a_backend_timeout_or_lost_peer_is_told_as_one():
    assert peer_failure(RuntimeError("DataLoader timed out after 5 seconds")) is None
    assert peer_failure(ValueError("gloo timeout")) is None


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the train_net processes under ``launcher_pid``."""
    ranks = {}
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                items = f.read().split(b"\0")
            env = dict(item.split(b"=", 1) for item in items if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"RANK" in env and TRAIN_NET.encode() in cmdline:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_stopped_peer_is_named_with_the_timeout(tmp_path):
    """SIGSTOP rank 1 of a torchrun job mid-run: rank 0 used to end with gloo's
    "Timed out waiting 10000ms for recv operation to complete"."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node=2", TRAIN_NET, *TINY, "OPTIM.MAX_EPOCH", "100"]
    proc = start([*cmd, "DIST.INIT_TIMEOUT", "10", "OUT_DIR", str(out)])
    stopped = None
    try:
        log = out / "log.txt"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            log.exists() and "train ep 2/100" in log.read_text()
        ):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGSTOP)
        stopped, began = ranks[1], time.monotonic()
        while time.monotonic() - began < 60 and not _gone(ranks[0]):
            time.sleep(0.1)
        seconds = time.monotonic() - began
        kill_tree(stopped)  # torchrun would wait 30 s more for it to stop
        _, err = proc.communicate(timeout=60)
    finally:
        if stopped is not None:
            for send in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, send)
        kill_tree(proc.pid)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: rank 0: a collective waited ")
    assert "DIST.INIT_TIMEOUT=10s" in errors[0]
    assert "rank 1 did not answer (stopped, dead or hung)" in errors[0]
    assert 10 <= seconds < 40
    assert "PeerLostError" in (out / "log.txt").read_text()
