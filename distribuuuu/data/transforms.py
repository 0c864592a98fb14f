"""Train and test transforms for small in-memory images and ImageNet-style files."""

from __future__ import annotations

import torch
from torchvision.transforms import v2


def auto_augment(
    name: str, policy: str = "imagenet", num_ops: int = 2, magnitude: int = 9
) -> v2.Transform | None:
    """The auto-augment transform ``name`` (DATA.AUTO_AUGMENT); None for none.

    Args:
        name: none | randaugment | trivialaugment | autoaugment.
        policy: AutoAugment's learned policy: imagenet | cifar10 | svhn.
        num_ops, magnitude: RandAugment's N and M (M on its 0-30 scale).

    Bilinear interpolation, as torchvision's classification reference uses.
    They take uint8 tensors or PIL images, so they come before ToDtype.
    """
    bilinear = v2.InterpolationMode.BILINEAR
    if name == "none":
        return None
    if name == "randaugment":
        return v2.RandAugment(num_ops, magnitude, interpolation=bilinear)
    if name == "trivialaugment":
        return v2.TrivialAugmentWide(interpolation=bilinear)
    if name == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy(policy), interpolation=bilinear)
    raise ValueError(f"unknown auto-augment {name!r}")


class ToNormalizedFloat(torch.nn.Module):
    """A uint8 image (C x H x W) as float32 ``(x / 255 - mean) / std``.

    What ``v2.ToDtype(torch.float32, scale=True)`` followed by
    ``v2.Normalize(mean, std)`` give (up to float rounding), in two in-place
    passes over one new tensor instead of four passes over three: about 0.1 ms
    less per 224 px image, 5% of our loader's time per image on a 2-core CPU.
    """

    def __init__(self, mean: tuple, std: tuple):
        super().__init__()
        self.shift = torch.tensor(mean, dtype=torch.float32).mul(255).view(-1, 1, 1)
        self.scale = 1 / torch.tensor(std, dtype=torch.float32).mul(255).view(-1, 1, 1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype != torch.uint8:
            raise TypeError(f"expected a uint8 image, got {image.dtype}")
        return image.to(torch.float32).sub_(self.shift).mul_(self.scale)


def _to_normalized(
    mean: tuple, std: tuple, augment: v2.Transform | None, erasing: float
) -> list:
    """The end of a pipeline: auto-augment on uint8, float, normalise, erase."""
    steps = [] if augment is None else [augment]
    steps.append(ToNormalizedFloat(mean, std))
    if erasing > 0:
        # After normalisation, as in torchvision's reference: erased pixels
        # become 0, the mean colour.
        steps.append(v2.RandomErasing(p=erasing))
    return steps


def small_image_transforms(
    train: bool,
    im_size: int,
    native_size: int,
    mean: tuple,
    std: tuple,
    flip: bool,
    augment: v2.Transform | None = None,
    erasing: float = 0.0,
) -> v2.Compose:
    """Transforms for uint8 tensors of 28-32 px images (digits, CIFAR).

    Training: random crop of ``im_size`` after zero padding by 1/8 of the size
    (4 px at 32 px, as in He et al. 2016 for CIFAR; 3 px at 28 px), plus a
    horizontal flip where the classes allow it (not for digits), then
    ``augment`` (see :func:`auto_augment`) and, after normalisation, random
    erasing with probability ``erasing``.  Testing: the full image (no
    ``augment``, no erasing).  Images are first resized when ``im_size``
    differs from their native size.
    """
    steps: list = []
    if im_size != native_size:
        steps.append(v2.Resize(im_size, antialias=True))
    if train:
        steps.append(v2.RandomCrop(im_size, padding=max(1, im_size // 8)))
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    else:
        augment, erasing = None, 0.0
    return v2.Compose(steps + _to_normalized(mean, std, augment, erasing))


def imagenet_transforms(
    train: bool,
    train_size: int,
    test_size: int,
    mean: tuple,
    std: tuple,
    augment: v2.Transform | None = None,
    erasing: float = 0.0,
) -> v2.Compose:
    """ImageNet-style transforms for PIL images or uint8 tensors (3 x H x W).

    Both draw the same random numbers; on tensors the resizes use torch's
    antialiased bilinear kernel instead of PIL's (pixel values differ by
    rounding) and run faster (1.2-1.7x with the decoding, ``tools/benchmark.py``).

    Training: RandomResizedCrop(train_size), a horizontal flip, ``augment``
    (on the uint8 image) and, after normalisation, random erasing with
    probability ``erasing``.  Testing: resize the shorter side to
    ``test_size``, then centre-crop ``train_size`` (256 -> 224 in the usual
    ImageNet recipe), without ``augment`` or erasing.
    """
    if train:
        steps = [
            v2.RandomResizedCrop(train_size, antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    else:
        steps = [v2.Resize(test_size, antialias=True), v2.CenterCrop(train_size)]
        augment, erasing = None, 0.0
    steps.append(v2.PILToTensor())
    return v2.Compose(steps + _to_normalized(mean, std, augment, erasing))
