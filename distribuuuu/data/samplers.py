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

    Each epoch has one global order of ``size`` positions padded to a multiple
    of the world size: a permutation drawn from ``seed + epoch`` (the same for
    any world size), each of its entries repeated ``repeats`` times in a row
    and the result cut to that length; rank r takes positions r, r + W,
    r + 2W, ...  :meth:`set_epoch` with ``start`` skips the first ``start``
    positions of the global order: the samples the run consumed before it
    stopped, even when it stopped with another world size.

    Repeated augmentation (``repeats`` k > 1; Hoffer et al. 2020, DeiT's
    RASampler): the epoch keeps its length L but holds the first ceil(L / k)
    entries of the permutation (all of them when that exceeds the size), each
    k times; the k copies sit at consecutive positions, so on k or more ranks
    they go to k different ranks (at the same or the next step). Copy r of
    sample i in epoch e is augmented with ``sample_seed(seed, e * k + r, i)``,
    so every copy looks different; with k = 1 the order and the seeds are
    those without repetition.

    It yields ``(index, seed)`` pairs; :class:`SeededDataset` seeds the
    augmentation of each sample with ``seed``, so augmentation depends on
    (RNG_SEED, epoch, index, copy) only: not on workers, world size or restarts.
    """

    def __init__(
        self, size: int, rank: int, world_size: int, seed: int, repeats: int = 1
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.repeats = repeats
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use ``epoch``'s order, beginning at global position ``start``."""
        self.epoch, self.start = epoch, start

    def _length(self) -> int:
        """Positions of an epoch's global order: the size padded to the world."""
        return self.size + (-self.size % self.world_size)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        k = self.repeats
        for position in range(self.start + self.rank, self._length(), self.world_size):
            copy, index = position % k, order[position // k % self.size]
            yield index, sample_seed(self.seed, self.epoch * k + copy, index)

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self._length(), self.world_size))
