"""Writing files so that a crash, a signal or a full disk never leaves a
partial one, and never through a link or over a device; reading a small
record file that anyone could have put there.

Below everything else: the config's ``dump_cfg`` and the checkpoint files
both write through :func:`atomic_write`. Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import Any

from distribuuuu.errors import DiskFullError, OutputPathError


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(error: BaseException, directory: str) -> bool:
    """Whether ``error`` came from a full disk.  torch.save reports it as a
    RuntimeError of its zip writer ("unexpected pos"), so the free space of
    ``directory`` decides when the error does not say."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    try:
        usage = os.statvfs(directory)
    except OSError:
        return False
    return usage.f_bavail * usage.f_frsize < (1 << 20)


def raise_if_disk_full(error: BaseException, directory: str, path: str) -> None:
    """Raise DiskFullError naming ``path`` when ``error``, raised while writing
    it into ``directory``, came from a full disk."""
    if _disk_full(error, directory):
        raise DiskFullError(f"no space left on device while writing {path}") from error


# What an existing path is, when it is not a regular file.
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def check_output_path(path: str) -> None:
    """Refuse to write ``path`` where it is a symbolic link or exists as
    anything but a regular file: the rename of a new file would replace the
    link or the device (``/dev/null`` as root) instead of writing into it."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # a new file (or an impossible path, which open() reports)
    if stat.S_ISLNK(mode):
        raise OutputPathError(
            f"{path} is a symbolic link: refusing to replace it; write to the "
            "file it points to, or to a new path"
        )
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "no regular file")
        raise OutputPathError(
            f"{path} is {kind}, not a regular file: refusing to replace it; "
            "write to a file"
        )


def atomic_write(path: str, write: Callable[[Any], Any]) -> None:
    """Call ``write(file)`` on a temporary file, fsync it and rename it to ``path``.

    On any failure the temporary file is removed and ``path`` keeps what it
    held; a full disk raises DiskFullError naming ``path``.  A ``path`` that
    is a link or not a regular file raises OutputPathError before anything
    is written.
    """
    check_output_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        raise_if_disk_full(error, directory, path)
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


def read_small_file(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them:
    never through a link, never waiting on a FIFO.  OSError when it cannot be
    opened, ValueError when it is no regular file or is larger."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return data
