"""Train and test transforms for small in-memory images and ImageNet-style files."""

from __future__ import annotations

import torch
from torchvision.transforms import v2


def small_image_transforms(
    train: bool,
    im_size: int,
    native_size: int,
    mean: tuple,
    std: tuple,
    flip: bool,
) -> v2.Compose:
    """Transforms for uint8 tensors of 28-32 px images (digits, CIFAR).

    Training: random crop of ``im_size`` after zero padding by 1/8 of the size
    (4 px at 32 px, as in He et al. 2016 for CIFAR; 3 px at 28 px), plus a
    horizontal flip where the classes allow it (not for digits).  Testing:
    the full image.  Images are first resized when ``im_size`` differs from
    their native size.
    """
    steps: list = []
    if im_size != native_size:
        steps.append(v2.Resize(im_size, antialias=True))
    if train:
        steps.append(v2.RandomCrop(im_size, padding=max(1, im_size // 8)))
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


def imagenet_transforms(
    train: bool, train_size: int, test_size: int, mean: tuple, std: tuple
) -> v2.Compose:
    """ImageNet-style transforms for PIL images.

    Training: RandomResizedCrop(train_size) and a horizontal flip.  Testing:
    resize the shorter side to ``test_size``, then centre-crop ``train_size``
    (256 -> 224 in the usual ImageNet recipe).
    """
    if train:
        steps = [
            v2.RandomResizedCrop(train_size, antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    else:
        steps = [v2.Resize(test_size, antialias=True), v2.CenterCrop(train_size)]
    steps += [
        v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ]
    return v2.Compose(steps)
