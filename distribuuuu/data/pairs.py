"""mnist5k_pairs: the embedded multi-label task, two digits side by side.

Each image is a 56 x 56 canvas holding two of the embedded 28 x 28 digits
(:func:`~distribuuuu.data.datasets.load_mnist5k`) next to each other,
vertically centred; its label set is the pair's digits: one class when both
digits are the same, two otherwise.  A split has as many pairs as digits:
digit ``i`` on the left, and on the right the digit that a permutation drawn
from :data:`PAIRS_SEED` (a constant, not RNG_SEED) puts at ``i``, so every
digit appears once on each side.  Training pairs are made of training
digits, validation pairs of validation digits, and the validation set is the
same in every run.
"""

from __future__ import annotations

import numpy as np
import torch

from distribuuuu.data.datasets import load_mnist5k

# The permutation's seed. NumPy's legacy RandomState keeps its stream
# unchanged across releases (NEP 19), so the pairs never change either.
PAIRS_SEED = 37
DIGIT, CANVAS = 28, 56
CLASSES = 10
# Per-channel mean and std of the canvas pixels in [0, 1] (of the training
# pairs: half of a canvas is blank, so both are below MNIST's).
PAIRS_MEAN, PAIRS_STD = (0.0656,) * 3, (0.2277,) * 3


def pair_up(
    images: torch.Tensor, labels: torch.Tensor, seed: int = PAIRS_SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-digit canvases of ``images`` (uint8 ``N x 1 x 28 x 28``) and their
    multi-hot targets: canvas ``i`` shows digit ``i`` and digit ``p[i]`` of a
    permutation ``p`` drawn from ``seed``."""
    count = len(images)
    partner = torch.from_numpy(np.random.RandomState(seed).permutation(count))
    canvas = torch.zeros((count, 1, CANVAS, CANVAS), dtype=torch.uint8)
    top = (CANVAS - DIGIT) // 2
    canvas[:, :, top : top + DIGIT, :DIGIT] = images
    canvas[:, :, top : top + DIGIT, DIGIT : 2 * DIGIT] = images[partner]
    targets = torch.zeros((count, CLASSES), dtype=torch.float32)
    rows = torch.arange(count)
    targets[rows, labels] = 1.0
    targets[rows, labels[partner]] = 1.0
    return canvas, targets


def load_mnist5k_pairs(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The train or val pairs: uint8 canvases and float32 multi-hot targets."""
    images, labels = load_mnist5k(train)
    return pair_up(images, labels)
