"""The plain PyTorch loops that tools/benchmark.py measures our training loop
and evaluation against, and the in-memory batches both sides get."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn


class InMemoryLoader:
    """``steps`` batches cycled from a list, shaped like a training DataLoader.

    It has what ``train_epoch`` and ``evaluate`` read (``len``, iteration,
    ``sampler.set_epoch``, ``dataset``), so both sides get the very same
    tensors with no loading cost.
    """

    class _Sampler:
        def set_epoch(self, epoch: int, start: int = 0) -> None:
            """Nothing to shuffle."""

    def __init__(self, batches: list, steps: int):
        self.batches, self.steps = batches, steps
        self.sampler = self._Sampler()
        self.dataset = [(batches[0][0][0], 0)]

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator:
        return (self.batches[i % len(self.batches)] for i in range(self.steps))


def make_batches(count: int, batch: int, im_size: int, classes: int) -> list:
    """``count`` batches of random uint8 images and labels, as loaders give them."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch, 3, im_size, im_size)
    return [
        (
            torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator),
            torch.randint(classes, (batch,), generator=generator),
        )
        for _ in range(count)
    ]


def minimal_train(
    model: nn.Module,
    loader,
    optimizer: torch.optim.Optimizer,
    amp_dtype: torch.dtype | None,
    device: torch.device,
) -> Callable:
    """One repeat of the plain loop of the tutorials; returns the images done.

    ``optimizer`` (over ``model``'s parameters) should have the recipe's
    settings, so that the comparison measures the framework, not another
    optimizer.
    """
    criterion = nn.CrossEntropyLoss()

    def repeat() -> float:
        model.train()
        for images, targets in loader:
            images, targets = images.to(device), targets.to(device)
            with torch.autocast(device.type, amp_dtype, enabled=amp_dtype is not None):
                loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
        return len(loader) * len(images)

    return repeat


def minimal_eval(
    model: nn.Module, loader, amp_dtype: torch.dtype | None, device: torch.device
) -> Callable:
    """One repeat of a plain no-grad evaluation loop; returns the images done."""

    @torch.no_grad()
    def repeat() -> float:
        model.eval()
        correct = 0
        for images, targets in loader:
            images, targets = images.to(device), targets.to(device)
            with torch.autocast(device.type, amp_dtype, enabled=amp_dtype is not None):
                correct += (model(images).argmax(1) == targets).sum().item()
        return len(loader) * len(images)

    return repeat
