"""Writing WebDataset shards (``tools/make_shards.py``) in the layout that
:mod:`distribuuuu.data.shards` reads.

The output depends on the input only: samples in an order shuffled from a
fixed seed (shards mix the classes), tar headers with fixed times and owners,
re-encoding by Pillow with fixed settings.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import stat
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from PIL import Image

from distribuuuu.data.datasets import find_image_classes, find_image_files, load_mnist5k
from distribuuuu.data.image_files import decode_image_bytes, open_regular_file
from distribuuuu.data.shards import (
    CLASSES_FILE,
    IMAGE_SUFFIXES,
    INDEX_FILE,
    NEEDS_WEBDATASET,
)
from distribuuuu.errors import DataError

# A source sample: a name (for messages), its label and what reads its bytes.
SourceSample = tuple[str, int, Callable[[], tuple[bytes, str]]]

# Unicode categories refused in class names: controls (newline, tab, ...),
# line and paragraph separators (str.splitlines breaks at all of them), and
# the surrogates that stand for bytes of a file name that are not UTF-8.
_UNWRITABLE = frozenset(("Cc", "Cs", "Zl", "Zp"))
# The first bytes of the image formats of torchvision's image file names (and
# GIF, which PIL decodes under any name); WebP is checked apart (RIFF....WEBP).
# A file damaged past them is copied: DATA.SKIP_CORRUPT decides, as in a folder.
_SIGNATURES = {
    "JPEG": (b"\xff\xd8\xff",),
    "PNG": (b"\x89PNG",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "BMP": (b"BM",),
    "TIFF": (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"),
    "PPM": (b"P1", b"P2", b"P3", b"P4", b"P5", b"P6"),
}


@dataclass(frozen=True)
class ShardLimits:
    """When a shard is full, and how images are re-encoded."""

    samples: int = 1000  # samples a shard (0: no limit)
    bytes: int = 0  # bytes of samples a shard, tar headers included (0: no limit)
    max_side: int = 0  # re-encode images whose shorter side is longer (0: never)
    quality: int = 90  # JPEG quality of re-encoded images


def folder_source(root: str) -> tuple[list[str], list[SourceSample]]:
    """The classes and samples of an ImageFolder split ``root/<class>/<image>``
    (the labels and order of ``DATA.NAME imagefolder``).

    A DataError refuses a class name that ``classes.txt`` cannot hold, and an
    image file that is not a regular file or lies outside ``root`` and its
    class folder (a link out of them: a class folder may itself be a link).
    """
    classes = find_image_classes(root, root)
    check_class_names(classes, root)
    samples: list[SourceSample] = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        inside = {os.path.realpath(root), os.path.realpath(folder)}
        real_folders: dict[str, str] = {}
        for path in find_image_files(folder, root):
            _check_source_file(path, inside, real_folders, root)
            samples.append((path, label, _file_reader(path)))
    return classes, samples


def check_class_names(classes: list[str], where: str) -> None:
    """Refuse a class name that cannot be one line of UTF-8 in ``classes.txt``."""
    for name in classes:
        bad = next((c for c in name if unicodedata.category(c) in _UNWRITABLE), None)
        if bad is not None:
            raise DataError(
                f"{where}: class folder {name!r} holds the character {bad!r}; "
                f"{CLASSES_FILE} lists one class name a line, in UTF-8: rename "
                "the folder"
            )


def _check_source_file(
    path: str, inside: set[str], real_folders: dict[str, str], root: str
) -> None:
    """Refuse ``path`` unless it is a regular file within a folder of ``inside``
    (real paths); ``real_folders`` caches the real path of each folder."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        mode = os.stat(path).st_mode
    except OSError as error:
        raise DataError(f"{path}: cannot read it ({error.strerror})") from error
    folder, name = os.path.split(path)
    if is_link:
        real = os.path.realpath(path)
    else:  # where its folder really is: one realpath a folder, not a file
        if folder not in real_folders:
            real_folders[folder] = os.path.realpath(folder)
        real = os.path.join(real_folders[folder], name)
    if not any(os.path.commonpath([real, top]) == top for top in inside):
        raise DataError(
            f"{path}: leads through a link to {real}, outside {root} and its "
            "class folder; make_shards copies only the files of SOURCE (copy the "
            "file in, or link its whole class folder)"
        )
    if not stat.S_ISREG(mode):
        raise DataError(f"{path}: not a regular file (a FIFO, device or socket?)")


def _file_reader(path: str) -> Callable[[], tuple[bytes, str]]:
    def read() -> tuple[bytes, str]:
        # A FIFO put in the file's place never blocks the open.
        opened = open_regular_file(path)
        if opened is None:
            raise DataError(f"{path}: not a regular file (a FIFO, device?)")
        with opened as f:
            return f.read(), os.path.splitext(path)[1].lstrip(".").lower()

    return read


def image_format(data: bytes) -> str | None:
    """The format whose signature starts ``data`` (JPEG, PNG, ...); None if
    it is none of the formats the trainer decodes from an image file name."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next(
        (name for name, starts in _SIGNATURES.items() if data.startswith(starts)),
        None,
    )


def digits_source(train: bool) -> tuple[list[str], list[SourceSample]]:
    """The classes and samples of a split of the embedded digits, as PNGs."""
    images, labels = load_mnist5k(train)

    def png(image) -> Callable[[], tuple[bytes, str]]:
        def read() -> tuple[bytes, str]:
            buffer = io.BytesIO()
            Image.fromarray(image[0].numpy(), mode="L").save(buffer, format="PNG")
            return buffer.getvalue(), "png"

        return read

    samples = [
        (f"digit {i}", int(label), png(images[i])) for i, label in enumerate(labels)
    ]
    return [str(digit) for digit in range(10)], samples


def capped(data: bytes, suffix: str, name: str, limits: ShardLimits):
    """The image ``data`` with its shorter side at most ``limits.max_side``:
    unchanged when it is, else resized (Lanczos) and re-encoded as JPEG."""
    if not limits.max_side:
        return data, suffix
    try:
        width, height = Image.open(io.BytesIO(data)).size  # the header only
    except Exception:  # unreadable: kept as it is, DATA.SKIP_CORRUPT decides
        return data, suffix
    short = min(width, height)
    if short <= limits.max_side:
        return data, suffix
    image = decode_image_bytes(data, name, as_tensor=False)  # RGB, pixel limit
    scale = limits.max_side / short
    if width <= height:
        size = (limits.max_side, max(1, round(height * scale)))
    else:
        size = (max(1, round(width * scale)), limits.max_side)
    buffer = io.BytesIO()
    image.resize(size, Image.Resampling.LANCZOS).save(
        buffer, format="JPEG", quality=limits.quality
    )
    return buffer.getvalue(), "jpg"


def _tar_bytes(members: dict[str, bytes]) -> int:
    """Bytes the members take in a tar: a header and whole blocks each."""
    return sum(512 + -(-len(data) // 512) * 512 for data in members.values())


def _shard_groups(
    samples: list[tuple[int, str, int, Callable[[], tuple[bytes, str]]]],
    limits: ShardLimits,
) -> Iterator[list[tuple[str, dict[str, bytes]]]]:
    """Numbered samples as tar members, grouped into shards within ``limits``."""
    group: list[tuple[str, dict[str, bytes]]] = []
    size = 0
    for number, name, label, read in samples:
        data, suffix = read()
        if suffix not in IMAGE_SUFFIXES:
            raise DataError(f"{name}: .{suffix} is not an image file name")
        if image_format(data) is None:
            raise DataError(
                f"{name}: not an image: it starts with no JPEG, PNG, GIF, BMP, "
                "TIFF, PPM or WebP signature"
            )
        data, suffix = capped(data, suffix, name, limits)
        members = {suffix: data, "cls": str(label).encode()}
        more = _tar_bytes(members)
        full = limits.samples and len(group) >= limits.samples
        if group and (full or (limits.bytes and size + more > limits.bytes)):
            yield group
            group, size = [], 0
        group.append((f"{number:08d}", members))
        size += more
    if group:
        yield group


def write_split(
    samples: list[SourceSample], out: str, split: str, limits: ShardLimits, seed: int
) -> dict[str, dict[str, int]]:
    """Write the samples of one split as ``out/<split>-000000.tar`` ...;
    the index entries of the shards written."""
    try:
        from webdataset import TarWriter
    except ImportError as error:
        raise DataError(NEEDS_WEBDATASET) from error
    order = [(number, *sample) for number, sample in enumerate(samples)]
    random.Random(seed).shuffle(order)  # keys: the numbers in the source
    entries = {}
    for number, group in enumerate(_shard_groups(order, limits)):
        name = f"{split}-{number:06d}.tar"
        path = os.path.join(out, name)
        with open(path, "wb") as f:
            writer = TarWriter(f, user="", group="", mtime=0, encoder=False)
            for key, members in group:
                writer.write({"__key__": key, **members})
            writer.close()
        entries[name] = {"samples": len(group), "bytes": os.path.getsize(path)}
    return entries


def pattern_of(out: str, split: str, shards: int) -> str:
    """The brace pattern naming the ``shards`` shards of ``split`` in ``out``."""
    last = f"{shards - 1:06d}"
    names = f"{split}-{last}.tar" if shards == 1 else f"{split}-{{000000..{last}}}.tar"
    return os.path.join(out, names)


def write_index(out: str, classes: list[str], entries: dict) -> None:
    """Write ``classes.txt`` and, last, ``index.json`` (shard -> counts)."""
    with open(os.path.join(out, CLASSES_FILE), "w", encoding="utf-8") as f:
        f.write("".join(f"{name}\n" for name in classes))
    temporary = os.path.join(out, INDEX_FILE + ".tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"shards": entries}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(temporary, os.path.join(out, INDEX_FILE))


def remove_unfinished(out: str, splits: list[str], created: bool) -> None:
    """Remove what an unfinished run wrote to ``out`` (new or empty when it
    began): the shards of ``splits``, the class list and the index; ``out``
    itself when the run ``created`` it."""
    shard = re.compile(r"(.+)-[0-9]{6}\.tar")
    listed = {CLASSES_FILE, INDEX_FILE, INDEX_FILE + ".tmp"}
    with os.scandir(out) as entries:
        for entry in entries:
            match = shard.fullmatch(entry.name)
            ours = entry.name in listed or (match and match.group(1) in splits)
            if ours and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):  # the first error is reported
                    os.unlink(entry.path)
    if created:
        with contextlib.suppress(OSError):  # not empty: someone else's files
            os.rmdir(out)
