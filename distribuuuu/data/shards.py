"""WebDataset shards (``DATA.NAME webdataset``): tar files of encoded images.

Layout, as ``tools/make_shards.py`` writes it: shard files ``<split>-000000.tar``
... in one folder, each sample two members ``<key>.<ext>`` (the encoded image,
``jpg``, ``png``, ...) and ``<key>.cls`` (its label as decimal text); beside
them ``classes.txt`` (the class names, one a line, in label order) and
``index.json`` (``{"shards": {"<file name>": {"samples": n, "bytes": b}}}``).
The index gives every rank the sample counts without opening a shard.

Training (:class:`TrainStream`): each epoch the shards are dealt out in an
order drawn from the run's seed and the epoch, to ``processes x loader
workers`` readers, each shard to the reader furthest below its share of the
epoch; a reader reads its shards in turn, shuffles within a buffer, and takes
exactly the samples of its share of the epoch's steps: an epoch has
floor(samples / (processes x batch)) steps on every process; a reader with
more samples drops the rest of its stream, one with fewer reads its shards
again (in another order): only what whole shards cannot even out.
Evaluation (:class:`EvalStream`) reads every sample once: process r takes
the contiguous samples [N r / W, N (r+1) / W) of the shards in pattern
order, passing over (unread) what comes before its range in its first shard.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import logging
import os
import random
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from braceexpand import braceexpand
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torchvision.datasets.folder import IMG_EXTENSIONS
from webdataset.tariterators import base_plus_ext

from distribuuuu.data.datasets import DataError
from distribuuuu.data.samplers import sample_seed

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
CLASSES_FILE = "classes.txt"
# Member suffixes read as the image of a sample (torchvision's image extensions).
IMAGE_SUFFIXES = tuple(ext.lstrip(".") for ext in IMG_EXTENSIONS)
# The most bytes of one sample read (its members are held in memory), and the
# largest index or class list read.
MAX_MEMBER_BYTES = 256 << 20
MAX_LIST_BYTES = 64 << 20

# (shard path, sample key, {suffix: bytes}) as a shard holds it.
RawSample = tuple[str, str, dict[str, bytes]]


def sample_number(key: str) -> int:
    """The number of a sample by its key: the key itself when it is a number
    (make_shards writes the sample's index in its source, so that a sample
    is augmented as ``DATA.NAME imagefolder`` augments that file), else a
    hash of it."""
    return int(key) if key.isdigit() else zlib.crc32(key.encode()) + 2**40


class UnreadableImageError(DataError):
    """The image of a sample cannot be decoded (DATA.SKIP_CORRUPT may skip it)."""


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
        shards = json.loads(_read_small(index_path))["shards"]
        if not isinstance(shards, dict):
            raise TypeError("'shards' is not a mapping")
        for name, entry in shards.items():
            for field in ("samples", "bytes"):
                if not isinstance(entry[field], int) or entry[field] < 0:
                    raise TypeError(f"{name}: {field} is not a count")
        classes = _read_small(classes_path).decode("utf-8").splitlines()
    except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError included
        raise DataError(f"{key}: unreadable index {index_path}: {error}") from error
    if not classes or not all(classes):
        raise DataError(f"{key}: {classes_path} lists no classes or an empty name")
    return shards, tuple(classes)


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


def read_shard(path: str, key: str, skip: int = 0) -> Iterator[RawSample]:
    """The samples of the shard at ``path`` in order, from the ``skip``-th:
    members grouped by key (the name before the first dot of the file name,
    webdataset's convention).  Only the images and labels are read, at most
    MAX_MEMBER_BYTES a sample; nothing of skipped samples.  Links and
    folders in the tar are ignored, never followed.
    """
    position, current, members = -1, None, {}
    try:
        with tarfile.open(path, "r:") as tar:
            while (info := tar.next()) is not None:
                tar.members = []  # tarfile keeps every header otherwise
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
                if sum(map(len, members.values())) + info.size > MAX_MEMBER_BYTES:
                    raise DataError(
                        f"{key}: shard {path}: sample {prefix} has more than the "
                        f"{MAX_MEMBER_BYTES} bytes read for one sample"
                    )
                members[suffix] = tar.extractfile(info).read()
    except (tarfile.TarError, OSError) as error:
        raise DataError(f"{key}: shard {path} is damaged: {error}") from error
    if current is not None and position >= skip:
        yield path, current, members


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


class ShardDecoder:
    """A raw sample to ``(image, label)``: the image decoded (DATA.DECODER) and
    transformed; with ``skip_corrupt`` an unreadable image is reported once
    per process and another readable sample stands in for it."""

    def __init__(self, shards: ShardSet, transform: Callable, read: Callable,
                 skip_corrupt: bool):  # fmt: skip
        self.shards, self.transform, self.read = shards, transform, read
        self.skip_corrupt = skip_corrupt
        self._reported: set[str] = set()

    def __call__(self, raw: RawSample) -> tuple[torch.Tensor, int]:
        path, name, members = raw
        images = [suffix for suffix in members if suffix in IMAGE_SUFFIXES]
        label = members.get("cls", b"").strip()
        where = f"{self.shards.key}: shard {path}: sample {name}"
        if len(images) != 1 or not label.isdigit():
            has = ", ".join(sorted(members)) or "no members"
            raise DataError(f"{where} needs one image and a .cls label; it has {has}")
        if int(label) >= len(self.shards.classes):
            raise DataError(
                f"{where}: label {int(label)}, but {CLASSES_FILE} lists "
                f"{len(self.shards.classes)} classes"
            )
        try:
            image = self.read(members[images[0]], f"{path}:{name}.{images[0]}")
        except DataError as error:
            raise UnreadableImageError(str(error)) from error
        return self.transform(image), int(label)

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


def _collate(samples: list[tuple[torch.Tensor, int]]):
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def _batched(samples: Iterator, size: int) -> Iterator:
    while batch := list(itertools.islice(samples, size)):
        yield _collate(batch)


def _reader(workers: int) -> int:
    """This loader worker's number, checking the count the plan assumed."""
    info = get_worker_info()
    count, worker = (1, 0) if info is None else (info.num_workers, info.id)
    if count != max(1, workers):
        raise RuntimeError(f"planned for {workers} loader workers, got {count}")
    return worker


def shuffled(items: Iterator, size: int, rng: random.Random) -> Iterator:
    """``items`` in an order shuffled within a buffer of ``size``; all of them."""
    buffer = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        slot = rng.randrange(size)
        yield buffer[slot]
        buffer[slot] = item
    rng.shuffle(buffer)
    yield from buffer


def deal_shards(
    counts: tuple[int, ...], wanted: list[int], seed: int
) -> list[list[int]]:
    """The shards of each reader: in a random order from ``seed``, each to
    the reader furthest below the samples it wants (the lowest on ties)."""
    order = torch.randperm(len(counts), generator=torch.Generator().manual_seed(seed))
    short = [(-want, reader) for reader, want in enumerate(wanted)]
    heapq.heapify(short)
    dealt: list[list[int]] = [[] for _ in wanted]
    for shard in order.tolist():
        below, reader = heapq.heappop(short)
        dealt[reader].append(shard)
        heapq.heappush(short, (below + counts[shard], reader))
    return dealt


class TrainStream(IterableDataset):
    """The training batches of one process, read from shards (module doc).

    ``set_epoch(epoch, start)`` as the samplers: ``start`` global samples
    of the epoch are done, so each reader passes over (reads, does not
    decode) the samples of the steps done before taking the next.  The
    same world size, TRAIN.WORKERS and batch give the very batches an
    uninterrupted run takes; others skip as many steps of the new layout's
    streams.  Augmentation is seeded by (seed, epoch, sample number), as
    the samplers seed it by (seed, epoch, index): shards that make_shards
    wrote from a folder draw the crops ``DATA.NAME imagefolder`` draws.
    """

    def __init__(self, images: ShardedImages, rank: int, world_size: int,
                 seed: int, batch_size: int, workers: int, buffer: int):  # fmt: skip
        self.images, self.rank, self.world_size = images, rank, world_size
        self.seed, self.batch_size, self.buffer = seed, batch_size, buffer
        self.workers = max(1, workers)
        self.epoch, self.start = 0, 0
        self.steps = images.shards.total // (batch_size * world_size)
        shards = len(images.shards.paths)
        readers = world_size * self.workers
        if shards < readers:
            raise DataError(shortage_message(images.shards, world_size, workers))
        if self.steps == 0:
            raise DataError(
                f"{images.shards.key}: {images.shards.total} training samples, fewer "
                f"than a batch of {batch_size} on each of {world_size} processes"
            )
        self._logged: set[tuple[int, int]] = set()

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        if (epoch, start) not in self._logged:  # precise BN sets it again
            self._logged.add((epoch, start))
            self._log_plan()

    def _done(self) -> int:
        """Batches of this process before ``start``."""
        return self.start // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        """Samples this process takes in the rest of the epoch."""
        return (self.steps - self._done()) * self.batch_size

    def _wanted(self, worker: int, batches: int) -> int:
        """Samples reader ``worker`` of this process serves in ``batches`` batches."""
        return len(range(worker, batches, self.workers)) * self.batch_size

    def _dealt(self) -> list[list[int]]:
        """The shards of every reader (rank r's worker w is r x workers + w)."""
        readers = range(self.world_size * self.workers)
        wanted = [self._wanted(reader % self.workers, self.steps) for reader in readers]
        return deal_shards(self.images.shards.counts, wanted, self.seed + self.epoch)

    def _log_plan(self) -> None:
        counts, dropped, repeated = self.images.shards.counts, 0, 0
        for reader, shards in enumerate(self._dealt()):
            has = sum(counts[shard] for shard in shards)
            wanted = self._wanted(reader % self.workers, self.steps)
            dropped += max(0, has - wanted)
            repeated += max(0, wanted - has)
        where = f"after {self._done()} batches" if self.start else "from the start"
        logger.info(
            "webdataset epoch %d: %d steps of %d samples on each of %d processes "
            "from %d shards, %d readers (processes x loader workers); %d samples "
            "dropped (the ends of readers' shuffled streams), %d read again "
            "(readers short of samples); %s",
            self.epoch, self.steps, self.batch_size, self.world_size,
            len(counts), self.world_size * self.workers, dropped, repeated,
            where,
        )  # fmt: skip

    def _stream(self, shards: list[int], rng: random.Random) -> Iterator[RawSample]:
        """A reader's samples: its shards, then again in new orders, each
        pass shuffled within the buffer."""
        images = self.images.shards
        for repeat in itertools.count():
            order = shards if repeat == 0 else rng.sample(shards, len(shards))
            raws = itertools.chain.from_iterable(
                _counted(read_shard(images.paths[shard], images.key),
                         images.counts[shard], images.paths[shard], images.key,
                         images.counts[shard])
                for shard in order
            )  # fmt: skip
            yield from shuffled(raws, self.buffer, rng)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = _reader(self.workers)
        reader = self.rank * self.workers + worker
        rng = random.Random(sample_seed(self.seed, self.epoch, reader))
        wanted = self._wanted(worker, self.steps)
        skip = self._wanted(worker, self._done())
        stream = itertools.islice(self._stream(self._dealt()[reader], rng), wanted)
        taken = itertools.islice(stream, skip, None)

        def seed(number: int) -> int:
            return sample_seed(self.seed, self.epoch, number)

        yield from _batched(self.images.decoder.readable(taken, seed), self.batch_size)


def shortage_message(shards: ShardSet, world_size: int, workers: int) -> str:
    """Why ``shards`` cannot feed ``world_size`` processes of ``workers``."""
    readers = world_size * max(1, workers)
    return (
        f"{shards.key}: {len(shards.paths)} shards for {world_size} processes x "
        f"{max(1, workers)} loader workers = {readers} readers, each of which "
        "reads whole shards of its own; write at least that many shards "
        "(distribuuuu-shards --samples N) or lower TRAIN.WORKERS"
    )


class EvalStream(IterableDataset):
    """The evaluation batches of one process: samples [N r / W, N (r+1) / W)
    of the shards, split among the loader workers by whole batches; every
    sample of the set once over all processes."""

    def __init__(self, images: ShardedImages, rank: int, world_size: int,
                 batch_size: int, workers: int):  # fmt: skip
        total = images.shards.total
        self.images, self.batch_size = images, batch_size
        self.begin = total * rank // world_size
        self.end = total * (rank + 1) // world_size
        self.workers = max(1, workers)

    def batches(self) -> int:
        return -(-(self.end - self.begin) // self.batch_size)

    def __len__(self) -> int:
        return self.end - self.begin

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker, batches = _reader(self.workers), self.batches()
        first = batches * worker // self.workers
        last = batches * (worker + 1) // self.workers
        begin = self.begin + first * self.batch_size
        end = min(self.end, self.begin + last * self.batch_size)
        samples = self.images.decoder.readable(
            read_range(self.images.shards, begin, end)
        )
        yield from _batched(samples, self.batch_size)


class ShardLoader:
    """Batches of a shard stream with the interface of our other loaders:
    ``len()`` in batches, ``sampler.set_epoch(epoch, start)`` (the stream),
    ``dataset`` (the samples, by position).  Each iteration starts a
    DataLoader over the stream, whose workers copy its epoch."""

    def __init__(self, stream: TrainStream | EvalStream, options: dict):
        self.sampler, self.dataset = stream, stream.images
        self.options = {**options, "persistent_workers": False}

    def __len__(self) -> int:
        if isinstance(self.sampler, EvalStream):
            return self.sampler.batches()
        return len(self.sampler) // self.sampler.batch_size

    def __iter__(self):
        return iter(DataLoader(self.sampler, batch_size=None, **self.options))
