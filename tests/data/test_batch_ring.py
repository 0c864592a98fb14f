"""The training loader's reusable shared-memory batches (data/batch_ring.py)."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from torch.utils.data import DataLoader

from distribuuuu.config import load_cfg
from distribuuuu.data import (
    batch_ring,
    build_dataset,
    build_test_loader,
    build_train_loader,
)
from distribuuuu.data.batch_ring import BatchRing, RingLoader
from distribuuuu.data.datasets import SyntheticDataset
from distribuuuu.engine.specs import data_spec, loader_spec

BATCH = 4


def _loaders(workers: int = 2):
    """Our training loader of 48 synthetic images with ``workers`` workers,
    and torch's DataLoader of the same samples in the main process."""
    words = ["MODEL.DUMMY_INPUT", "True", "DATA.SYNTHETIC_SIZE", "[48, 8]"]
    words += ["TRAIN.IM_SIZE", "24", "TRAIN.WORKERS", str(workers)]
    cfg = load_cfg(None, words)
    dataset = build_dataset(data_spec(cfg), train=True)
    cpu = torch.device("cpu")
    loader = build_train_loader(
        loader_spec(cfg),
        dataset,
        rank=0,
        world_size=1,
        seed=7,
        device=cpu,
        batch_size=BATCH,
    )
    reference = DataLoader(
        loader.dataset, batch_size=BATCH, sampler=loader.sampler, drop_last=True
    )
    return loader, reference


def _epoch(loader, epoch: int) -> list:
    loader.sampler.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_the_training_loader_reuses_batch_memory_and_gives_torchs_batches():
    loader, reference = _loaders()
    assert isinstance(loader, RingLoader)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        expected = _epoch(reference, epoch)
        got = 0
        for (images, labels), (want_images, want_labels) in zip(loader, expected):
            assert torch.equal(images, want_images)
            assert torch.equal(labels, want_labels)
            got += 1
        assert got == len(expected) == 12
    # Every batch came in a reused slot: a worker has 2 batches in flight, the
    # loop holds one and the one before it.
    assert loader.new_segments == 0


def test_batches_kept_by_the_caller_are_never_overwritten():
    loader, reference = _loaders()
    kept = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for index, (images, labels) in enumerate(loader):
            # A view of an image keeps the batch's memory as the batch would.
            kept.append((images[index % BATCH], labels))
    expected = [pair for epoch in range(3) for pair in _epoch(reference, epoch)]
    assert len(kept) == len(expected) == 36
    for index, ((image, labels), (want_images, want_labels)) in enumerate(
        zip(kept, expected)
    ):
        assert torch.equal(image, want_images[index % BATCH])
        assert torch.equal(labels, want_labels)
    # With every slot held, the workers collated into new memory, as torch does.
    assert loader.new_segments == 36 - 2 * batch_ring.RING_SLOTS


def test_batches_a_left_iterator_dropped_give_their_slots_back():
    """Precise BN takes a few batches of an epoch and leaves the iterator; the
    batches its workers had in flight are dropped by the next iterator."""
    loader, reference = _loaders()
    for epoch in range(5):
        loader.sampler.set_epoch(epoch)
        taken = [images.clone() for images, _ in itertools.islice(loader, 2)]
        assert all(
            torch.equal(a, b) for a, (b, _) in zip(taken, _epoch(reference, epoch))
        )
    assert [pair[0].tolist() for pair in _epoch(loader, 5)] == [
        pair[0].tolist() for pair in _epoch(reference, 5)
    ]
    assert loader.new_segments == 0


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_of_any_start_method_share_the_slots(context):
    dataset = SyntheticDataset(24, 8, 3)
    loader = RingLoader(
        dataset,
        batch_size=BATCH,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    expected = list(DataLoader(dataset, batch_size=BATCH))
    for _ in range(2):
        got = [(images.clone(), labels) for images, labels in loader]
        assert len(got) == len(expected) == 6
        for (images, labels), (want_images, want_labels) in zip(got, expected):
            assert torch.equal(images, want_images)
            assert torch.equal(labels, want_labels)
    assert loader.new_segments == 0


def test_the_evaluation_loader_gives_torchs_batches_short_last_one_too():
    words = ["MODEL.DUMMY_INPUT", "True", "DATA.SYNTHETIC_SIZE", "[8, 11]"]
    words += ["TEST.BATCH_SIZE", "4", "TRAIN.WORKERS", "2"]
    cfg = load_cfg(None, words)
    dataset = build_dataset(data_spec(cfg), train=False)
    loader = build_test_loader(loader_spec(cfg), dataset, 0, 1, torch.device("cpu"))
    assert isinstance(loader, RingLoader)
    expected = list(DataLoader(dataset, batch_size=4))
    for _ in range(2):
        got = [(images.clone(), labels) for images, labels in loader]
        assert [len(labels) for _, labels in got] == [4, 4, 3]
        for (images, labels), (want_images, want_labels) in zip(got, expected):
            assert torch.equal(images, want_images)
            assert torch.equal(labels, want_labels)
    assert loader.new_segments == 0


def test_without_workers_the_loader_is_torchs():
    loader, _ = _loaders(workers=0)
    assert type(loader) is DataLoader


@pytest.fixture
def in_worker(monkeypatch):
    """Calls of a BatchRing as if in worker 1 of 2."""
    info = types.SimpleNamespace(id=1, num_workers=2)
    monkeypatch.setattr(batch_ring, "get_worker_info", lambda: info)


def _samples(shape=(3, 5, 4), count: int = 3) -> list:
    return [
        (torch.full(shape, index, dtype=torch.uint8), index + 10)
        for index in range(count)
    ]


def _unwrap(batch) -> tuple:
    """``(images, labels, slot)`` of what a worker's ring returned (the main
    process's books are tested with real workers, above)."""
    if isinstance(batch, tuple):
        return batch
    _, slot, memory, shape = batch.batch
    return (*batch_ring._batch_in(memory, shape), slot)


def test_a_worker_fills_its_own_free_slots_then_collates_as_torch(in_worker):
    ring = BatchRing(workers=2, slots=2)
    images, labels, slot = _unwrap(ring(_samples()))
    assert slot == 2  # worker 1's first slot
    assert images.is_shared() and images.shape == (3, 3, 5, 4)
    assert images[:, 0, 0, 0].tolist() == [0, 1, 2]
    assert labels.dtype == torch.int64 and labels.tolist() == [10, 11, 12]
    assert _unwrap(ring(_samples()))[2] == 3
    _, new_labels, slot = _unwrap(ring(_samples()))  # both slots taken
    assert slot == -1 and new_labels.tolist() == [10, 11, 12]
    assert list(ring.state) == [0, 0, 1, 1]
    ring._free([2])
    again, _, slot = _unwrap(ring(_samples(count=2)))  # smaller, same memory
    assert slot == 2 and again.data_ptr() == images.data_ptr()


@pytest.mark.parametrize(
    "samples",
    [
        [
            (torch.zeros(3, 4, 4, dtype=torch.uint8), 0),
            (torch.zeros(3, 4, 5, dtype=torch.uint8), 1),
        ],
        [(torch.zeros(3, 4, 4), 0), (torch.zeros(3, 4, 4), 1)],
        [(torch.zeros(3, 4, 4, dtype=torch.uint8), torch.tensor(0))] * 2,
    ],
    ids=["two-shapes", "float", "tensor-labels"],
)
def test_other_samples_collate_as_torch_does(in_worker, samples):
    ring = BatchRing(workers=2, slots=2)
    if samples[0][0].shape != samples[1][0].shape:
        with pytest.raises(RuntimeError, match="stack expects each tensor"):
            ring(samples)
    else:
        images, labels, slot = _unwrap(ring(samples))
        assert slot == -1 and images.dtype == samples[0][0].dtype
    assert list(ring.state) == [0, 0, 0, 0]


def test_with_no_shared_memory_left_the_slot_stays_free(in_worker, monkeypatch):
    def refuse(self):
        raise RuntimeError("unable to write to file </torch_1>: No space left")

    monkeypatch.setattr(torch.Tensor, "share_memory_", refuse)
    ring = BatchRing(workers=2, slots=2)
    images, labels, slot = _unwrap(ring(_samples()))
    assert slot == -1 and images[:, 0, 0, 0].tolist() == [0, 1, 2]
    assert list(ring.state) == [0, 0, 0, 0]


def test_in_the_main_process_it_collates_as_torch():
    ring = BatchRing(workers=2, slots=2)
    images, labels, slot = ring(_samples())
    assert slot == -1 and not images.is_shared()
    assert labels.tolist() == [10, 11, 12]
