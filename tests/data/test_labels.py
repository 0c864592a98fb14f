"""Labels-only training loaders (a pipeline's later stages): the labels the
full loader serves, batch by batch, and not one image read (shards:
test_shards.py; a 2-stage run: tests/strategies/test_pipeline.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from distribuuuu.config import load_cfg
from distribuuuu.data import build_dataset, build_train_loader
from distribuuuu.data.datasets import (
    CheckedImageFolder,
    SkipUnreadable,
    SyntheticDataset,
    TensorImageDataset,
)
from distribuuuu.data.image_files import decode_image_file
from distribuuuu.data.labels import is_stand_in, labels_only
from distribuuuu.engine.specs import data_spec, loader_spec

CPU = torch.device("cpu")
SIZE = 41  # padded to 42 on 2 ranks
SPEC = loader_spec(load_cfg(None, ["TRAIN.WORKERS", "0", "DATA.REPEATED_AUG", "3"]))
# DATA.SAMPLER -> its loader spec (random: SPEC).
SPECS = {
    name: dataclasses.replace(SPEC, sampler=name) for name in ("random", "balanced")
}


class Counted:
    """A transform or file reader that counts its calls (images read)."""

    def __init__(self, then=None):
        self.calls, self.then = 0, then

    def __call__(self, image):
        self.calls += 1
        return image if self.then is None else self.then(image)


def _image_folder(root, counted: Counted) -> CheckedImageFolder:
    """A split of 3 classes, :data:`SIZE` PNGs of 8 px (their value: their
    number)."""
    for number in range(SIZE):
        folder = root / f"class{number % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = Image.new("RGB", (8, 8), (number, 0, 0))
        pixels.save(folder / f"{number:02d}.png")
    return CheckedImageFolder(str(root), None, "TRAIN.DATASET", counted)


def _dataset(kind: str, tmp_path, counted: Counted):
    """A data set of ``kind`` whose images pass through ``counted``."""
    if kind == "folder":
        counted.then = decode_image_file  # counts the files read
        return _image_folder(tmp_path, counted)
    if kind == "synthetic":
        return SyntheticDataset(SIZE, 8, 10, transform=counted)
    images = torch.randint(0, 256, (SIZE, 1, 8, 8), dtype=torch.uint8)
    labels = torch.randint(0, 10, (SIZE,))
    return TensorImageDataset(images, labels, list("0123456789"), counted)


def _batches(loader, epoch: int, start: int) -> list:
    loader.sampler.set_epoch(epoch, start)
    return list(loader)


@pytest.mark.parametrize("sampler", ["random", "balanced"])
@pytest.mark.parametrize("kind", ["synthetic", "tensor", "folder"])
def test_labels_only_batches_hold_the_full_loaders_labels(tmp_path, kind, sampler):
    """On 2 ranks (the order padded), 3 repeats of each sample, an epoch from
    its start and resumed after 2 steps, shuffled or drawn by class
    (DATA.SAMPLER): the labels of every batch, in order; no image transformed
    or read."""
    counted, spec = Counted(), SPECS[sampler]
    dataset = _dataset(kind, tmp_path, counted)
    for rank in range(2):
        where = dict(rank=rank, world_size=2, seed=5, device=CPU, batch_size=4)
        full = build_train_loader(spec, dataset, **where)
        labels = labels_only(build_train_loader(spec, dataset, **where), dataset, 8)
        for epoch, start in ((0, 0), (1, 16)):
            expected, reads = _batches(full, epoch, start), counted.calls
            served = _batches(labels, epoch, start)
            assert counted.calls == reads > 0  # the full loader's only
            assert len(served) == len(expected) == len(labels) > 0
            for (stand_in, got), (images, wanted) in zip(served, expected):
                assert got.dtype == wanted.dtype and torch.equal(got, wanted)
                assert is_stand_in(stand_in) and not is_stand_in(images)
                # The shape the first stage's mixing draws from: its batch's.
                assert stand_in.shape[-2:] == images.shape[-2:] == (8, 8)
                assert len(stand_in) == len(images)


def test_labels_need_the_images_where_unreadable_ones_are_replaced(tmp_path):
    """DATA.SKIP_CORRUPT serves the next readable sample: the full loader stays."""
    folder = SkipUnreadable(_image_folder(tmp_path, Counted(decode_image_file)))
    where = dict(rank=0, world_size=1, seed=5, device=CPU, batch_size=4)
    loader = labels_only(build_train_loader(SPEC, folder, **where), folder, 8)
    images, _ = next(iter(loader))
    assert images.shape == (4, 3, 8, 8)


def test_the_embedded_digits_serve_their_labels_at_the_training_size():
    """mnist5k at TRAIN.IM_SIZE 32 (resized from 28): the stand-ins' size is
    the size the first stage's batches have."""
    cfg = load_cfg(None, ["TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"])
    dataset = build_dataset(data_spec(cfg), train=True)
    spec = dataclasses.replace(loader_spec(cfg), workers=0)
    where = dict(rank=1, world_size=3, seed=2, device=CPU, batch_size=8)
    full = build_train_loader(spec, dataset, **where)
    labels = labels_only(build_train_loader(spec, dataset, **where), dataset, 32)
    full.sampler.set_epoch(4, 0)
    labels.sampler.set_epoch(4, 0)
    for _, ((stand_in, got), (images, wanted)) in zip(range(3), zip(labels, full)):
        assert torch.equal(got, wanted)
        assert stand_in.shape == (8, 0, *images.shape[-2:])
