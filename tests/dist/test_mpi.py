"""Open MPI's mpirun: launch detection from its variables, what is refused,
and a real ``mpirun -np 2`` that trains bitwise as torchrun's two ranks do.

The real run skips where ``mpirun`` is missing (CI installs Debian's
openmpi-bin: .ci/run).
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from helpers import (
    TINY,
    TRAIN_NET,
    assert_ok,
    final_model,
    free_port,
    read_metrics,
    read_text,
    refused,
    run_command,
    torchrun,
)

from distribuuuu.cli import is_rank_zero
from distribuuuu.dist import group as du
from distribuuuu.errors import LaunchError
from distribuuuu.job import is_launched

# What mpirun -np 8 on 2 nodes gives rank 5 (the second on node 1).
MPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29511",
}
# mpirun's ranks inside a Slurm allocation: Slurm's variables are its daemon's.
DAEMON_SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"}


@pytest.mark.parametrize("slurm", [{}, DAEMON_SLURM], ids=["alone", "in-slurm"])
def test_detect_mpirun(slurm):
    info = du.detect_launch({**slurm, **MPI})
    assert info == du.LaunchInfo("mpi", 5, 8, 1, 4, "10.0.0.1", 29511)


def test_torchrun_started_by_mpirun_is_torchrun():
    env = {**MPI, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert du.detect_launch(env).launcher == "torchrun"


def test_one_mpi_process_needs_no_master():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    info = du.detect_launch({**env, "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (info.launcher, info.world_size, info.local_world_size) == ("mpi", 1, 1)


@pytest.mark.parametrize(
    "missing",
    [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ],
)
def test_partial_mpi_environment_names_the_missing_variable(missing):
    env = {name: value for name, value in MPI.items() if name != missing}
    with pytest.raises(LaunchError, match=f"{missing} (is not set|missing)"):
        du.detect_launch(env)


def test_rank_checks_before_torch_know_mpirun(monkeypatch):
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert is_launched() and not is_rank_zero()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert is_rank_zero()


def test_mpirun_cpu_threads_divide_the_shared_cpus():
    """As under torchrun: Slurm's CPU counts are those of mpirun's daemon."""
    env = {**DAEMON_SLURM, **MPI, "SLURM_CPUS_PER_TASK": "16"}
    assert du.cpu_threads(16, 4, env) == 4


def test_entry_point_exits_2_without_master_addr(tmp_path, monkeypatch):
    """Every rank exits 2; rank 0 says why."""
    for name, value in MPI.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("RANK", raising=False)
    line = refused(str(tmp_path / "out"), *TINY)
    assert "MASTER_ADDR is not set" in line and "mpirun -x MASTER_ADDR" in line


def _mpirun_why_not() -> str:
    if shutil.which("mpirun") is None:
        return "Open MPI's mpirun is not installed (CI installs openmpi-bin)"
    return ""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(bool(_mpirun_why_not()), reason=_mpirun_why_not() or "ok")
def test_mpirun_two_ranks_train_bitwise_like_torchrun(tmp_path):
    """``mpirun -np 2`` (new interpreters, unbound as torchrun's workers are)
    ends with torchrun's weights and validation, bit for bit."""
    reference, launched = str(tmp_path / "torchrun"), str(tmp_path / "mpirun")
    assert_ok(torchrun(2, *TINY, "OUT_DIR", reference))
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    mpirun += ["-np", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT"]
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [*mpirun, sys.executable, TRAIN_NET, *TINY, "OUT_DIR", launched]
    result = run_command(cmd, timeout=300, env=master)
    assert_ok(result)
    assert "\x1b" not in result.stdout  # no live status line on mpirun's pty
    assert "launch: mpi, rank 1 of 2" in read_text(launched, "log_rank1.txt")
    expected, actual = final_model(reference), final_model(launched)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} is not bitwise equal"
    (one,), (two,) = read_metrics(reference, "val"), read_metrics(launched, "val")
    assert (one["top1"], one["loss"], one["samples"]) == (
        two["top1"],
        two["loss"],
        two["samples"],
    )
