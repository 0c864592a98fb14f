"""One run per OUT_DIR (issue 32): a second run on a live OUT_DIR exits 2
naming the holder, the lock dies with its holder, a file system without locks
warns and goes on, and OUT_DIR / is refused."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import (
    REPO,
    TINY,
    TRAIN_NET,
    call_main,
    free_port,
    import_train_net,
    kill_session,
    start,
)

from distribuuuu.engine import out_dir, run_lock, trainer
from distribuuuu.errors import ConfigError

# A live run, as far as the lock can tell: takes OUT_DIR's lock, says so, sleeps.
HOLDER = """
import sys, time
from distribuuuu.engine import run_lock
run_lock.record_holder(run_lock.lock_out_dir(sys.argv[1]))
print("held", flush=True)
time.sleep(300)
"""


@pytest.fixture
def holder(tmp_path):
    """OUT_DIR ``tmp_path/out`` and the process that holds its lock."""
    out = tmp_path / "out"
    out.mkdir()
    proc = start([sys.executable, "-c", HOLDER, str(out)], env={"PYTHONPATH": REPO})
    line = proc.stdout.readline()
    assert line == "held\n", line + proc.stderr.read()
    yield out, proc
    kill_session(proc)


def files_of(root: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``root``."""
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """The ``error:`` lines of ``result``'s stderr."""
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def check(*args: str):
    """train_net.py's start-up checks of ``ARGS`` in this process (no run)."""
    tool = import_train_net()
    return tool.load_and_check(tool.parse_args(list(args)))


@pytest.mark.parametrize("resume", ["True", "False"])
def test_second_run_on_a_live_out_dir_exits_2_naming_the_holder(holder, resume):
    out, proc = holder
    # The live run's mid-epoch checkpoint: not read, not resumed, not refused as
    # another run's: the lock is checked first.
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "ckpt_ep_0001_iter_000004.pth").write_bytes(b"live")
    before = files_of(out)
    result = call_main(*TINY, "TRAIN.AUTO_RESUME", resume, "OUT_DIR", str(out))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = error_lines(result)
    assert f"OUT_DIR {out} is in use by another run" in line
    assert f"host {socket.gethostname()}, pid {proc.pid}" in line
    assert files_of(out) == before  # nothing written, the holder's record kept


def test_lock_is_free_once_its_holder_is_killed(holder):
    out, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lock = run_lock.lock_out_dir(str(out))  # the stale file is taken over
    try:
        run_lock.record_holder(lock)
        record = json.loads((out / run_lock.LOCK_NAME).read_text())
        assert record["pid"] == os.getpid()
    finally:
        run_lock.release_out_dir_locks()


# Another process's attempt at OUT_DIR's lock: prints the refusal, or "free".
PROBE = """
import sys
from distribuuuu.engine import run_lock
from distribuuuu.errors import OutDirInUseError
try:
    run_lock.lock_out_dir(sys.argv[1])
    print("free")
except OutDirInUseError as error:
    print(error)
"""


def probe(out: Path) -> str:
    """What another process that tries to lock ``out`` now is told."""
    cmd = [sys.executable, "-c", PROBE, str(out)]
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(cmd, capture_output=True, text=True, env=env).stdout


def test_a_run_holds_the_lock_until_it_ends(tmp_path, monkeypatch):
    out = tmp_path / "out"
    told = []

    def train_model(cfg) -> dict:  # the run: asks another process meanwhile
        told.append(probe(out))
        return {}

    monkeypatch.setattr(trainer, "train_model", train_model)
    assert call_main(*TINY, "OUT_DIR", str(out)).returncode == 0
    assert f"pid {os.getpid()}, started" in told[0]
    assert probe(out) == "free\n"


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / run_lock.LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="a symbolic link"):
        run_lock.lock_out_dir(str(tmp_path))
    assert target.read_text() == "kept"


def test_file_system_without_locks_warns_once_and_the_run_goes_on(
    tmp_path, monkeypatch
):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(*TINY, "OUT_DIR", str(out))
    told = [w for w in caught if "cannot lock" in str(w.message)]
    assert len(told) == 1 and str(out) in str(told[0].message)
    assert out.is_dir() and not (out / run_lock.LOCK_NAME).exists()


@pytest.mark.parametrize("flag", ["--dry-run", "--eval-only"])
def test_dry_run_and_eval_only_take_no_lock(holder, flag, tmp_path):
    out, _ = holder
    before = files_of(out)
    check(flag, *TINY, "OUT_DIR", str(out))  # beside a live run: not refused
    assert files_of(out) == before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    check(flag, *TINY, "OUT_DIR", str(fresh))
    assert not (fresh / run_lock.LOCK_NAME).exists()


def test_a_dry_run_proves_a_missing_out_dir_creatable_without_creating_it(
    tmp_path, monkeypatch
):
    # Created and removed again, OUT_DIR was left behind when another rank's
    # probe was in it at that moment: a dry run creates no folder at all.
    out = tmp_path / "run" / "out"
    probed = []
    write_probe = out_dir._write_probe

    def probe(directory):
        probed.append((directory, out.parent.exists()))
        write_probe(directory)

    monkeypatch.setattr(out_dir, "_write_probe", probe)
    out_dir.check_out_dir(str(out), keep=False)
    assert probed == [(str(tmp_path), False)]
    assert os.listdir(tmp_path) == []
    out_dir.check_out_dir(str(out), keep=True)
    assert probed[-1] == (str(out), True) and out.is_dir()


def test_a_run_refused_after_taking_the_lock_leaves_no_lock_file(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "best.pth").write_bytes(b"an earlier run's")
    before = files_of(out)
    result = call_main(*TINY, "TRAIN.AUTO_RESUME", "False", "OUT_DIR", str(out))
    assert result.returncode == 2 and "TRAIN.AUTO_RESUME False" in result.stderr
    assert files_of(out) == before


def test_out_dir_at_the_root_of_the_file_system_exits_2():
    # TRAIN.BATCH_SIZE 512 > the 256 images: refused before any write either way
    result = call_main(*TINY, "TRAIN.BATCH_SIZE", "512", "OUT_DIR", "/")
    assert result.returncode == 2
    (line,) = error_lines(result)
    assert line.startswith("error: OUT_DIR / is the root of the file system")


@pytest.mark.parametrize("path", ["/tmp/..", "//", "link"])
def test_out_dir_resolving_to_the_root_is_refused(path, tmp_path):
    if path == "link":
        path = str(tmp_path / "link")
        os.symlink("/", path)
    with pytest.raises(ConfigError, match="is the root of the file system"):
        out_dir.check_out_dir_path(path)


def launched_rank(rank: int, port: int, out: Path) -> subprocess.Popen:
    """Rank ``rank`` of a 2-process train_net.py job started as srun starts
    tasks: no launcher stops a rank when another exits."""
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    env.update(LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = [*TINY, "DIST.INIT_TIMEOUT", "300", "OUT_DIR", str(out)]
    return start([sys.executable, TRAIN_NET, *args], env=env)


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_of_a_launched_second_run_exits_2(holder):
    """Only rank 0 takes the lock; rank 1 learns of its refusal from it and
    exits 2 too, instead of waiting for it until DIST.INIT_TIMEOUT."""
    out, proc = holder
    port = free_port()
    ranks = [launched_rank(rank, port, out) for rank in (0, 1)]
    try:
        results = [rank.communicate(timeout=200) for rank in ranks]
    finally:
        for rank in ranks:
            kill_session(rank)
    assert [rank.returncode for rank in ranks] == [2, 2], results
    (line,) = [x for x in results[0][1].splitlines() if x.startswith("error:")]
    assert f"pid {proc.pid}" in line
    assert "error:" not in results[1][1]  # one line, rank 0's
    assert sorted(os.listdir(out)) == [run_lock.LOCK_NAME]
