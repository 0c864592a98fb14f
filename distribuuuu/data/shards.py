"""WebDataset shards (``DATA.NAME webdataset``): tar files of encoded images.

Layout, as ``tools/make_shards.py`` writes it: shard files ``<split>-000000.tar``
... in one folder, each sample two members ``<key>.<ext>`` (the encoded image,
``jpg``, ``png``, ...) and ``<key>.cls`` (its label as decimal text); beside
them ``classes.txt`` (the class names, one a line, in label order) and
``index.json`` (``{"shards": {"<file name>": {"samples": n, "bytes": b}}}``).
The index gives every rank the sample counts without opening a shard.

The streams that read them are in :mod:`distribuuuu.data.shard_streams`.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from distribuuuu.errors import DataError, UnreadableImageError

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
CLASSES_FILE = "classes.txt"
# Member suffixes read as the image of a sample (torchvision's image extensions).
IMAGE_SUFFIXES = tuple(ext.lstrip(".") for ext in IMG_EXTENSIONS)
# The most bytes of one sample read (its members are held in memory), and the
# largest index or class list read.
MAX_SAMPLE_BYTES = 256 << 20
MAX_LIST_BYTES = 64 << 20
# The most digits of a label (``.cls``), leading zeros included, and of a
# sample key read as a number.
MAX_LABEL_DIGITS = 20
MAX_KEY_DIGITS = 18

# Installed with the webdataset extra, which DATA.NAME webdataset needs.
NEEDS_WEBDATASET = (
    "DATA.NAME webdataset and make_shards need the webdataset package: "
    "pip install -e '.[webdataset]'"
)

# (shard path, sample key, {suffix: bytes}) as a shard holds it.
RawSample = tuple[str, str, dict[str, bytes]]


def sample_number(key: str) -> int:
    """The number of a sample by its key: the key itself when it is a number
    (make_shards writes the sample's index in its source, so that a sample
    is augmented as ``DATA.NAME imagefolder`` augments that file), else a
    hash of it."""
    # A short ASCII number only: int() refuses thousands of digits and "²",
    # which isdigit() accepts, and a seed is below 2**64.
    if key.isascii() and key.isdigit() and len(key) <= MAX_KEY_DIGITS:
        return int(key)
    # A name that is not UTF-8 is read with surrogates standing for its bytes.
    return zlib.crc32(key.encode("utf-8", "surrogateescape")) + 2**40


@dataclass(frozen=True)
class ShardSet:
    """The shards one pattern names, with their sample counts and classes."""

    key: str  # the config key naming them, for messages
    paths: tuple[str, ...]
    counts: tuple[int, ...]
    classes: tuple[str, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)

    def starts(self) -> list[int]:
        """The global position of each shard's first sample."""
        return [0, *itertools.accumulate(self.counts)][:-1]


def expand_pattern(pattern: str, key: str) -> list[str]:
    """The shard paths of a brace pattern (``train-{000000..000099}.tar``).

    Local files only: ``pipe:`` names and URLs are refused (webdataset opens
    them through a shell or a downloader).
    """
    if pattern.startswith("pipe:") or "://" in pattern:
        raise DataError(
            f"{key} {pattern}: only local shard files are read (no pipe: or URLs); "
            "copy the shards to a file system every node mounts"
        )
    try:  # a dependency of webdataset
        from braceexpand import braceexpand
    except ImportError as error:
        raise DataError(NEEDS_WEBDATASET) from error
    paths = list(braceexpand(pattern))
    repeated = sorted(path for path, n in collections.Counter(paths).items() if n > 1)
    if repeated:
        raise DataError(f"{key} {pattern}: names shard {repeated[0]} more than once")
    return paths


def _read_small(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_LIST_BYTES + 1)
    if len(data) > MAX_LIST_BYTES:
        raise DataError(f"{path}: larger than {MAX_LIST_BYTES} bytes")
    return data


def read_index(folder: str, key: str) -> tuple[dict[str, dict], tuple[str, ...]]:
    """The index (file name -> {"samples", "bytes"}) and classes of a shard folder."""
    index_path = os.path.join(folder, INDEX_FILE)
    classes_path = os.path.join(folder, CLASSES_FILE)
    for path, what in ((index_path, "index"), (classes_path, "class list")):
        if not os.path.isfile(path):
            raise DataError(
                f"{key}: no {what} {path} beside the shards; write shards with "
                "distribuuuu-shards (tools/make_shards.py), which writes "
                f"{INDEX_FILE} and {CLASSES_FILE}"
            )
    try:
        shards = _index_entries(json.loads(_read_small(index_path)))
    except RecursionError as error:  # json nests by recursion
        raise DataError(
            f"{key}: unreadable index {index_path}: nested too deeply"
        ) from error
    except (ValueError, TypeError) as error:  # JSONDecodeError included
        raise DataError(f"{key}: unreadable index {index_path}: {error}") from error
    return shards, _read_classes(classes_path, key)


def _index_entries(index: object) -> dict[str, dict[str, int]]:
    """The shard entries of a parsed index; a TypeError when it is not
    ``{"shards": {name: {"samples": n, "bytes": b}}}``."""
    if not isinstance(index, dict) or not isinstance(index.get("shards"), dict):
        raise TypeError('not {"shards": {...}}')
    for name, entry in index["shards"].items():
        if not isinstance(entry, dict):
            raise TypeError(f"{name}: not a mapping")
        for field in ("samples", "bytes"):
            count = entry.get(field)
            # bool is an int to Python, never a count here
            if type(count) is not int or count < 0:
                raise TypeError(f"{name}: {field} is not a count")
    return index["shards"]


def _read_classes(path: str, key: str) -> tuple[str, ...]:
    """The class names of ``classes.txt``, one a line; each named once."""
    try:
        classes = _read_small(path).decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DataError(f"{key}: {path} is not UTF-8 text: {error}") from error
    if not classes or not all(classes):
        raise DataError(f"{key}: {path} lists no classes or an empty name")
    counts = collections.Counter(classes)
    repeated = next((name for name in classes if counts[name] > 1), None)
    if repeated is not None:
        # Labels index this list: a name twice makes two labels one class.
        raise DataError(
            f"{key}: {path} lists class {repeated!r} {counts[repeated]} times; "
            "each class is named once"
        )
    return tuple(classes)


def _check_tar_header(path: str, key: str) -> None:
    """Refuse a file whose first block is not a tar header."""
    with open(path, "rb") as f:
        block = f.read(tarfile.BLOCKSIZE)
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as error:
        raise DataError(
            f"{key}: shard {path} is not an uncompressed tar file ({error})"
        ) from error


def open_shards(pattern: str, key: str) -> ShardSet:
    """The shards of ``pattern``, checked against their index; raise DataError.

    Every shard must exist, be listed in the ``index.json`` beside it with
    its size in bytes (a truncated or rewritten shard is refused) and start
    with a tar header; the folders must list the same classes.  Cheap: one
    small read per shard.
    """
    paths = expand_pattern(pattern, key)
    missing = [path for path in paths if not os.path.isfile(path)]
    if len(missing) == len(paths):
        raise DataError(f"{key} {pattern}: matches no shard file ({paths[0]} ...)")
    if missing:
        raise DataError(
            f"{key} {pattern}: {len(missing)} of {len(paths)} shards are missing, "
            f"the first {missing[0]}"
        )
    indexes: dict[str, tuple[dict, tuple[str, ...]]] = {}
    counts = []
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in indexes:
            indexes[folder] = read_index(folder, key)
        entry = indexes[folder][0].get(os.path.basename(path))
        if entry is None:
            raise DataError(
                f"{key}: shard {path} is not listed in "
                f"{os.path.join(folder, INDEX_FILE)}"
            )
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise DataError(
                f"{key}: shard {path} has {size} bytes, its index says "
                f"{entry['bytes']}: truncated or rewritten; write it again"
            )
        _check_tar_header(path, key)
        counts.append(entry["samples"])
    class_lists = {classes for _, classes in indexes.values()}
    if len(class_lists) > 1:
        raise DataError(f"{key} {pattern}: its folders list different classes")
    return ShardSet(key, tuple(paths), tuple(counts), class_lists.pop())


def read_shard(
    path: str, key: str, skip: int = 0, labels_only: bool = False
) -> Iterator[RawSample]:
    """The samples of the shard at ``path`` in order, from the ``skip``-th:
    members grouped by key (the name before the first dot of the file name,
    webdataset's convention).  Only the images and labels are read, at most
    MAX_SAMPLE_BYTES a sample; nothing of skipped samples; with
    ``labels_only`` the images are passed over (their headers read, their
    bytes not: each stands as ``b""``).  Links and folders in the tar are
    ignored, never followed.
    """
    try:  # webdataset's rule: the key is the name up to the first dot
        from webdataset.tariterators import base_plus_ext
    except ImportError as error:
        raise DataError(NEEDS_WEBDATASET) from error
    members: dict[str, bytes] = {}
    position, current = -1, None
    try:
        with tarfile.open(path, "r:") as tar:
            while (info := tar.next()) is not None:
                # tarfile keeps every header otherwise (typeshed omits members).
                tar.members = []  # type: ignore[attr-defined]
                prefix, suffix = base_plus_ext(info.name)
                if not info.isreg() or prefix is None:
                    continue
                if prefix != current:
                    if current is not None and position >= skip:
                        yield path, current, members
                    position, current, members = position + 1, prefix, {}
                suffix = suffix.lower()
                if position < skip or not _wanted_member(suffix):
                    continue
                if labels_only and suffix != "cls":
                    members[suffix] = b""
                    continue
                if sum(map(len, members.values())) + info.size > MAX_SAMPLE_BYTES:
                    raise DataError(
                        f"{key}: shard {path}: sample {prefix} has more than the "
                        f"{MAX_SAMPLE_BYTES} bytes read for one sample"
                    )
                member = tar.extractfile(info)
                assert member is not None  # a regular file's
                members[suffix] = member.read()
    except (tarfile.TarError, OSError) as error:
        raise DataError(f"{key}: shard {path} is damaged: {error}") from error
    if current is not None and position >= skip:
        yield path, current, members


def read_whole(
    shards: ShardSet, shard: int, labels_only: bool = False
) -> Iterator[RawSample]:
    """Every sample of shard number ``shard``, as many as the index lists
    (``labels_only``: see :func:`read_shard`)."""
    path, count = shards.paths[shard], shards.counts[shard]
    samples = read_shard(path, shards.key, labels_only=labels_only)
    return _counted(samples, count, path, shards.key, count)


def _wanted_member(suffix: str) -> bool:
    return suffix == "cls" or suffix in IMAGE_SUFFIXES


def read_range(shards: ShardSet, begin: int, end: int) -> Iterator[RawSample]:
    """Samples ``begin`` to ``end`` (excluded) of the shards in pattern order."""
    for path, start, count in zip(shards.paths, shards.starts(), shards.counts):
        low, high = max(begin, start), min(end, start + count)
        if low < high:
            samples = read_shard(path, shards.key, low - start)
            yield from _counted(samples, high - low, path, shards.key, count)


def _counted(samples: Iterator, wanted: int, path: str, key: str, listed: int):
    """The first ``wanted`` of ``samples``; a DataError if the shard ends sooner."""
    got = 0
    for sample in itertools.islice(samples, wanted):
        got += 1
        yield sample
    if got < wanted:
        raise DataError(
            f"{key}: shard {path} ends early: its index lists {listed} samples"
        )


def parse_label(text: bytes, classes: int, where: str) -> int:
    """The class number a ``.cls`` member holds: short ASCII decimal text
    (blanks around it allowed) below ``classes``; a DataError names ``where``."""
    label = text.strip()
    # Checked before int(), which is slow on, or refuses, thousands of digits.
    if not 0 < len(label) <= MAX_LABEL_DIGITS or not label.isdigit():
        shown = label[:MAX_LABEL_DIGITS].decode("ascii", "replace")
        raise DataError(
            f"{where}: its .cls label {shown!r} ({len(label)} bytes) is not a "
            f"class number (at most {MAX_LABEL_DIGITS} decimal digits)"
        )
    if int(label) >= classes:
        raise DataError(
            f"{where}: label {int(label)}, but {CLASSES_FILE} lists {classes} classes"
        )
    return int(label)


class ShardDecoder:
    """A raw sample to ``(image, label)``: the image decoded (DATA.DECODER) and
    transformed; with ``skip_corrupt`` an unreadable image is reported once
    per process and another readable sample stands in for it."""

    def __init__(
        self, shards: ShardSet, transform: Callable, read: Callable, skip_corrupt: bool
    ):
        self.shards, self.transform, self.read = shards, transform, read
        self.skip_corrupt = skip_corrupt
        self._reported: set[str] = set()

    def label(self, raw: RawSample) -> tuple[int, str]:
        """The label of a raw sample and the suffix of its image member (a
        DataError unless it has one image and a valid ``.cls``)."""
        path, name, members = raw
        images = [suffix for suffix in members if suffix in IMAGE_SUFFIXES]
        where = f"{self.shards.key}: shard {path}: sample {name}"
        if len(images) != 1 or "cls" not in members:
            has = ", ".join(sorted(members)) or "no members"
            raise DataError(f"{where} needs one image and a .cls label; it has {has}")
        return parse_label(members["cls"], len(self.shards.classes), where), images[0]

    def __call__(self, raw: RawSample) -> tuple[torch.Tensor, int]:
        path, name, members = raw
        label, suffix = self.label(raw)
        try:  # a JPEG may be decoded in the transform (DATA.DECODER fused)
            image = self.transform(
                self.read(members[suffix], f"{path}:{name}.{suffix}")
            )
        except DataError as error:
            raise UnreadableImageError(str(error)) from error
        return image, label

    def readable(
        self, raws: Iterator[RawSample], seed: Callable | None = None
    ) -> Iterator[tuple[torch.Tensor, int]]:
        """``(image, label)`` of each raw sample, the transform's randomness
        seeded with ``seed(sample number)`` if given.  A stand-in for an
        unreadable image (``skip_corrupt``): the previous readable sample, or
        before the first, the first readable one."""
        previous, owed = None, 0
        for raw in raws:
            if seed is not None:
                torch.default_generator.manual_seed(seed(sample_number(raw[1])))
            try:
                sample = self(raw)
            except UnreadableImageError as error:
                if not self.skip_corrupt:
                    raise
                self._report(raw, error)
                if previous is None:
                    owed += 1
                    continue
                sample = self(previous)
            else:
                previous = raw
                for _ in range(owed):
                    yield self(raw)
                owed = 0
            yield sample
        if owed:
            raise DataError(f"{self.shards.key}: no readable image in {owed} samples")

    def _report(self, raw: RawSample, error: DataError) -> None:
        if raw[1] not in self._reported:
            self._reported.add(raw[1])
            logger.warning("%s; another image stands in (DATA.SKIP_CORRUPT)", error)


class ShardedImages(Dataset):
    """The samples of a :class:`ShardSet`: its length, classes, and single
    samples read by position (a scan of one shard's headers: for a few
    look-ups, not for training, which reads :class:`TrainStream`)."""

    def __init__(self, shards: ShardSet, decoder: ShardDecoder):
        self.shards, self.decoder = shards, decoder
        self.classes = list(shards.classes)

    def __len__(self) -> int:
        return self.shards.total

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return next(self.decoder.readable(read_range(self.shards, index, len(self))))


def shortage_message(shards: ShardSet, world_size: int, workers: int) -> str:
    """Why ``shards`` cannot feed ``world_size`` processes of ``workers``."""
    readers = world_size * max(1, workers)
    return (
        f"{shards.key}: {len(shards.paths)} shards for {world_size} processes x "
        f"{max(1, workers)} loader workers = {readers} readers, each of which "
        "reads whole shards of its own; write at least that many shards "
        "(distribuuuu-shards --samples N) or lower TRAIN.WORKERS"
    )
