"""Samplers: shuffled and padded for training, exact for evaluation."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ExactShardSampler(Sampler[int]):
    """Every index exactly once across ranks: rank r gets r, r + W, r + 2W, ...

    Unlike ``DistributedSampler`` it never pads, so ranks may hold one sample
    less than others; evaluation sums correct predictions and sample counts
    over ranks, so the result equals a single-process evaluation.
    """

    def __init__(self, size: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.size, self.rank, self.world_size = size, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s augmentation in ``epoch``."""
    return ((seed * 1_000_003 + epoch) * 10_000_019 + index) % 2**63


class ResumableTrainSampler(Sampler[tuple[int, int]]):
    """Shuffled, sharded training order that can start mid-epoch.

    Each epoch has one global order: a permutation drawn from ``seed + epoch``
    (the same for any world size), padded by repeating its start until it
    divides among the ranks; rank r takes positions r, r + W, r + 2W, ...
    :meth:`set_epoch` with ``start`` skips the first ``start`` positions of
    the global order: the samples the run consumed before it stopped, even when
    it stopped with another world size.

    It yields ``(index, seed)`` pairs; :class:`SeededDataset` seeds the
    augmentation of each sample with ``seed``, so augmentation depends on
    (RNG_SEED, epoch, index) only: not on workers, world size or restarts.
    """

    def __init__(self, size: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use ``epoch``'s order, beginning at global position ``start``."""
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        pad = -self.size % self.world_size
        order += (order * (pad // max(self.size, 1) + 1))[:pad]
        return order[self.start + self.rank :: self.world_size]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self._indices():
            yield index, sample_seed(self.seed, self.epoch, index)

    def __len__(self) -> int:
        padded = self.size + (-self.size % self.world_size)
        return len(range(self.start + self.rank, padded, self.world_size))
