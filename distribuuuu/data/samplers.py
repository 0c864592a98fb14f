"""Samplers: shuffled and padded for training, exact for evaluation."""

from __future__ import annotations

from collections.abc import Iterator

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
