"""The streams of WebDataset shards (:mod:`distribuuuu.data.shards`) that
the loaders of ``DATA.NAME webdataset`` iterate.

Training (:class:`TrainStream`): each epoch the shards are dealt out in an
order drawn from the run's seed and the epoch, to ``processes x loader
workers`` readers, each shard to the reader furthest below its share of the
epoch; a reader reads its shards in turn, shuffles within a buffer, and takes
exactly the samples of its share of the epoch's batches: an epoch has
floor(samples / (processes x batch)) batches on every process; a reader with
more samples drops the rest of its stream, one with fewer reads its shards
again (in another order): only what whole shards cannot even out.
Evaluation (:class:`EvalStream`) reads every sample once: process r takes
the contiguous samples [N r / W, N (r+1) / W) of the shards in pattern
order, passing over (unread) what comes before its range in its first shard.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from distribuuuu.data.batch_ring import RingLoader
from distribuuuu.data.progressive import CropSizer
from distribuuuu.data.samplers import sample_seed
from distribuuuu.data.shards import (
    RawSample,
    ShardedImages,
    read_range,
    read_whole,
    shortage_message,
)
from distribuuuu.data.spec import SizeRamp
from distribuuuu.errors import DataError

logger = logging.getLogger(__name__)


def _batched(samples: Iterator, size: int) -> Iterator[list]:
    """Lists of ``size`` samples (the last one shorter), which the loader's
    ``collate_fn`` collates."""
    while batch := list(itertools.islice(samples, size)):
        yield batch


def _reader(workers: int) -> int:
    """This loader worker's number, checking the count the plan assumed."""
    info = get_worker_info()
    count, worker = (1, 0) if info is None else (info.num_workers, info.id)
    if count != max(1, workers):
        raise RuntimeError(f"planned for {workers} loader workers, got {count}")
    return worker


def shuffled(items: Iterator, size: int, rng: random.Random) -> Iterator:
    """``items`` in an order shuffled within a buffer of ``size``; all of them."""
    buffer: list = []
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
    With a ``ramp`` (TRAIN.PROGRESSIVE) a reader crops the epoch's size.
    """

    def __init__(
        self,
        images: ShardedImages,
        rank: int,
        world_size: int,
        seed: int,
        batch_size: int,
        workers: int,
        buffer: int,
        ramp: SizeRamp | None = None,
    ):
        self.images, self.rank, self.world_size = images, rank, world_size
        self.ramp, self.resize = ramp, CropSizer(images.decoder.transform)
        self.seed, self.batch_size, self.buffer = seed, batch_size, buffer
        self.workers = max(1, workers)
        # (epoch, start) in shared memory: the loader's persistent workers
        # read the values set_epoch writes here when an iteration starts.
        self._position = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.batches = images.shards.total // (batch_size * world_size)
        shards = len(images.shards.paths)
        readers = world_size * self.workers
        if shards < readers:
            raise DataError(shortage_message(images.shards, world_size, workers))
        if self.batches == 0:
            raise DataError(
                f"{images.shards.key}: {images.shards.total} training samples, fewer "
                f"than a batch of {batch_size} on each of {world_size} processes"
            )
        self._logged: set[tuple[int, int]] = set()

    @property
    def epoch(self) -> int:
        return int(self._position[0])

    @property
    def start(self) -> int:
        return int(self._position[1])

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self._position[0], self._position[1] = epoch, start
        if (epoch, start) not in self._logged:  # precise BN sets it again
            self._logged.add((epoch, start))
            self._log_plan()

    def done(self) -> int:
        """Batches of this process before ``start``."""
        return self.start // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        """Samples this process takes in the rest of the epoch."""
        return (self.batches - self.done()) * self.batch_size

    def _wanted(self, worker: int, batches: int) -> int:
        """Samples reader ``worker`` of this process serves in ``batches`` batches."""
        return len(range(worker, batches, self.workers)) * self.batch_size

    def _dealt(self) -> list[list[int]]:
        """The shards of every reader (rank r's worker w is r x workers + w)."""
        readers = range(self.world_size * self.workers)
        wanted = [self._wanted(r % self.workers, self.batches) for r in readers]
        return deal_shards(self.images.shards.counts, wanted, self.seed + self.epoch)

    def _log_plan(self) -> None:
        counts, dropped, repeated = self.images.shards.counts, 0, 0
        for reader, shards in enumerate(self._dealt()):
            has = sum(counts[shard] for shard in shards)
            wanted = self._wanted(reader % self.workers, self.batches)
            dropped += max(0, has - wanted)
            repeated += max(0, wanted - has)
        where = f"after {self.done()} batches" if self.start else "from the start"
        logger.info(
            "webdataset epoch %d: %d batches of %d samples on each of %d processes "
            "from %d shards, %d readers (processes x loader workers); %d samples "
            "dropped (the ends of readers' shuffled streams), %d read again "
            "(readers short of samples); %s",
            self.epoch,
            self.batches,
            self.batch_size,
            self.world_size,
            len(counts),
            self.world_size * self.workers,
            dropped,
            repeated,
            where,
        )

    def _stream(
        self, shards: list[int], rng: random.Random, labels_only: bool
    ) -> Iterator[RawSample]:
        """A reader's samples: its shards, then again in new orders, each
        pass shuffled within the buffer."""
        for repeat in itertools.count():
            order = shards if repeat == 0 else rng.sample(shards, len(shards))
            raws = itertools.chain.from_iterable(
                read_whole(self.images.shards, shard, labels_only) for shard in order
            )
            yield from shuffled(raws, self.buffer, rng)

    def reader_samples(self, slot: int, labels_only: bool = False) -> Iterator:
        """The raw samples that reader ``slot`` of this process serves in the
        rest of the epoch (``labels_only``: the images' bytes left unread,
        see :func:`~distribuuuu.data.shards.read_shard`)."""
        reader = self.rank * self.workers + slot
        rng = random.Random(sample_seed(self.seed, self.epoch, reader))
        wanted = self._wanted(slot, self.batches)
        skip = self._wanted(slot, self.done())
        shards = self._dealt()[reader]
        stream = itertools.islice(self._stream(shards, rng, labels_only), wanted)
        return itertools.islice(stream, skip, None)

    def reader_of(self, batch: int) -> int:
        """The reader whose batch is this process's ``batch``-th of the rest
        of the epoch: the loader takes batches from its workers in turn, from
        worker 0; after ``done`` batches, worker w plays the part of the
        reader whose turn it is, (w + done) mod workers, as in the
        uninterrupted run."""
        return (batch + self.done()) % self.workers

    def __iter__(self) -> Iterator[list]:
        taken = self.reader_samples(self.reader_of(_reader(self.workers)))
        if self.ramp is not None:  # the epoch as this iteration reads it
            self.resize(self.ramp.size(self.epoch))

        def seed(number: int) -> int:
            return sample_seed(self.seed, self.epoch, number)

        yield from _batched(self.images.decoder.readable(taken, seed), self.batch_size)


class EvalStream(IterableDataset):
    """The evaluation batches of one process: samples [N r / W, N (r+1) / W)
    of the shards, split among the loader workers by whole batches; every
    sample of the set once over all processes."""

    def __init__(
        self,
        images: ShardedImages,
        rank: int,
        world_size: int,
        batch_size: int,
        workers: int,
    ):
        total = images.shards.total
        self.images, self.batch_size = images, batch_size
        self.begin = total * rank // world_size
        self.end = total * (rank + 1) // world_size
        self.workers = max(1, workers)

    def batches(self) -> int:
        return -(-(self.end - self.begin) // self.batch_size)

    def __len__(self) -> int:
        return self.end - self.begin

    def __iter__(self) -> Iterator[list]:
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
    ``dataset`` (the samples, by position).  One loader over the stream,
    whose persistent workers read the epoch from the stream's shared memory
    at each iteration and collate (images into reused shared memory:
    :class:`RingLoader`)."""

    def __init__(self, stream: TrainStream | EvalStream, options: dict):
        self.sampler, self.dataset = stream, stream.images
        loader = RingLoader if options["collate_fn"] is None else DataLoader
        self.loader = loader(stream, batch_size=None, **options)

    def __len__(self) -> int:
        if isinstance(self.sampler, EvalStream):
            return self.sampler.batches()
        return len(self.sampler) // self.sampler.batch_size

    def __iter__(self):
        return iter(self.loader)
