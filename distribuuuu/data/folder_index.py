"""The index of an image-folder split: one walk, on rank 0, for every rank.

Listing a split of 1.28 M files is a metadata storm on a parallel file
system; every rank listing it is N of them.  Rank 0 lists the split (or
reads the index it wrote before, if still current) and sends the index to
the other ranks through the process group, as bytes: they list nothing.

The index file (JSON, never pickle) holds the split's classes, each class's
image files relative to its class folder, and the stamp (modification time
in ns and inode) of every folder listed.  A folder's time changes only
when an entry of its own is added, removed or renamed, so every folder is
checked, not only the split: rank 0 stats each recorded folder (a few
thousand stats instead of a listing of every file) and lists the split
again when one changed.  The file is untrusted input: one that is too
large, not a regular file, not JSON, or names a path outside its split
(absolute, with ``..``, a NUL, not an image file name, in a folder the
walk did not record) is refused with a warning and the split listed again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import Any

from torchvision.datasets.folder import IMG_EXTENSIONS

from distribuuuu.data.datasets import (
    UNLISTED,
    FolderStamps,
    find_image_classes,
    folder_stamp,
    scan_image_classes,
)
from distribuuuu.dist import group as du
from distribuuuu.errors import DataError, DiskFullError, OutputPathError
from distribuuuu.fileio import atomic_write

logger = logging.getLogger(__name__)

FORMAT = "distribuuuu-folder-index"
VERSION = 1
# The largest index read or written: about 25 M image files (ImageNet's
# 1.28 M take about 40 MB); a larger file is refused before it is parsed.
MAX_INDEX_BYTES = 1 << 30
# A folder changed within this long before the walk began may change again
# in the same tick of a coarse clock (Lustre and NFS keep seconds) or of a
# file server's clock that runs ahead: its time would not tell, so an index
# holding one is not trusted (as git treats "racily clean" entries).
RACY_NS = 2_000_000_000
# The payload sent to the other ranks starts with one of these.
_INDEX, _ERROR = b"I", b"E"


class RefusedIndexError(ValueError):
    """An index file that is damaged, crafted or of another split."""


@dataclass(frozen=True)
class FolderIndex:
    """The classes and image files of a split, and the folders listed."""

    root: str  # the split folder, absolute
    scanned_ns: int  # wall-clock time (ns) when the walk began
    classes: list[str]  # sorted: the labels
    files: list[list[str]]  # each class's images, relative to its folder
    folders: FolderStamps  # relative folder ("" the split) -> stamp

    def listing(self, path: str) -> tuple[list[str], list[list[str]]]:
        """The classes and each one's image paths under split ``path``, as
        :func:`~distribuuuu.data.datasets.scan_image_classes` gives them."""
        # os.path.join of each, the same strings; about 3 times as fast.
        folders = [os.path.join(path, name, "") for name in self.classes]
        files = [
            [folder + relative for relative in relatives]
            for folder, relatives in zip(folders, self.files, strict=True)
        ]
        return self.classes, files


def scan_split(path: str, key: str) -> FolderIndex:
    """List split ``path`` (one walk); a DataError naming ``key`` as
    :func:`~distribuuuu.data.datasets.find_image_classes` raises it."""
    scanned_ns, stamps = time.time_ns(), FolderStamps()
    classes, files = scan_image_classes(path, key, stamps)
    prefix = os.path.join(path, "")
    relative = []
    for name, paths in zip(classes, files, strict=True):
        start = len(os.path.join(path, name)) + 1
        relative.append([file[start:] for file in paths])
    folders = {
        "" if folder == path else folder[len(prefix) :]: stamp
        for folder, stamp in stamps.items()
    }
    return FolderIndex(os.path.abspath(path), scanned_ns, classes, relative, folders)


def encode_index(index: FolderIndex) -> bytes:
    """The index as JSON (ASCII: names that are not UTF-8 survive escaped)."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "root": index.root,
        "scanned_ns": index.scanned_ns,
        "folders": [[name, *stamp] for name, stamp in index.folders.items()],
        "classes": [[n, f] for n, f in zip(index.classes, index.files, strict=True)],
    }
    return json.dumps(document, separators=(",", ":")).encode("ascii")


def decode_index(data: bytes) -> FolderIndex:
    """The index of ``data``; RefusedIndexError says why it cannot be one."""
    if len(data) > MAX_INDEX_BYTES:
        raise RefusedIndexError(f"larger than {MAX_INDEX_BYTES} bytes")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise RefusedIndexError(f"not JSON ({type(error).__name__})") from error
    expected = {"format", "version", "root", "scanned_ns", "folders", "classes"}
    if not isinstance(document, dict) or set(document) != expected:
        raise RefusedIndexError("not an index: other fields")
    if document["format"] != FORMAT or document["version"] != VERSION:
        raise RefusedIndexError("not an index of this format or version")
    root, scanned_ns = document["root"], document["scanned_ns"]
    if not (isinstance(root, str) and os.path.isabs(root) and "\0" not in root):
        raise RefusedIndexError("its split folder is no absolute path")
    if not _is_count(scanned_ns):
        raise RefusedIndexError("its time is no count of nanoseconds")
    folders = _read_folders(document["folders"])
    classes, files = _read_classes(document["classes"], folders)
    return FolderIndex(root, scanned_ns, classes, files, folders)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def is_relative(path: Any) -> bool:
    """True for a normalized relative path that stays below its folder: no
    absolute path, no ``..`` or ``.``, no empty part, no NUL."""
    if not isinstance(path, str) or not path or "\0" in path:
        return False
    parts = path.split(os.sep)
    return not os.path.isabs(path) and all(p not in ("", ".", "..") for p in parts)


def _read_folders(entries: Any) -> FolderStamps:
    """The folders' stamps of an index's ``folders``: [name, time, inode]."""
    if not isinstance(entries, list):
        raise RefusedIndexError("its folders are no list")
    folders: FolderStamps = {}
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise RefusedIndexError("a folder is not [name, time, inode]")
        name, mtime_ns, inode = entry
        if not (name == "" or is_relative(name)):
            raise RefusedIndexError(f"folder {name!r} is outside the split")
        # A time may precede 1970 (negative); an inode may not.
        if type(mtime_ns) is not int or not _is_count(inode) or name in folders:
            raise RefusedIndexError(f"folder {name!r}: a bad stamp, or listed twice")
        folders[name] = (mtime_ns, inode)
    if "" not in folders:
        raise RefusedIndexError("the split folder itself is not recorded")
    return folders


def _read_classes(
    entries: Any, folders: FolderStamps
) -> tuple[list[str], list[list[str]]]:
    """The classes of an index's ``classes``, each [name, [image, ...]]; every
    image a relative image file name in a folder the walk recorded."""
    if not isinstance(entries, list) or not entries:
        raise RefusedIndexError("it has no classes")
    below: dict[str, set[str]] = {}  # class -> its folders, relative to it
    for folder in folders:
        name, _, inside = folder.partition(os.sep)
        below.setdefault(name, set()).add(inside)
    classes: list[str] = []
    files: list[list[str]] = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise RefusedIndexError("a class is not [name, files]")
        name, images = entry
        if not (is_relative(name) and os.sep not in name and name in folders):
            raise RefusedIndexError(f"class {name!r} is no folder of the split")
        if classes and name <= classes[-1]:
            raise RefusedIndexError("its classes are not sorted")
        if not (isinstance(images, list) and images):
            raise RefusedIndexError(f"class {name!r} has no images")
        if not _are_listed_images(images, below[name]):
            raise RefusedIndexError(f"class {name!r}: an image path is refused")
        classes.append(name)
        files.append(images)
    return classes, files


# Relative paths of image files: parts without a NUL or "/", no part "." or
# ".." or empty, the last part ending in an image extension (in any ASCII
# case, as torchvision's has_file_allowed_extension compares them).
_COMPONENT = r"(?!\.\.?/)[^/\0]+/"
_EXTENSION = "(?i:" + "|".join(re.escape(e) for e in IMG_EXTENSIONS) + ")"
_IMAGE = rf"(?:{_COMPONENT})*[^/\0]*{_EXTENSION}"
_IMAGES = re.compile(rf"{_IMAGE}(?:\0{_IMAGE})*", re.ASCII)


def _are_listed_images(images: list, folders: set[str]) -> bool:
    """True when every one of ``images`` is a relative image file path in
    one of ``folders`` (of its class, "" the class folder itself): one match
    over all of them, not a check of each."""
    try:
        text = "\0".join(images)  # a NUL inside a path would add a part
    except TypeError:
        return False
    if text.count("\0") != len(images) - 1 or not _IMAGES.fullmatch(text):
        return False
    return {image.rpartition("/")[0] for image in images} <= folders


def stale_reason(index: FolderIndex, path: str) -> str | None:
    """Why ``index`` no longer lists split ``path`` (None: it does): another
    split, or a folder changed, gone, replaced or too recent to tell."""
    if index.root != os.path.abspath(path):
        return f"it indexes {index.root}"
    for name, stamp in index.folders.items():
        folder = os.path.join(path, name) if name else path
        try:
            now = folder_stamp(folder)
        except OSError as error:
            return f"folder {folder}: {error.strerror}"
        if now != stamp:
            return f"folder {folder} changed"
        if stamp[0] >= index.scanned_ns - RACY_NS:
            return f"folder {folder} changed just before the index was made"
    return None


def index_file(folder: str, path: str) -> str:
    """The index file of split ``path`` in ``folder`` (one per split)."""
    name = os.path.abspath(path).encode("utf-8", "surrogateescape")
    return os.path.join(folder, f"index-{hashlib.sha256(name).hexdigest()[:24]}.json")


def read_index(file: str, path: str) -> FolderIndex | None:
    """The index of split ``path`` in ``file`` when it is current; None when
    there is none, or it is refused or stale (said in the log)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:  # non-blocking: a FIFO put there is opened without a writer
        fd = os.open(file, flags)
    except FileNotFoundError:
        return None
    except OSError as error:
        why = "a link" if error.errno == errno.ELOOP else error.strerror
        logger.warning("data index %s refused (%s); listing %s", file, why, path)
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_INDEX_BYTES:
            raise RefusedIndexError(f"not a file of at most {MAX_INDEX_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            index = decode_index(f.read(MAX_INDEX_BYTES + 1))
    except (OSError, RefusedIndexError) as error:
        reason = error.strerror if isinstance(error, OSError) else error
        logger.warning("data index %s refused (%s); listing %s", file, reason, path)
        return None
    finally:
        os.close(fd)
    reason = stale_reason(index, path)
    if reason is not None:
        logger.info("data index %s is stale (%s); listing %s", file, reason, path)
        return None
    return index


def write_index(file: str, index: FolderIndex, data: bytes) -> None:
    """Write ``data``, the encoding of ``index``, to ``file`` atomically; a
    failure is a warning (the run has its index), as is an index too large
    to be read back; one made while its folders change is not written."""
    if UNLISTED in index.folders.values():
        logger.warning("data index %s not written: a folder could not be listed", file)
        return
    if any(t >= index.scanned_ns - RACY_NS for t, _ in index.folders.values()):
        logger.info("data index %s not written: its folders changed just now", file)
        return
    if len(data) > MAX_INDEX_BYTES:
        logger.warning("data index %s not written: over %d bytes", file, len(data))
        return
    try:
        atomic_write(file, lambda f: f.write(data))
    except (OSError, OutputPathError, DiskFullError) as error:
        reason = error.strerror if isinstance(error, OSError) else error
        logger.warning("data index %s not written (%s)", file, reason)


def _rank_zero_index(path: str, key: str, cache: str) -> tuple[FolderIndex, bool]:
    """Rank 0's index of split ``path``: read from folder ``cache`` (if any)
    when current, else listed; and whether it was listed."""
    tic = time.perf_counter()
    file = index_file(cache, path) if cache else ""
    index = read_index(file, path) if file else None
    if index is not None:
        logger.info(
            "read the data index %s of %s (%d folders checked) in %.2f s",
            file,
            path,
            len(index.folders),
            time.perf_counter() - tic,
        )
        return index, False
    index = scan_split(path, key)
    images = sum(len(files) for files in index.files)
    logger.info(
        "listed %s: %d images of %d classes in %d folders, in %.2f s",
        path,
        images,
        len(index.classes),
        len(index.folders),
        time.perf_counter() - tic,
    )
    return index, True


def _send_index(path: str, key: str, cache: str, write: bool) -> FolderIndex:
    """Rank 0's part of :func:`shared_listing`: its index (or its error)
    sent to the other ranks, then written to ``cache`` if it was listed."""
    try:
        index, listed = _rank_zero_index(path, key, cache)
    except Exception as error:
        told = str(error) if isinstance(error, DataError) else f"rank 0: {error!r}"
        du.broadcast_bytes(_ERROR + told.encode("utf-8", "surrogateescape"))
        raise
    store = listed and write and bool(cache)
    data = encode_index(index) if store or du.is_distributed() else b""
    du.broadcast_bytes(_INDEX + data)
    if store:
        write_index(index_file(cache, path), index, data)
    return index


def shared_listing(
    path: str, key: str, cache: str = "", write: bool = True
) -> tuple[list[str], list[list[str]]]:
    """The classes of split ``path`` and each one's image paths, listed once
    for all ranks: rank 0 reads its index file in folder ``cache`` ("" none)
    if current, else lists the split and writes one (when ``write``); the
    other ranks receive the index through the process group and list nothing.

    Every rank must call it.  A DataError of rank 0's listing (naming
    ``key``) is raised on every rank; the others wait for rank 0 as for any
    collective (DIST.INIT_TIMEOUT) and stop at once if it dies.
    """
    if du.get_rank() == 0:
        return _send_index(path, key, cache, write).listing(path)
    payload = du.broadcast_bytes(None)
    if payload[:1] == _ERROR:
        raise DataError(payload[1:].decode("utf-8", "surrogateescape"))
    try:
        return decode_index(payload[1:]).listing(path)
    except RefusedIndexError as error:  # rank 0 sent it: a bug, not the input
        raise DataError(f"{key} {path}: rank 0's index: {error}") from error


def split_classes(cache: str, path: str, key: str) -> list[str]:
    """The classes of split ``path``, checked as
    :func:`~distribuuuu.data.datasets.find_image_classes` checks them: from
    the split's index in folder ``cache`` while it is current (the listing
    that made it checked them; only its folders are stat-ed), else listed."""
    index = read_index(index_file(cache, path), path) if cache else None
    return find_image_classes(path, key) if index is None else index.classes
