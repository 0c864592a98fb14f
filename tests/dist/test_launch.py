"""Every way to start a job, started for real: spawn, two-node torchrun, DP,
failure behaviour (dead peers, unreachable master, taken port)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import (
    FAST,
    TINY,
    TINY_VAL_SIZE,
    TRAIN_NET,
    assert_ok,
    free_port,
    kill_session,
    process_table,
    read_metrics,
    read_text,
    run_command,
    start,
    train_net,
)

from distribuuuu.bench.netsim import why_unavailable


def _session_processes(session_id: int) -> list[int]:
    """Live processes of a session (what start_new_session=True created)."""
    return [
        p for p, _, sid, state in process_table() if sid == session_id and state != "Z"
    ]


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the children of ``pid``."""
    out = []
    for child, parent, _, _ in process_table():
        if parent == pid:
            with contextlib.suppress(OSError):
                out.append((child, read_text("/proc", str(child), "cmdline")))
    return out


def _wait_for(path: str, text: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and text in read_text(path):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear in {path}")


@pytest.mark.distributed
@pytest.mark.slow
def test_num_procs_spawns_a_real_process_group(tmp_path):
    result = train_net("--num-procs", "2", *TINY, "OUT_DIR", str(tmp_path))
    assert_ok(result)
    (val,) = read_metrics(str(tmp_path), "val")
    assert val["world_size"] == 2 and val["samples"] == TINY_VAL_SIZE
    assert "rank 0 of 2" in read_text(str(tmp_path), "log.txt")


@pytest.mark.slow
def test_num_procs_worker_failure_exits_nonzero_without_orphans(tmp_path):
    proc = start(
        [
            sys.executable,
            TRAIN_NET,
            "--num-procs",
            "2",
            *FAST,
            "OPTIM.MAX_EPOCH",
            "5",
            "OUT_DIR",
            str(tmp_path),
        ]
    )
    try:
        _wait_for(str(tmp_path / "log_rank1.txt"), "train ep 1/5", proc, 120)
        workers = sorted(pid for pid, cmd in _children(proc.pid) if "spawn_main" in cmd)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_session(proc)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith("error: ")
    assert "SIGKILL" in err
    # The other worker is stopped by the parent; give it a moment to go.
    deadline = time.monotonic() + 30
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_processes(proc.pid) == []


@pytest.mark.slow
def test_killed_rank_makes_its_peer_exit_within_the_timeout(tmp_path):
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        args = [
            *FAST,
            "OPTIM.MAX_EPOCH",
            "5",
            "DIST.INIT_TIMEOUT",
            "30",
            "OUT_DIR",
            str(tmp_path),
        ]
        procs.append(start([sys.executable, TRAIN_NET, *args], env))
    try:
        _wait_for(str(tmp_path / "log_rank1.txt"), "train ep 1/5", procs[1], 120)
        os.killpg(procs[1].pid, signal.SIGKILL)
        began = time.time()
        procs[0].communicate(timeout=90)
        assert procs[0].returncode != 0
        assert time.time() - began < 30 + 15
    finally:
        for proc in procs:
            kill_session(proc)


def _join_alone(rank: int, port: int, out_dir) -> subprocess.CompletedProcess:
    """Start rank ``rank`` of 2 with no peer, against master 127.0.0.1:``port``."""
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    cmd = [sys.executable, TRAIN_NET, *TINY, "DIST.INIT_TIMEOUT", "5",
           "OUT_DIR", str(out_dir)]  # fmt: skip
    return run_command(cmd, env=env, timeout=120)


@pytest.mark.slow
def test_unreachable_master_is_a_clear_error_within_the_timeout(tmp_path):
    port = free_port()  # nobody listens there
    began = time.time()
    result = _join_alone(1, port, tmp_path)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1 of 2 could not join")
    assert f"127.0.0.1:{port}" in line and "DIST.INIT_TIMEOUT=5s" in line
    assert time.time() - began < 5 + 40  # the timeout plus interpreter start-up


@pytest.mark.slow
def test_taken_port_is_a_clear_error(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _join_alone(0, port, tmp_path)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 0 of 2 could not join") and str(port) in line


@pytest.mark.slow
def test_two_node_torchrun_on_one_machine(tmp_path):
    """Over loopback, where namespaced nodes cannot be made (not root): where
    they can, tests/dist/test_multinode.py asserts all this between them."""
    if not why_unavailable():
        pytest.skip("covered across namespaced nodes by tests/dist/test_multinode.py")
    port = str(free_port())
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node_rank}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            TRAIN_NET,
            *TINY,
            "OUT_DIR",
            str(tmp_path),
        ]
        procs.append(start(cmd))
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_session(proc)
    (val,) = read_metrics(str(tmp_path), "val")
    assert val["world_size"] == 2 and val["samples"] == TINY_VAL_SIZE

    def val_line(name: str) -> str:
        lines = read_text(str(tmp_path), name).splitlines()
        return next(line for line in lines if "val ep 1/1" in line).split("] ", 1)[1]

    assert val_line("log.txt") == val_line("log_rank1.txt")


@pytest.mark.slow
def test_data_parallel_mode_falls_back_to_one_device(tmp_path):
    result = train_net(*TINY, "DIST.MODE", "dp", "OUT_DIR", str(tmp_path))
    assert_ok(result)
    assert "falling back to one device" in result.stdout
    (val,) = read_metrics(str(tmp_path), "val")
    assert val["samples"] == TINY_VAL_SIZE


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--num-procs", "0"], ["--num-procs", "2"]])
def test_num_procs_misuse(tmp_path, args):
    env = {"RANK": "0", "WORLD_SIZE": "1"} if args[1] == "2" else {}
    result = run_command(
        [sys.executable, TRAIN_NET, *args, "OUT_DIR", str(tmp_path)],
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: --num-procs")
