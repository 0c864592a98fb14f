"""The loaders that ``tools/benchmark.py --only data`` times, side by side.

Ours, as a training run builds it on the CPU, once with the default
``DATA.DECODER`` and once per other decoder asked for, then torchvision's
ImageFolder with the classic PIL transforms (the reference of every ratio),
all on the same folder of ImageNet-sized JPEGs written first.  The specs of
our loader come from the caller (:data:`LoaderSpecs`: ``tools/benchmark.py``
loads them from a config, as a run does).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision import transforms as classic

from distribuuuu.data import build_dataset, build_normalizer, build_train_loader
from distribuuuu.data.datasets import IMAGENET_MEAN, IMAGENET_STD
from distribuuuu.data.spec import DataSpec, LoaderSpec
from distribuuuu.dist.worker_server import worker_context

# ImageNet's median photo is about 500 x 375 (4:3 landscape); the JPEGs of the
# data-pipeline measurement have that size.
JPEG_SIZE = (500, 375)
# The data set's and the loaders' specs of our training loader of a folder's
# train/ split, given a DATA.DECODER ("": the default) and, for prepared data,
# a WebDataset ``shards`` pattern.
LoaderSpecs = Callable[..., tuple[DataSpec, LoaderSpec]]


def write_jpeg_folder(root: str, images: int, classes: int = 2) -> None:
    """``images`` JPEGs of JPEG_SIZE in ``classes`` class folders under ``root``.

    Smooth colour fields with mild noise, saved at quality 90: they decode at
    about the speed of photos, unlike pure noise, which is far slower.
    """
    generator = np.random.default_rng(0)
    width, height = JPEG_SIZE
    for index in range(images):
        folder = os.path.join(root, f"c{index % classes}")
        os.makedirs(folder, exist_ok=True)
        coarse = generator.integers(0, 256, (height // 16, width // 16, 3))
        smooth = Image.fromarray(coarse.astype(np.uint8)).resize(
            JPEG_SIZE, Image.Resampling.BICUBIC
        )
        noise = generator.integers(-12, 13, (height, width, 3))
        pixels = np.clip(np.asarray(smooth, dtype=np.int16) + noise, 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(
            os.path.join(folder, f"{index}.jpg"), quality=90
        )


def reference_loader(root: str, im_size: int, batch: int, workers: int):
    """torchvision's ImageFolder with the classic PIL transforms."""
    transform = classic.Compose(
        [
            classic.RandomResizedCrop(im_size),
            classic.RandomHorizontalFlip(),
            classic.ToTensor(),
            classic.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = torchvision.datasets.ImageFolder(root, transform)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        drop_last=True,
        # As ours: this process has torch's threads, so never a fork of it.
        multiprocessing_context=worker_context() if workers > 0 else None,
    )


def our_loader(specs: tuple[DataSpec, LoaderSpec], batch: int):
    """Our training loader of ``specs`` (the data set's and the loaders'), as
    a run builds it on the CPU, and the normaliser of its batches."""
    data, loading = specs
    device = torch.device("cpu")
    dataset = build_dataset(data, train=True)
    loader = build_train_loader(
        loading,
        dataset,
        rank=0,
        world_size=1,
        seed=0,
        device=device,
        batch_size=batch,
    )
    return loader, build_normalizer(data, device)


def data_pipeline_sides(
    root: str,
    images: int,
    im_size: int,
    batch: int,
    workers: int,
    decoders: list,
    *,
    specs_of: LoaderSpecs,
) -> dict[str, Callable[[], int]]:
    """Write ``images`` JPEGs under ``root``/train; return one epoch of each
    loader, which returns the images it served: ``"ours"`` (the default
    decoder), each of ``decoders``, then ``"torchvision"``.  ``specs_of``
    gives our loader's specs of that folder."""
    write_jpeg_folder(os.path.join(root, "train"), images)
    sides = {"ours": _our_epoch(*our_loader(specs_of(), batch))}
    for decoder in decoders:
        sides[decoder] = _our_epoch(*our_loader(specs_of(decoder), batch))
    loading = (im_size, batch, workers)
    sides["torchvision"] = _reference_epoch(os.path.join(root, "train"), *loading)
    return sides


def _reference_epoch(root: str, *loading: int) -> Callable[[], int]:
    """One epoch of :func:`reference_loader` of the folder ``root``."""
    reference = reference_loader(root, *loading)
    return lambda: sum(len(images) for images, _ in reference)


def _our_epoch(loader, normalize) -> Callable[[], int]:
    """One epoch of our ``loader`` (the next epoch each call), batches
    normalised."""
    epochs = itertools.count()

    def run() -> int:
        loader.sampler.set_epoch(next(epochs))
        return sum(len(normalize(batch)) for batch, _ in loader)

    return run


def capped_shard_sides(
    root: str,
    im_size: int,
    batch: int,
    workers: int,
    max_side: int,
    *,
    specs_of: LoaderSpecs,
) -> dict[str, Callable[[], int]]:
    """Prepared data: the folder ``root``/train of :func:`data_pipeline_sides`
    written as shards with ``tools/make_shards.py --max-side max_side``
    (shorter sides capped, re-encoded at quality 90; FFCV stores ImageNet
    so), read by our loader (``specs_of`` gives its specs of a shard
    pattern); then ``"torchvision"`` on the original folder."""
    from distribuuuu.data.shard_writing import (
        ShardLimits,
        folder_source,
        pattern_of,
        write_index,
        write_split,
    )

    classes, samples = folder_source(os.path.join(root, "train"))
    out = os.path.join(root, f"shards-max{max_side}")
    os.makedirs(out, exist_ok=True)
    per_shard = -(-len(samples) // (2 * max(1, workers)))  # a shard per worker
    limits = ShardLimits(samples=per_shard, max_side=max_side, quality=90)
    entries = write_split(samples, out, "train", limits, seed=0)
    write_index(out, classes, entries)
    pattern = pattern_of(out, "train", len(entries))
    loading = (im_size, batch, workers)
    name = f"shards max-side {max_side}"
    specs = specs_of(shards=pattern)
    sides = {name: _our_epoch(*our_loader(specs, batch))}
    sides["torchvision"] = _reference_epoch(os.path.join(root, "train"), *loading)
    return sides
