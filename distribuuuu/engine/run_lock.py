"""One run per OUT_DIR: rank 0 of a training run holds a lock on ``OUT_DIR/.lock``.

A second run on the same OUT_DIR (a job array, a requeue, a second torchrun
by mistake) would mix its checkpoints and metrics with the first's and could
resume from its mid-epoch checkpoint.  :func:`lock_out_dir` takes the lock
before anything is written there; while another process holds it, the run is
refused with the host and pid that the lock file records.

The lock is a POSIX record lock (``fcntl.lockf``, F_SETLK) rather than
``flock``: the kernel drops it when the process dies (SIGKILL included), a
forked child neither inherits nor keeps it (a loader worker outliving rank 0
would keep a ``flock``), and NFS (v3 through lockd, v4 itself), Lustre mounted
with ``-o flock``, GPFS and CephFS carry it between hosts, so that a job
requeued on another host takes it over once the first is gone (Linux emulates
``flock`` on NFS with these very locks).  Its one trap: a process loses it when
it closes *any* descriptor of the file, so only this module opens it.  Where
the file system cannot lock at all, the run is warned once and goes on.

The file stays behind, hidden; a file that no live process locks is stale and
simply taken over.  A refusal of rank 0 in a launched job is told to every
rank by :mod:`distribuuuu.dist.refusal`.  Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
import warnings
from dataclasses import dataclass

from distribuuuu.dist.refusal import forget_refusal
from distribuuuu.errors import ConfigError, OutDirInUseError

LOCK_NAME = ".lock"

# The lock call's errors that mean "held by another process", and those that
# mean "this file system cannot lock" (NFS without lockd, Lustre without -o
# flock, some FUSE file systems).
_HELD_ERRNOS = {errno.EACCES, errno.EAGAIN}
_NO_LOCKS_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


@dataclass(frozen=True)
class RunLock:
    """The lock this process holds on an OUT_DIR: its file, the open
    descriptor that holds it, and whether this process created the file."""

    path: str
    fd: int
    created: bool


# What this process holds, by the real path of the lock file.  The descriptors
# stay open until the process ends (or release_out_dir_locks): closing one
# would drop the lock.
_HELD: dict[str, RunLock] = {}


def lock_path(out_dir: str) -> str:
    """The lock file of ``out_dir``."""
    return os.path.join(out_dir, LOCK_NAME)


def _open_lock_file(path: str) -> tuple[int, bool]:
    """Open (or create) ``path`` for the lock, never through a link; the
    descriptor and whether it was created."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as error:
        reason = "a symbolic link" if error.errno == errno.ELOOP else error.strerror
        raise ConfigError(
            f"OUT_DIR lock file {path}: cannot open it: {reason}"
        ) from error
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"OUT_DIR lock file {path} is not a regular file; remove it")
    return fd, False


def _still_named(path: str, fd: int) -> bool:
    """True when ``path`` still names the file open as ``fd`` (a run that
    failed its checks removes a lock file it created)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    """The holder that the lock file records, in words."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        host, pid, started = record["host"], record["pid"], record["started"]
        return f"host {host}, pid {pid}, started {started}"
    except (OSError, ValueError, TypeError, KeyError):
        return "host and pid not recorded yet"


def _refusal(out_dir: str, path: str, fd: int) -> OutDirInUseError:
    """The error of a run refused because another process holds ``path``."""
    return OutDirInUseError(
        f"OUT_DIR {out_dir} is in use by another run ({_holder(fd)}), which holds "
        f"the lock {path}; wait for it to end, or use another OUT_DIR"
    )


def _cannot_lock(out_dir: str, path: str, error: OSError) -> None:
    """Warn that ``out_dir``'s file system cannot lock, so runs are not kept apart."""
    warnings.warn(
        f"OUT_DIR {out_dir}: its file system cannot lock {path} "
        f"({error.strerror or error}), so a second run on this OUT_DIR would not "
        "be refused; make sure that only one run uses it",
        RuntimeWarning,
        stacklevel=3,
    )


def lock_out_dir(out_dir: str) -> RunLock | None:
    """Take the lock of the existing ``out_dir`` for this process's lifetime.

    Returns the lock, or None where the file system cannot lock (warned).
    Raises OutDirInUseError naming the holder's host and pid while another
    process holds it, ConfigError where the lock file cannot be opened.
    """
    path = lock_path(out_dir)
    key = os.path.realpath(path)
    if key in _HELD:  # a POSIX lock is per process: taken again, it is ours
        return _HELD[key]
    for _ in range(3):  # a file removed while we waited for it: open the new one
        fd, created = _open_lock_file(path)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            held = error.errno in _HELD_ERRNOS
            refusal = _refusal(out_dir, path, fd) if held else None
            os.close(fd)
            if refusal is not None:
                raise refusal from error
            if error.errno not in _NO_LOCKS_ERRNOS:
                reason = error.strerror or str(error)
                raise ConfigError(
                    f"OUT_DIR lock file {path}: cannot lock it: {reason}"
                ) from error
            if created:  # no run can lock it: leave OUT_DIR as it was
                with contextlib.suppress(OSError):
                    os.remove(path)
            _cannot_lock(out_dir, path, error)
            return None
        if _still_named(path, fd):
            _HELD[key] = RunLock(path, fd, created)
            return _HELD[key]
        os.close(fd)
    raise ConfigError(f"OUT_DIR lock file {path} keeps being replaced; try again")


def record_holder(lock: RunLock | None) -> None:
    """Write this process's host, pid and start time into the lock file."""
    if lock is None:
        return
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    data = (json.dumps(record) + "\n").encode("utf-8")
    os.ftruncate(lock.fd, 0)
    os.pwrite(lock.fd, data, 0)
    os.fsync(lock.fd)  # seen by a run refused on another host of a shared file system


def release_out_dir(lock: RunLock | None) -> None:
    """Let go of ``lock``, removing the lock file if this process created it
    (a run refused by a later check leaves OUT_DIR as it found it)."""
    if lock is None:
        return
    if lock.created:
        with contextlib.suppress(OSError):
            os.remove(lock.path)
    _HELD.pop(os.path.realpath(lock.path), None)
    os.close(lock.fd)


def release_out_dir_locks() -> None:
    """Let go of every lock of this process and forget a deferred refusal
    (a run that ended; the file stays, as a finished run's)."""
    for lock in list(_HELD.values()):
        os.close(lock.fd)
    _HELD.clear()
    forget_refusal()
