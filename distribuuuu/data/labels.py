"""Training loaders that serve the labels only, for a process whose forward
passes never read the images: a pipeline's later stages, which receive
activations (the last one needs the labels, for the loss and the metrics).

A labels-only loader walks the very sampler (or shard stream) that the full
loader of the same process walks, so each of its batches holds the labels of
the same samples in the same order: mid-epoch starts, repeated augmentation
and the padding of the distributed order included.  No image is read,
decoded or transformed, and no worker process is started.  A batch's images
are a stand-in without memory, ``batch x 0 x size x size`` (TRAIN.IM_SIZE,
the training crop): Mixup and CutMix draw their weight and box from the
batch's shape alone, so a later stage mixes its labels exactly as the first
stage mixes its batch (:meth:`distribuuuu.engine.losses.TrainLoss.mix`).

Where a label is known only once the image is read, the full loader is kept:
DATA.SKIP_CORRUPT serves another sample (and its label) in place of an
unreadable image.  WebDataset shards are read for their labels: the tar
headers and the ``.cls`` members, the images' bytes passed over.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import cast

import torch
from torch.utils.data import DataLoader

from distribuuuu.data import ImageDataset
from distribuuuu.data import datasets as ds
from distribuuuu.data.samplers import ResumableTrainSampler
from distribuuuu.data.shard_streams import ShardLoader, TrainStream
from distribuuuu.data.spec import Loader


def stand_in_images(count: int, size: int) -> torch.Tensor:
    """A batch of ``count`` images of ``size`` x ``size`` pixels and no
    channels: the shape of a batch, without its memory (float32, as the
    normalised images that MixUp scales)."""
    return torch.empty((count, 0, size, size), dtype=torch.float32)


def is_stand_in(images: object) -> bool:
    """Whether a loader's batch of ``images`` is :func:`stand_in_images`."""
    return (
        isinstance(images, torch.Tensor) and images.dim() == 4 and not images.shape[1]
    )


def dataset_labels(dataset: ImageDataset) -> torch.Tensor | None:
    """The label of every sample of a map-style data set, by index; None where
    only reading an image tells (DATA.SKIP_CORRUPT, or shards)."""
    if isinstance(dataset, ds.SkipUnreadable):
        return None
    return ds.stored_labels(dataset)


class SampledLabels:
    """The batches of a map-style training loader as ``(stand-ins, labels)``:
    its sampler's indices, ``batch_size`` at a time, the last part dropped."""

    def __init__(self, loader: DataLoader, labels: torch.Tensor, image_size: int):
        self.sampler = cast(ResumableTrainSampler, loader.sampler)
        self.dataset, self.labels, self.image_size = loader.dataset, labels, image_size
        self.batch_size = loader.batch_size or 1

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor([index for index, *_ in self.sampler], dtype=torch.int64)
        size = self.batch_size
        for start in range(0, len(self) * size, size):
            labels = self.labels[order[start : start + size]]
            yield stand_in_images(size, self.image_size), labels


class StreamLabels:
    """The batches of a :class:`ShardLoader`'s training stream as
    ``(stand-ins, labels)``, every reader's in this process: batch ``b``
    comes from the reader whose turn it is (:meth:`TrainStream.reader_of`),
    as the loader's workers take turns."""

    def __init__(self, loader: ShardLoader, image_size: int):
        self.sampler, self.dataset = loader.sampler, loader.dataset
        self.loader, self.image_size = loader, image_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stream = self.sampler
        assert isinstance(stream, TrainStream)  # a training loader's
        readers = [self._reader(stream, slot) for slot in range(stream.workers)]
        for batch in range(len(self)):
            labels = next(readers[stream.reader_of(batch)])
            yield stand_in_images(len(labels), self.image_size), labels

    @staticmethod
    def _reader(stream: TrainStream, slot: int) -> Iterator[torch.Tensor]:
        """The label batches of reader ``slot``, as its worker would serve them."""
        raws = stream.reader_samples(slot, labels_only=True)
        label = stream.images.decoder.label
        while chunk := list(itertools.islice(raws, stream.batch_size)):
            yield torch.tensor([label(raw)[0] for raw in chunk], dtype=torch.int64)


def labels_only(loader: Loader, dataset: ImageDataset, image_size: int) -> Loader:
    """The training ``loader`` that ``build_train_loader`` built of ``dataset``,
    serving ``(stand-ins, labels)`` batches of ``image_size`` pixels instead
    (module doc; ``loader`` itself is never iterated, so its workers never
    start); ``loader`` as it is where the labels need the images."""
    if isinstance(loader, ShardLoader):
        if loader.dataset.decoder.skip_corrupt:
            return loader
        return StreamLabels(loader, image_size)
    labels = dataset_labels(dataset)
    if labels is None or not isinstance(loader, DataLoader):
        return loader
    return SampledLabels(loader, labels, image_size)


__all__ = ["dataset_labels", "is_stand_in", "labels_only", "stand_in_images"]
