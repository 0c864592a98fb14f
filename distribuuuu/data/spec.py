"""What the data package needs to know of a run: small frozen specs.

:class:`DataSpec` says which images a run reads and how they are turned into
tensors (:class:`TransformSpec`); :class:`LoaderSpec` says how the loaders
serve them.  The engine fills every field from the config
(:mod:`distribuuuu.engine.specs`); the defaults are the "off" of what only
training uses and "none" for the data set's files, so that a spec of the
evaluation transforms alone (an exported model's) names only what they read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SizeRamp:
    """TRAIN.PROGRESSIVE: the training crop of each epoch, growing linearly
    from ``start_size`` at ``start_epoch`` to ``end_size`` at ``end_epoch``
    (both counted from 0; ``end_epoch`` resolved from 0 to the last epoch).

    :meth:`size` is FFCV's schedule (ffcv-imagenet ``train_imagenet.py``,
    ``get_resolution``): the start size up to ``start_epoch``, the end size
    from ``end_epoch``, and between them ``np.interp`` of the epoch rounded
    to the nearest multiple (``int(np.round(x / 32)) * 32``, ties to even,
    as Python's ``round``); unlike FFCV's, a rounded size is clamped into
    [start_size, end_size], so that no epoch trains beyond the end size.
    """

    start_size: int
    end_size: int
    start_epoch: int
    end_epoch: int
    multiple: int = 1

    def size(self, epoch: int) -> int:
        """The training crop of ``epoch``, in pixels: a function of it alone."""
        if epoch <= self.start_epoch:
            return self.start_size
        if epoch >= self.end_epoch:
            return self.end_size
        done = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        linear = self.start_size + done * (self.end_size - self.start_size)
        rounded = round(linear / self.multiple) * self.multiple
        return min(max(rounded, self.start_size), self.end_size)

    def sizes(self, epochs: int) -> list[int]:
        """The crop of each of the first ``epochs`` epochs."""
        return [self.size(epoch) for epoch in range(epochs)]


@dataclass(frozen=True)
class TransformSpec:
    """The sizes, flips, interpolations and augmentations of the transforms."""

    im_size: int  # TRAIN.IM_SIZE: the training crop
    test_im_size: int  # TEST.IM_SIZE: the evaluation resize
    test_crop_size: int = 0  # TEST.CROP_SIZE; 0: im_size
    test_crop_pct: float = 0.0  # TEST.CROP_PCT; set: resize = crop / pct
    test_interpolation: str = "bilinear"  # TEST.INTERPOLATION
    device_crops: bool = False  # TEST.TTA crops its views on the device
    # Training only.
    train_interpolation: str = "bilinear"  # TRAIN.INTERPOLATION
    hflip: float = -1.0  # TRAIN.HFLIP; negative: the data set's own
    auto_augment: str = "none"  # DATA.AUTO_AUGMENT
    randaug_n: int = 2  # DATA.RANDAUG_N
    randaug_m: int = 9  # DATA.RANDAUG_M
    randaug_mstd: float = 0.0  # DATA.RANDAUG_MSTD; > 0 (or INC): timm's
    randaug_inc: bool = False  # DATA.RANDAUG_INC
    random_erasing: float = 0.0  # DATA.RANDOM_ERASING
    # TRAIN.PROGRESSIVE (im_size is then its end size); None: off
    ramp: SizeRamp | None = None


@dataclass(frozen=True)
class DataSpec:
    """The data set of a run: which one, where, how its images are read."""

    name: str  # DATA.NAME, resolved (never "auto")
    transform: TransformSpec
    num_classes: int  # MODEL.NUM_CLASSES: the labels the model has
    decoder: str  # DATA.DECODER
    # Where the splits lie: none by default (a spec that builds transforms).
    train_dataset: str = ""  # TRAIN.DATASET
    train_split: str = ""  # TRAIN.SPLIT
    test_dataset: str = ""  # TEST.DATASET
    test_split: str = ""  # TEST.SPLIT
    download: bool = False  # DATA.DOWNLOAD
    skip_corrupt: bool = False  # DATA.SKIP_CORRUPT
    synthetic_size: tuple[int, int] = (0, 0)  # DATA.SYNTHETIC_SIZE: train, val
    # imagefolder: the folder of the splits' index files (DATA.INDEX_CACHE,
    # resolved; "" none), and whether a new index is written there (by a
    # training or evaluation run: not by a dry run, a tool or a test).
    index_cache: str = ""
    write_index: bool = False
    # imagefolder with label sets: the CSVs of TRAIN.LABELS_FILE and
    # TEST.LABELS_FILE ("" none: the class folders' single labels).
    train_labels_file: str = ""
    test_labels_file: str = ""

    def split_folder(self, train: bool) -> tuple[str, str]:
        """The folder of the train or val split (imagefolder) and the config
        keys naming it."""
        if train:
            path = os.path.join(self.train_dataset, self.train_split)
            return path, "TRAIN.DATASET/TRAIN.SPLIT"
        path = os.path.join(self.test_dataset, self.test_split)
        return path, "TEST.DATASET/TEST.SPLIT"


@dataclass(frozen=True)
class LoaderSpec:
    """How the loaders serve a data set's samples."""

    workers: int  # TRAIN.WORKERS: loader processes per rank
    pin_memory: bool  # TRAIN.PIN_MEMORY (on CUDA only)
    decoder: str  # DATA.DECODER: gpu collates JPEG bytes
    shuffle_buffer: int  # DATA.SHUFFLE_BUFFER of WebDataset shards
    repeated_aug: int  # DATA.REPEATED_AUG
    test_batch_size: int  # TEST.BATCH_SIZE
    sampler: str = "random"  # DATA.SAMPLER: how training draws its samples
    repeat_threshold: float = 0.001  # DATA.REPEAT_THRESHOLD of repeat_factor
    # TRAIN.PROGRESSIVE: each epoch's training crop, which the training
    # loader's requests carry to its workers; None: off
    ramp: SizeRamp | None = None


class Loader(Protocol):
    """What the engine reads of a loader: a DataLoader, a ShardLoader, the
    watchdog's WatchedLoader or the benchmark's InMemoryLoader."""

    sampler: Any  # its set_epoch(epoch, start=0) comes before an epoch
    dataset: Any  # the samples, by position

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator: ...
