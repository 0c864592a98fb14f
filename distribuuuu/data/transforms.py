"""Train and test transforms for small in-memory images and ImageNet-style files."""

from __future__ import annotations

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from distribuuuu.data.jpeg import JpegFile, pack_channels
from distribuuuu.data.randaugment import TimmRandAugment
from distribuuuu.data.spec import TransformSpec

# The TEST.TTA modes whose views are crops of a bigger evaluation image
# (their views: engine/tta.py).
CROP_MODES = ("five_crop", "ten_crop")


def auto_augment(
    spec: TransformSpec, policy: str = "imagenet", mean: tuple = (0.5, 0.5, 0.5)
) -> v2.Transform | None:
    """The auto-augment transform of DATA.AUTO_AUGMENT; None for none.

    Args:
        spec: its ``auto_augment`` (none | randaugment | trivialaugment |
            autoaugment) and RandAugment's N, M (on torchvision's 0-30 scale),
            MSTD and INC.
        policy: AutoAugment's learned policy: imagenet | cifar10 | svhn.
        mean: the data set's mean colour (0-1), which timm's RandAugment fills
            uncovered pixels with.

    randaugment is torchvision's ``v2.RandAugment`` while DATA.RANDAUG_MSTD is 0
    and DATA.RANDAUG_INC False (the random numbers and pixels of the runs made
    before those keys), else timm's (:class:`TimmRandAugment`).  Bilinear
    interpolation, as torchvision's classification reference uses.  They work
    on uint8 tensors (torchvision's on PIL images too), like every step before
    the device.
    """
    bilinear = v2.InterpolationMode.BILINEAR
    name = spec.auto_augment
    if name == "none":
        return None
    if name == "randaugment" and (spec.randaug_mstd > 0 or spec.randaug_inc):
        return TimmRandAugment(
            spec.randaug_n,
            spec.randaug_m,
            magnitude_std=spec.randaug_mstd,
            increasing=spec.randaug_inc,
            fill=tuple(round(m * 255) for m in mean),
            interpolation=bilinear,
        )
    if name == "randaugment":
        return v2.RandAugment(spec.randaug_n, spec.randaug_m, interpolation=bilinear)
    if name == "trivialaugment":
        return v2.TrivialAugmentWide(interpolation=bilinear)
    if name == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy(policy), interpolation=bilinear)
    raise ValueError(f"unknown auto-augment {name!r}")


class ToNormalizedFloat(torch.nn.Module):
    """uint8 images (C x H x W, or a batch N x C x H x W) as float32
    ``(x / 255 - mean) / std`` on the device of the module (``.to(device)``):
    the last step of the input pipeline.

    The data sets serve uint8 images and the trainer passes each batch through
    this, which copies it to the device (non-blocking) and normalises it
    there: a quarter of the bytes between the loader's workers and the main
    process, and over PCIe, and no float work in the workers (timm's
    ``PrefetchLoader`` normalises on the GPU for the same reasons).  One
    conversion and two in-place passes give what ``v2.ToDtype(torch.float32,
    scale=True)`` then ``v2.Normalize(mean, std)`` give, up to float rounding.
    With ``channels_last`` a batch comes out in that layout, which a
    channels-last model would otherwise copy it into.
    """

    shift: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, mean: tuple, std: tuple, channels_last: bool = False):
        super().__init__()
        self.mean, self.std = tuple(mean), tuple(std)
        shift = torch.tensor(mean, dtype=torch.float32).mul(255).view(-1, 1, 1)
        scale = 1 / torch.tensor(std, dtype=torch.float32).mul(255).view(-1, 1, 1)
        self.register_buffer("shift", shift, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.channels_last = channels_last

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"expected uint8 images, got {images.dtype}")
        images = images.to(self.shift.device, non_blocking=True)
        layout = torch.preserve_format
        if self.channels_last and images.dim() == 4:
            layout = torch.channels_last
        images = images.to(torch.float32, memory_format=layout)
        return images.sub_(self.shift).mul_(self.scale)


def shape_only(height: int, width: int) -> torch.Tensor:
    """A 3 x height x width tensor without memory, for the size queries of a
    transform's parameter draws."""
    return torch.empty((), dtype=torch.uint8).expand(3, height, width)


class ResizedCropFlip(torch.nn.Module):
    """``v2.RandomResizedCrop(size)`` then ``v2.RandomHorizontalFlip(flip)``
    of a uint8 tensor, or of a :class:`~distribuuuu.data.jpeg.JpegFile` not
    yet decoded, in one step (``DATA.DECODER fused``).

    The same random numbers in the same order (the crop is drawn by the v2
    transform's own ``make_params``, the flip by one ``torch.rand(1)`` when
    ``flip`` > 0) and the same kernels, so the same pixels; without the two
    transforms' per-call dispatch, and with the crop packed for the resize
    (:func:`pack_channels`).  A JPEG's crop is drawn from the size in its
    header and only that window is decoded (:meth:`JpegFile.window`).
    """

    def __init__(self, size: int, interpolation: v2.InterpolationMode, flip: float):
        super().__init__()
        self.crop = v2.RandomResizedCrop(
            size, interpolation=interpolation, antialias=True
        )
        self.flip = flip

    def forward(self, image: torch.Tensor | JpegFile) -> torch.Tensor:
        if isinstance(image, JpegFile):
            shape = shape_only(image.header.height, image.header.width)
            box = self.crop.make_params([shape])
            window = image.window(**box)
        else:
            box = self.crop.make_params([image])
            window = pack_channels(F.crop_image(image, **box))
        mode, size = self.crop.interpolation, self.crop.size
        resized = F.resize_image(window, size, interpolation=mode, antialias=True)
        if self.flip > 0 and torch.rand(1) < self.flip:
            resized = F.horizontal_flip_image(resized)
        return resized


def _train_end(mean: tuple, augment: v2.Transform | None, erasing: float) -> list:
    """The end of a training pipeline: auto-augment, then random erasing.

    Both work on the uint8 image.  Erased pixels take the mean colour (rounded
    to uint8), which normalises to 0 up to 0.01: what torchvision's reference
    gets by erasing with 0 after normalisation, from the same random numbers.
    """
    steps = [] if augment is None else [augment]
    if erasing > 0:
        steps.append(v2.RandomErasing(p=erasing, value=[round(m * 255) for m in mean]))
    return steps


# TRAIN.INTERPOLATION / TEST.INTERPOLATION -> torchvision's mode.
INTERPOLATIONS = {
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
}


def small_image_transforms(
    train: bool,
    im_size: int,
    native_size: int,
    mean: tuple,
    flip: float,
    augment: v2.Transform | None = None,
    erasing: float = 0.0,
    interpolation: str = "bilinear",
) -> v2.Transform:
    """Transforms of uint8 tensors of 28-32 px images (digits, CIFAR) to uint8.

    Training: random crop of ``im_size`` after zero padding by 1/8 of the size
    (4 px at 32 px, as in He et al. 2016 for CIFAR; 3 px at 28 px), plus a
    horizontal flip with probability ``flip`` (0 for digits), then
    ``augment`` (see :func:`auto_augment`) and random erasing with
    probability ``erasing`` (in the ``mean`` colour).  Testing: the full image
    (no ``augment``, no erasing).  Images are first resized when ``im_size``
    differs from their native size.  :class:`ToNormalizedFloat` follows, on
    the device.
    """
    steps: list = []
    if im_size != native_size:
        mode = INTERPOLATIONS[interpolation]
        steps.append(v2.Resize(im_size, interpolation=mode, antialias=True))
    if train:
        steps.append(v2.RandomCrop(im_size, padding=max(1, im_size // 8)))
        if flip > 0:
            steps.append(v2.RandomHorizontalFlip(flip))
    else:
        augment, erasing = None, 0.0
    steps += _train_end(mean, augment, erasing)
    return v2.Compose(steps) if steps else v2.Identity()


def imagenet_transforms(
    train: bool,
    train_size: int,
    test_size: int,
    mean: tuple,
    augment: v2.Transform | None = None,
    erasing: float = 0.0,
    crop_size: int = 0,
    flip: float = 0.5,
    interpolation: str = "bilinear",
    fused: bool = False,
) -> v2.Compose:
    """ImageNet-style transforms of PIL images or uint8 tensors (3 x H x W) to
    uint8 tensors.

    Both draw the same random numbers; on tensors the resizes use torch's
    antialiased bilinear kernel instead of PIL's (pixel values differ by
    rounding) and run faster (1.2-1.7x with the decoding, ``tools/benchmark.py``).

    Training: RandomResizedCrop(train_size), a horizontal flip with
    probability ``flip``, ``augment`` and random erasing with probability
    ``erasing`` (in the ``mean`` colour).  Testing: resize the shorter side to
    ``test_size``, then centre-crop ``crop_size`` (0: ``train_size``; 256 ->
    224 in the usual ImageNet recipe), without ``augment`` or erasing.  Both
    resample with ``interpolation``.  :class:`ToNormalizedFloat` follows, on
    the device.  With ``fused`` (tensors only) the training crop and flip are
    one :class:`ResizedCropFlip`: the same random numbers and pixels.
    """
    mode = INTERPOLATIONS[interpolation]
    if train and fused:
        return v2.Compose(
            [ResizedCropFlip(train_size, mode, flip)]
            + _train_end(mean, augment, erasing)
        )
    if train:
        steps = [v2.RandomResizedCrop(train_size, interpolation=mode, antialias=True)]
        if flip > 0:
            steps.append(v2.RandomHorizontalFlip(flip))
    else:
        steps = [
            v2.Resize(test_size, interpolation=mode, antialias=True),
            v2.CenterCrop(crop_size or train_size),
        ]
        augment, erasing = None, 0.0
    steps.append(v2.PILToTensor())
    return v2.Compose(steps + _train_end(mean, augment, erasing))
