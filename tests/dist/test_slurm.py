"""Real Slurm: srun and sbatch against the local single-node cluster.

CI brings the cluster up with ``tools/slurm_local.sh up``; elsewhere these tests
skip when ``srun`` is missing or no node is usable.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
from helpers import (
    FAST,
    TRAIN_NET,
    assert_ok,
    read_metrics,
    read_text,
    run_command,
    slurm_ready,
    train_net,
)

from distribuuuu.models import build_model

pytestmark = pytest.mark.skipif(bool(slurm_ready()), reason=slurm_ready() or "ok")


def _sbatch(option: str, log_dir, *args: str) -> list[str]:
    """sbatch of the ready script on this CPU-only node: 2 tasks, 1 CPU each."""
    return ["sbatch", option, "--gres=none", "--ntasks-per-node=2",
            "--cpus-per-task=1", "--time=10", f"--output={log_dir}/slurm-%j.out",
            "tools/slurm_train.sh", *args]  # fmt: skip


@pytest.mark.slurm
@pytest.mark.distributed
@pytest.mark.slow
def test_srun_three_tasks_evaluate_like_one_process(tmp_path):
    """srun -O: 3 tasks on the 2-CPU node; the weights need not be trained."""
    torch.manual_seed(0)
    weights = str(tmp_path / "resnet8.pth")
    torch.save(build_model("resnet8", 10).state_dict(), weights)
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    args = ["--eval-only", *FAST, "MODEL.WEIGHTS", weights, "TEST.BATCH_SIZE", "64"]
    assert_ok(train_net(*args, "OUT_DIR", single))
    cmd = [
        "srun",
        "-O",
        "-n",
        "3",
        "--time=10",
        sys.executable,
        TRAIN_NET,
        *args,
        "OUT_DIR",
        multi,
    ]
    assert_ok(run_command(cmd, timeout=300))
    (one,), (three,) = read_metrics(single, "val"), read_metrics(multi, "val")
    assert three["world_size"] == 3 and one["world_size"] == 1
    assert three["samples"] == one["samples"] == 1000
    assert (three["top1"], three["topk"]) == (one["top1"], one["topk"])
    assert three["loss"] == pytest.approx(one["loss"], rel=1e-6)


@pytest.mark.slurm
@pytest.mark.distributed
@pytest.mark.slow
def test_srun_two_tasks_train_with_deepspeed(tmp_path):
    """DIST.STRATEGY deepspeed joins the process group srun's tasks form."""
    pytest.importorskip("deepspeed")
    out = str(tmp_path)
    args = [
        "MODEL.ARCH",
        "lenet5",
        "OPTIM.MAX_EPOCH",
        "1",
        "DIST.STRATEGY",
        "deepspeed",
    ]
    cmd = ["srun", "-O", "-n", "2", "--time=10", sys.executable, TRAIN_NET, *args]
    result = run_command([*cmd, "OUT_DIR", out], timeout=300)
    assert_ok(result)
    assert "launcher slurm" in result.stdout and "deepspeed ZeRO-2" in result.stdout
    (val,) = read_metrics(out, "val")
    assert val["world_size"] == 2 and val["samples"] == 1000


@pytest.mark.slurm
@pytest.mark.distributed
@pytest.mark.slow
def test_sbatch_job_signalled_with_usr1_requeues_itself_and_finishes(tmp_path):
    """The ready script under sbatch: 2 tasks train, SIGUSR1 (what Slurm sends
    before a time limit or preemption) makes them checkpoint and requeue the
    job, which resumes and finishes."""
    out = tmp_path / "run"
    args = [*FAST, "OPTIM.MAX_EPOCH", "2", "DIST.REQUEUE", "True", "OUT_DIR", str(out)]
    cmd = _sbatch("--parsable", tmp_path, *args)
    submitted = run_command(cmd, timeout=60, env={"PYTHON": sys.executable})
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        log = out / "log.txt"
        deadline = time.time() + 240
        while time.time() < deadline and not (
            log.exists() and "train ep 1/2 it 20/" in log.read_text()
        ):
            time.sleep(0.2)
        assert (
            run_command(["scancel", "--signal=USR1", job], timeout=30).returncode == 0
        )
        # The requeued job starts again ~12 s later (slurm_local.sh shortens
        # Slurm's cred_expire and scheduling interval; forcing StartTime=now
        # instead gets it killed: "Job credential revoked").
        deadline = time.time() + 180
        while (
            time.time() < deadline
            and not (out / "checkpoints" / "ckpt_ep_0002.pth").exists()
        ):
            time.sleep(0.5)
        while (
            time.time() < deadline
            and job
            in run_command(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()
        ):
            time.sleep(0.5)
    finally:
        run_command(["scancel", job], timeout=30)
    text = log.read_text()
    assert "launch: slurm, rank 0 of 2" in text
    assert "stopped by SIGUSR1 after saving a checkpoint" in text
    assert "requeued the Slurm job" in text
    assert "resumed from" in text
    val = read_metrics(str(out), "val")
    assert [r["epoch"] for r in val] == [1, 2]
    assert all(r["world_size"] == 2 and r["samples"] == 1000 for r in val)
    logs = "".join(read_text(str(p)) for p in tmp_path.glob("slurm-*.out"))
    assert "2 task(s)" in logs
