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
    random_erasing: float = 0.0  # DATA.RANDOM_ERASING


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


class Loader(Protocol):
    """What the engine reads of a loader: a DataLoader, a ShardLoader, the
    watchdog's WatchedLoader or the benchmark's InMemoryLoader."""

    sampler: Any  # its set_epoch(epoch, start=0) comes before an epoch
    dataset: Any  # the samples, by position

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator: ...
