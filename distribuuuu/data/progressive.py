"""TRAIN.PROGRESSIVE: the training transforms take each epoch's crop size.

The size of an epoch is :meth:`~distribuuuu.data.spec.SizeRamp.size` of the
epoch alone.  It reaches the transforms with the work, never through state
that a loader worker could read too early or too late: a training request of
the map-style data sets is ``(index, seed, size)`` (the sampler writes the
size of the epoch it orders), and a WebDataset reader reads the epoch when
its iteration starts (:class:`~distribuuuu.data.shard_streams.TrainStream`).
Before it transforms a sample of another size, a process (the main one, or
a persistent loader worker) sets that size on its copy of the transforms
(:func:`set_crop_size`), so batches prefetched for the next epoch have the
next epoch's size, and workers are never rebuilt.
"""

from __future__ import annotations

from typing import Any

from torchvision.transforms import v2

from distribuuuu.data.gpu_decode import DeferredTransform
from distribuuuu.data.transforms import ResizedCropFlip


def _padding(size: int) -> list[int]:
    """The zero padding of a small image's random crop of ``size`` (1/8 of it,
    as :func:`~distribuuuu.data.transforms.small_image_transforms` pads)."""
    return [max(1, size // 8)] * 4


def set_crop_size(transform: Any, size: int) -> None:
    """Make the training ``transform`` crop ``size`` x ``size`` pixels.

    It sets the size of the steps that fix it: RandomResizedCrop (and the
    fused :class:`ResizedCropFlip`), and of the small images' Resize then
    RandomCrop (whose padding follows the size); of a :class:`DeferredTransform`
    (DATA.DECODER gpu) its pipeline's and its device geometry's, which each
    batch carries to the main process, where the crop happens on the device.
    """
    if isinstance(transform, DeferredTransform):
        set_crop_size(transform.pipeline, size)
        transform.geometry.size = (size, size)
    elif isinstance(transform, v2.Compose):
        for step in transform.transforms:
            set_crop_size(step, size)
    elif isinstance(transform, ResizedCropFlip):
        transform.crop.size = (size, size)
    elif isinstance(transform, v2.RandomResizedCrop):
        transform.size = (size, size)
    elif isinstance(transform, v2.Resize):
        transform.size = [size]
    elif isinstance(transform, v2.RandomCrop):
        transform.size, transform.padding = (size, size), _padding(size)


def training_transform(dataset: Any) -> Any:
    """The transform of a training data set, through the wrappers that hold
    it (``SkipUnreadable``'s ``dataset``, WebDataset's ``decoder``)."""
    while not hasattr(dataset, "transform"):
        dataset = getattr(dataset, "dataset", None) or dataset.decoder
    return dataset.transform


class CropSizer:
    """Sets a size on a transform when it changes (a no-op otherwise)."""

    def __init__(self, transform: Any):
        self.transform, self.size = transform, 0

    def __call__(self, size: int) -> None:
        if size != self.size:
            set_crop_size(self.transform, size)
            self.size = size
