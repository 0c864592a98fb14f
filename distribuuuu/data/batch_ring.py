"""Batches in shared memory that the loaders' workers reuse.

torch's DataLoader collates every batch of a worker into a new shared-memory
segment: the worker creates it and faults in (zeroes) each of its pages, the
main process maps it again and faults its pages in, and both unmap it a batch
later. For 32 images of 224 px that is 4.8 MB and about 2.8 ms of a worker's
time each batch, an eighth of its CPU time (py-spy; the README's
Performance section has the numbers).

:class:`BatchRing` is instead the ``collate_fn`` of a loader with workers:
each worker keeps a few slots, one shared-memory segment each, and collates a
batch (images and labels) into a free slot. When a batch arrives in the main
process (as it is unpickled, in whichever thread reads the loader's queue),
a weak reference to its memory is kept, and the slot is handed back to its
worker once nothing there refers to that memory any more: no tensor and no
view of the batch is alive, whether it was given to the caller, copied into
pinned memory, or dropped by the loader (an iterator left before its end).
So a slot is never written while anything can still read it, whatever the
caller keeps; keeping batches only makes the worker fall back to a new
segment, as torch does. (Handing a slot back when the next batch is asked
for would be simpler, and would silently change batches a caller kept:
``tests/data/test_batch_ring.py`` shows it.)
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import weakref
from collections.abc import Iterator
from typing import cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.dataloader import _BaseDataLoaderIter

FREE, TAKEN = 0, 1
# Slots of a worker: the DataLoader's 2 batches in flight a worker (its
# prefetch_factor), the batch being used and the one before it.
RING_SLOTS = 4


class BatchRing:
    """``collate_fn`` collating (uint8 image, int label) samples of one shape
    into reusable shared-memory slots, ``slots`` per worker; a batch comes out
    as ``(images, labels, slot)``, with ``slot`` -1 when it was collated as
    torch does (in the main process, no free slot, other samples, or no shared
    memory left for a slot)."""

    def __init__(self, workers: int, context=multiprocessing, slots: int = RING_SLOTS):
        self.slots = slots
        # Taken/free flags shared by the workers and the main process (made by
        # the loader's multiprocessing ``context``); their lock orders a
        # worker's writes into a slot after the main process stopped reading it.
        self.state = context.Array("b", workers * slots)
        self.memory: dict[int, torch.Tensor] = {}  # a worker's slots, by number
        # In the main process: the batches that arrived, as (slot, weak
        # reference to its memory), filled by _arrived in any thread.
        self.key = (os.getpid(), next(_KEYS))
        self.arrived: collections.deque = collections.deque()
        _ARRIVED[self.key] = self.arrived
        self.held: list[tuple[int, StorageWeakRef]] = []

    def __getstate__(self) -> dict:
        # A worker needs the flags and the key, not the main process's books.
        return {**self.__dict__, "arrived": None, "held": []}

    def __call__(self, samples: list) -> tuple | _Slotted:
        info = get_worker_info()
        slot = self._take(info.id) if info and _collatable(samples) else -1
        if slot >= 0:
            try:
                images, labels = self._views(slot, len(samples), samples[0][0].shape)
            except RuntimeError:  # no shared memory left for it: torch's way
                self._free([slot])
                slot = -1
        if slot < 0:
            return (*default_collate(samples), -1)
        torch.stack([image for image, _ in samples], out=images)
        labels.copy_(torch.tensor([label for _, label in samples]))
        return _Slotted(self.key, slot, self.memory[slot], images.shape)

    def _take(self, worker: int) -> int:
        """A free slot of ``worker``, now taken; -1 if none is free."""
        with self.state.get_lock():
            for slot in range(worker * self.slots, (worker + 1) * self.slots):
                if self.state[slot] == FREE:
                    self.state[slot] = TAKEN
                    return slot
        return -1

    def _views(self, slot: int, batch: int, shape: torch.Size) -> tuple:
        """Images and labels of ``batch`` samples in ``slot``'s memory."""
        size = _label_start(batch, shape) + 8 * batch
        memory = self.memory.get(slot)
        if memory is None or memory.numel() < size:
            self.memory.pop(slot, None)
            memory = torch.empty(size, dtype=torch.uint8).share_memory_()
            self.memory[slot] = memory
        return _batch_in(memory, (batch, *shape))

    def _free(self, slots: list[int]) -> None:
        with self.state.get_lock():
            for slot in slots:
                self.state[slot] = FREE

    def give_back_unused(self) -> None:
        """Hand back the slots of arrived batches that nothing refers to (in
        the main process)."""
        while self.arrived:
            self.held.append(self.arrived.popleft())
        unused = [slot for slot, memory in self.held if memory.expired()]
        if unused:
            self.held = [held for held in self.held if held[0] not in unused]
            self._free(unused)


# Each BatchRing's key is (the process that made it, a number); the deques of
# the batches that arrived, by key: unpickling a batch finds its ring's here.
_KEYS = itertools.count()
_ARRIVED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _label_start(batch: int, shape: torch.Size) -> int:
    """Where a slot's int64 labels start: after the images, 8-byte aligned."""
    return -(-batch * shape.numel() // 8) * 8


def _batch_in(memory: torch.Tensor, shape: tuple) -> tuple:
    """The images (uint8 of ``shape``) and labels in a slot's ``memory``."""
    batch, image = shape[0], torch.Size(shape[1:])
    start = _label_start(batch, image)
    images = memory[: batch * image.numel()].view(shape)
    return images, memory[start : start + 8 * batch].view(torch.int64)


class _Slotted:
    """A batch in a slot, as a worker sends it (the slot's memory, one
    tensor): unpickled, it is ``(images, labels, slot)``, and its ring learns
    that it arrived."""

    def __init__(self, key: tuple, slot: int, memory: torch.Tensor, shape):
        self.batch = (key, slot, memory, tuple(shape))

    def __reduce__(self):
        return _arrived, self.batch


def _arrived(key: tuple, slot: int, memory: torch.Tensor, shape: tuple) -> tuple:
    arrived = _ARRIVED.get(key)
    if arrived is not None:  # None: not the process that made the ring
        arrived.append((slot, StorageWeakRef(memory.untyped_storage())))
    return (*_batch_in(memory, shape), slot)


def _collatable(samples: list) -> bool:
    """Whether ``samples`` are (uint8 tensor, int) pairs of one image shape."""
    shape = samples[0][0].shape
    return all(
        isinstance(image, torch.Tensor)
        and image.dtype == torch.uint8
        and image.shape == shape
        and type(label) is int
        for image, label in samples
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class RingLoader(DataLoader):
    """A DataLoader of (uint8 image, int label) samples that collates with a
    :class:`BatchRing` (in place of any ``collate_fn``); its iterators give
    (images, labels) batches. ``new_segments`` counts the batches that came in
    new shared memory instead of a slot (see :class:`BatchRing`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        context = self.multiprocessing_context or multiprocessing
        self.collate_fn = BatchRing(self.num_workers, context)
        self.new_segments = 0

    # torch types a DataLoader's iterators as its own; ours wraps one.
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[override]
        return _Batches(super().__iter__(), self)


class _Batches:
    """The (images, labels) batches of one epoch of a :class:`RingLoader`."""

    def __init__(self, batches: _BaseDataLoaderIter, loader: RingLoader):
        self.batches, self.loader = batches, loader

    def __iter__(self) -> _Batches:
        return self

    def __len__(self) -> int:
        return len(self.batches)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A method, not a generator: its frame (and so the last batch) is gone
        # when it returns, and nothing but the caller holds the batch.
        cast(BatchRing, self.loader.collate_fn).give_back_unused()
        images, labels, slot = next(self.batches)
        if slot < 0:
            self.loader.new_segments += 1
        elif _same_memory(images, labels):  # not pinned copies
            labels = labels.clone()  # so that only the images hold the slot
        return images, labels
