"""Data sets, transforms, samplers and loaders, chosen by ``DataSpec.name``
(DATA.NAME); what they read of a run comes in :mod:`distribuuuu.data.spec`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from distribuuuu.data import datasets as ds
from distribuuuu.data import gpu_decode, image_files, labels_files, pairs, turbo
from distribuuuu.data.batch_ring import RingLoader
from distribuuuu.data.datasets import count_images, find_image_files
from distribuuuu.data.folder_index import shared_listing, split_classes
from distribuuuu.data.jpeg import BytesReader, read_image_fused, read_or_defer
from distribuuuu.data.samplers import (
    ExactShardSampler,
    SeededDataset,
    build_train_sampler,
)
from distribuuuu.data.shard_streams import EvalStream, ShardLoader, TrainStream
from distribuuuu.data.shards import (
    ShardDecoder,
    ShardedImages,
    open_shards,
    shortage_message,
)
from distribuuuu.data.spec import DataSpec, LoaderSpec, TransformSpec
from distribuuuu.data.transforms import (
    ToNormalizedFloat,
    auto_augment,
    imagenet_transforms,
    small_image_transforms,
)
from distribuuuu.dist.worker_server import worker_context
from distribuuuu.errors import DataError

__all__ = [
    "DataError",
    "DataSpec",
    "ImageDataset",
    "SeededDataset",
    "LoaderSpec",
    "TransformSpec",
    "build_dataset",
    "empty_batch",
    "build_normalizer",
    "build_test_transform",
    "build_train_loader",
    "build_test_loader",
    "check_data",
    "count_images",
    "count_shard_samples",
    "find_image_files",
    "flip_probability",
    "image_reader",
    "stack_images",
    "eval_sizes",
]


# DATA.NAME -> (native image size, mean, std, horizontal flip in training) of
# the data sets held as small uint8 tensors; synthetic images are made at
# TRAIN.IM_SIZE with ImageNet statistics.
_SMALL_IMAGES = {
    "mnist5k": (28, ds.MNIST_MEAN, ds.MNIST_STD, False),
    "mnist5k_pairs": (pairs.CANVAS, pairs.PAIRS_MEAN, pairs.PAIRS_STD, False),
    "cifar10": (32, ds.CIFAR10_MEAN, ds.CIFAR10_STD, True),
    "cifar100": (32, ds.CIFAR100_MEAN, ds.CIFAR100_STD, True),
}
# DATA.NAME -> the AutoAugment policy learned for it (Cubuk et al. 2019 learned
# policies on CIFAR-10, SVHN and ImageNet): CIFAR's for CIFAR, the SVHN (house
# number digits) policy for the digits, ImageNet's for everything else.
_AUTO_AUGMENT_POLICY = {
    "mnist5k": "svhn",
    "mnist5k_pairs": "svhn",
    "cifar10": "cifar10",
    "cifar100": "cifar10",
}
# Data sets of image files of any size, read by DATA.DECODER: ImageNet-style
# transforms; the same files give the same pixels in either.
_IMAGE_FILES = ("imagefolder", "webdataset")


def _train_augment(spec: TransformSpec, name: str) -> tuple[v2.Transform | None, float]:
    """The auto-augment transform (or None) and random erasing probability."""
    policy, mean = _AUTO_AUGMENT_POLICY.get(name, "imagenet"), _statistics(name)[0]
    return auto_augment(spec, policy, mean), spec.random_erasing


def _statistics(name: str) -> tuple[tuple, tuple]:
    """Per-channel mean and std (of pixels scaled to 0-1) of data set ``name``."""
    if name in _SMALL_IMAGES:
        return _SMALL_IMAGES[name][1:3]
    return ds.IMAGENET_MEAN, ds.IMAGENET_STD


def eval_sizes(spec: TransformSpec) -> tuple[int, int]:
    """The evaluation resize (of the shorter side) and centre crop, in pixels:
    TEST.CROP_SIZE (or TRAIN.IM_SIZE) after TEST.IM_SIZE, or after
    floor(crop / TEST.CROP_PCT) when that is set."""
    crop = spec.test_crop_size or spec.im_size
    if spec.test_crop_pct:
        return math.floor(crop / spec.test_crop_pct), crop
    return spec.test_im_size, crop


def flip_probability(spec: TransformSpec, name: str) -> float:
    """TRAIN.HFLIP, or where it is -1, data set ``name``'s own."""
    if spec.hflip >= 0:
        return spec.hflip
    return 0.5 if _SMALL_IMAGES.get(name, (0, None, None, True))[3] else 0.0


def _transform(spec: DataSpec, train: bool, views: bool = False) -> v2.Transform:
    """The train or eval transform of the data set (images as it serves
    them, to uint8 tensors); with ``views``, the evaluation images that
    TEST.TTA five_crop / ten_crop crop on the device (the square of the
    resize) where it is set."""
    name, sizes = spec.name, spec.transform
    augment, erasing = _train_augment(sizes, name) if train else (None, 0.0)
    resize, crop = eval_sizes(sizes)
    if views and sizes.device_crops:
        crop = resize
    mean, flip = _statistics(name)[0], flip_probability(sizes, name)
    interpolation = sizes.train_interpolation if train else sizes.test_interpolation
    if name in _IMAGE_FILES:
        return imagenet_transforms(
            train,
            train_size=sizes.im_size,
            test_size=resize,
            mean=mean,
            augment=augment,
            erasing=erasing,
            crop_size=crop,
            flip=flip,
            interpolation=interpolation,
            fused=spec.decoder == "fused",
        )
    native = _SMALL_IMAGES[name][0] if name in _SMALL_IMAGES else sizes.im_size
    native = 0 if train and sizes.ramp else native  # resized to each epoch's size
    return small_image_transforms(
        train,
        im_size=sizes.im_size if train else crop,
        native_size=native,
        mean=mean,
        flip=flip,
        augment=augment,
        erasing=erasing,
        interpolation=interpolation,
    )


def build_normalizer(
    spec: DataSpec, device: torch.device, channels_last: bool = False
) -> ToNormalizedFloat | gpu_decode.DeviceDecoder:
    """The input step after the data set: its uint8 images (one, or a batch)
    copied to ``device`` as float32 normalised with the data set's mean and
    std, optionally channels-last (DATA.DECODER gpu: decoding them first)."""
    mean, std = _statistics(spec.name)
    normalize = ToNormalizedFloat(mean, std, channels_last).to(device)
    if spec.decoder == "gpu":  # the batches are JPEG bytes: decode them there
        return gpu_decode.DeviceDecoder(normalize)
    return normalize


def image_reader(decoder: str) -> Callable[[str], torch.Tensor | Image.Image]:
    """What reads an image file for DATA.DECODER ``decoder``: a uint8 tensor
    from ``torchvision.io`` or an RGB PIL image; a DataError names a damaged
    file.  DATA.DECODER gpu reads a single file as tensor does."""
    readers = {
        "fused": read_image_fused,
        "tensor": image_files.decode_image_file,
        "gpu": image_files.decode_image_file,
    }
    return readers.get(decoder, image_files.load_image)


def describe_decoder(spec: DataSpec) -> str:
    """DATA.DECODER in words for the start-up report: for fused image files,
    whether the training crops' windows or whole images are decoded."""
    decoder = spec.decoder
    if decoder != "fused" or spec.name not in _IMAGE_FILES:
        return decoder
    window = turbo.window_decoder()
    if window is None:
        return (
            "fused (whole JPEGs: no libjpeg-turbo 3 for crop windows; "
            f"pip install turbojpeg, or set {turbo.ENVIRONMENT})"
        )
    return f"fused (crop windows by {window.path})"


def build_test_transform(
    spec: DataSpec,
    normalize: ToNormalizedFloat | gpu_decode.DeviceDecoder | None = None,
) -> v2.Compose:
    """The whole evaluation input pipeline of the data set for one image of
    any size as :func:`image_reader` gives it, normalisation included (by
    ``normalize`` when given: an exported model's mean and std).

    For the data sets served as small tensors (digits, CIFAR, synthetic) the
    image is first resized and centre-cropped to the evaluation crop
    (TEST.CROP_SIZE, or TRAIN.IM_SIZE), which leaves
    an image of that size untouched; grey images read as RGB have 3 equal
    channels, as the data sets serve them.
    """
    if normalize is None:
        normalize = build_normalizer(spec, torch.device("cpu"))
    steps = [_transform(spec, train=False), normalize]
    if spec.name not in _IMAGE_FILES:
        size = eval_sizes(spec.transform)[1]
        fit = [v2.PILToTensor(), v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        steps = fit + steps
    return v2.Compose(steps)


# What build_dataset returns: map-style data sets of labelled images, each
# with its ``classes`` and a length (torch's Dataset declares neither).
ImageDataset = (
    ds.TensorImageDataset
    | ds.SyntheticDataset
    | ds.CheckedImageFolder
    | ds.SkipUnreadable
    | labels_files.LabelledImageFiles
    | ShardedImages
)


def build_dataset(spec: DataSpec, train: bool) -> ImageDataset:
    """The train or validation data set named by ``spec.name`` (DATA.NAME)."""
    name = spec.name
    transform = _transform(spec, train, views=True)
    if name == "mnist5k":
        images, labels = ds.load_mnist5k(train)
        classes = [str(digit) for digit in range(10)]
        return ds.TensorImageDataset(images, labels, classes, transform)
    if name == "mnist5k_pairs":  # label sets: multi-hot targets
        images, targets = pairs.load_mnist5k_pairs(train)
        classes = [str(digit) for digit in range(pairs.CLASSES)]
        return ds.TensorImageDataset(images, targets, classes, transform)
    if name in ("cifar10", "cifar100"):
        root = spec.train_dataset if train else spec.test_dataset
        images, labels, classes = ds.load_cifar(name, root, train, spec.download)
        return ds.TensorImageDataset(images, labels, classes, transform)
    if name == "imagefolder":
        return _image_folder_dataset(spec, train, transform)
    if name == "webdataset":
        return _shard_dataset(spec, train, transform)
    if name == "synthetic":
        count = spec.synthetic_size[0 if train else 1]
        size, seed = spec.transform.im_size, 0 if train else 1
        return ds.SyntheticDataset(count, size, spec.num_classes, seed, transform)
    raise ValueError(f"unknown DATA.NAME {name!r}")


def _image_folder_dataset(
    spec: DataSpec, train: bool, transform: v2.Transform
) -> ds.CheckedImageFolder | ds.SkipUnreadable | labels_files.LabelledImageFiles:
    """The class folders of the train or val split, read by DATA.DECODER;
    listed once, by rank 0, for every rank (see :func:`shared_listing`)."""
    path, key = spec.split_folder(train)
    reader: Callable[[str], Any] = image_reader(spec.decoder)
    if spec.decoder == "gpu":  # the workers serve bytes and crop draws
        transform = gpu_decode.DeferredTransform(transform)
        reader = read_or_defer
    elif train and spec.decoder == "fused":  # the crop window is decoded
        reader = read_or_defer
    dataset: ds.CheckedImageFolder | labels_files.LabelledImageFiles
    if spec.train_labels_file:  # label sets; the index is not read
        splits = _labelled_splits(spec)
        split = splits[0 if train else 1]
        dataset = labels_files.labelled_dataset(splits[0], split, transform, reader)
    else:
        listing = shared_listing(path, key, spec.index_cache, spec.write_index)
        dataset = ds.CheckedImageFolder(path, transform, key, reader, listing)
        _check_class_count(key, path, len(dataset.classes), spec.num_classes)
    return ds.SkipUnreadable(dataset) if spec.skip_corrupt else dataset


def _labelled_splits(spec: DataSpec) -> tuple[labels_files.Split, labels_files.Split]:
    """The train and val splits' folders, keys and labels files."""
    train, val = spec.split_folder(train=True), spec.split_folder(train=False)
    return (*train, spec.train_labels_file), (*val, spec.test_labels_file)


def _shard_dataset(
    spec: DataSpec, train: bool, transform: v2.Transform
) -> ShardedImages:
    """The WebDataset shards of TRAIN.DATASET or TEST.DATASET."""
    key = "TRAIN.DATASET" if train else "TEST.DATASET"
    shards = open_shards(spec.train_dataset if train else spec.test_dataset, key)
    classes = len(shards.classes)
    _check_class_count(key, shards.paths[0], classes, spec.num_classes)
    decode = BytesReader(spec.decoder, train)
    decoder = ShardDecoder(shards, transform, decode, spec.skip_corrupt)
    return ShardedImages(shards, decoder)


def _check_class_count(key: str, path: str, classes: int, num_classes: int) -> None:
    if classes > num_classes:
        raise DataError(
            f"{key} {path} has {classes} classes (labels 0-{classes - 1}) but "
            f"MODEL.NUM_CLASSES is {num_classes}; set MODEL.NUM_CLASSES {classes}"
        )


def check_data(spec: DataSpec, replicas: int | None = None, workers: int = 0) -> None:
    """Check the data ``spec`` names before a run; raise a DataError.

    For webdataset: both shard patterns (see :func:`open_shards`), the same
    classes, no more than MODEL.NUM_CLASSES, and with ``replicas`` (data
    parallel processes of a training run) a shard for each reader (each of
    the ``workers`` loader processes of a replica, TRAIN.WORKERS).

    For imagefolder: both splits have class folders, none of them empty, the
    same classes (labels follow the sorted class names), and no more classes
    than MODEL.NUM_CLASSES.  Cheap: it stops at the first image of each class
    (lists none while the split's index is current: :func:`split_classes`).
    """
    if spec.name == "webdataset":
        _check_shards(spec, replicas, workers)
    if spec.name != "imagefolder":
        return
    if spec.train_labels_file:
        labels_files.check_labels_files(*_labelled_splits(spec), spec.num_classes)
        return
    train_path, train_key = spec.split_folder(train=True)
    val_path, val_key = spec.split_folder(train=False)
    train_classes = split_classes(spec.index_cache, train_path, train_key)
    _check_class_count(train_key, train_path, len(train_classes), spec.num_classes)
    val_classes = split_classes(spec.index_cache, val_path, val_key)
    different = sorted(set(train_classes) ^ set(val_classes))
    if different:
        name = different[0]
        has, lacks = (train_path, val_path)
        if name in val_classes:
            has, lacks = lacks, has
        raise DataError(
            f"{train_key} and {val_key}: class {name} is in {has} but not in "
            f"{lacks}; labels follow the sorted class names, so both need the same"
        )


def _check_shards(spec: DataSpec, replicas: int | None, workers: int) -> None:
    train = open_shards(spec.train_dataset, "TRAIN.DATASET")
    val = open_shards(spec.test_dataset, "TEST.DATASET")
    classes = len(train.classes)
    _check_class_count("TRAIN.DATASET", train.paths[0], classes, spec.num_classes)
    if train.classes != val.classes:
        raise DataError(
            f"TRAIN.DATASET and TEST.DATASET: the class lists beside "
            f"{train.paths[0]} and {val.paths[0]} differ; labels follow them, so "
            "both need the same"
        )
    if replicas is not None and len(train.paths) < replicas * max(1, workers):
        raise DataError(shortage_message(train, replicas, workers))


def count_shard_samples(pattern: str) -> int:
    """The samples of the shards of ``pattern``, from their index."""
    return open_shards(pattern, "TRAIN.DATASET").total


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; derive NumPy's and
    # Python's seeds from it so that every library in the worker is seeded.
    import random

    import numpy as np

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _loader_kwargs(spec: LoaderSpec, device: torch.device) -> dict:
    workers = spec.workers
    return {
        "num_workers": workers,
        "pin_memory": spec.pin_memory and device.type == "cuda",
        "persistent_workers": workers > 0,
        "worker_init_fn": _seed_worker if workers > 0 else None,
        # Never a fork of this (threaded) process: see data/workers.py.
        "multiprocessing_context": worker_context() if workers > 0 else None,
        "collate_fn": gpu_decode.collate_encoded if spec.decoder == "gpu" else None,
    }


def empty_batch(image: torch.Tensor | gpu_decode.EncodedSample):
    """A batch of no images, shaped as ``image`` (a sample of the data set)."""
    if isinstance(image, gpu_decode.EncodedSample):
        return gpu_decode.empty_batch(image)
    return image.new_empty((0, *image.shape))


def stack_images(images: list) -> torch.Tensor:
    """Samples' images as one uint8 batch on the CPU (JPEG bytes of
    DATA.DECODER gpu decoded here)."""
    if images and isinstance(images[0], gpu_decode.EncodedSample):
        batch, _ = gpu_decode.collate_encoded([(image, 0) for image in images])
        return gpu_decode.decode_batch(batch, torch.device("cpu"))
    return torch.stack(images)


def build_train_loader(
    spec: LoaderSpec,
    dataset: ImageDataset,
    *,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    batch_size: int,
) -> DataLoader | ShardLoader:
    """Shuffled, sharded training loader of ``batch_size`` per rank (for
    WebDataset shards a :class:`ShardLoader`, with the same interface).

    Call ``loader.sampler.set_epoch(epoch, start)`` before each epoch. The
    last incomplete batch of a rank is dropped, so that every optimizer step
    has the same size (BatchNorm also needs more than one sample). The
    order: DATA.SAMPLER and DATA.REPEATED_AUG's (see :func:`build_train_sampler`).
    """
    if isinstance(dataset, ShardedImages):
        stream = TrainStream(
            dataset,
            rank=rank,
            world_size=world_size,
            seed=seed,
            batch_size=batch_size,
            workers=spec.workers,
            buffer=spec.shuffle_buffer,
            ramp=spec.ramp,
        )
        return ShardLoader(stream, _loader_kwargs(spec, device))
    where = dict(rank=rank, world_size=world_size, seed=seed)
    sampler = build_train_sampler(spec, dataset, **where)
    return _loader(
        spec,
        device,
        SeededDataset(dataset),
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        # Its own generator: creating an iterator leaves the global RNG alone.
        generator=torch.Generator().manual_seed(seed),
    )


def build_test_loader(
    spec: LoaderSpec,
    dataset: ImageDataset,
    rank: int,
    world_size: int,
    device: torch.device,
) -> DataLoader | ShardLoader:
    """Evaluation loader that visits every sample exactly once across ranks."""
    batch_size = spec.test_batch_size
    if isinstance(dataset, ShardedImages):
        stream = EvalStream(dataset, rank, world_size, batch_size, spec.workers)
        return ShardLoader(stream, _loader_kwargs(spec, device))
    return _loader(
        spec,
        device,
        dataset,
        batch_size=batch_size,
        sampler=ExactShardSampler(len(dataset), rank, world_size),
    )


def _loader(spec: LoaderSpec, device: torch.device, dataset: Dataset, **options):
    """The DataLoader of ``dataset``: a :class:`RingLoader` when workers
    collate images (all but DATA.DECODER gpu's JPEG bytes)."""
    kwargs = {**_loader_kwargs(spec, device), **options}
    ring = kwargs["collate_fn"] is None and kwargs["num_workers"] > 0
    return (RingLoader if ring else DataLoader)(dataset, **kwargs)
