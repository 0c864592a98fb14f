"""Samplers: shuffled or drawn by class and padded for training, exact for
evaluation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler

from distribuuuu.data import datasets as ds
from distribuuuu.data.progressive import CropSizer, training_transform
from distribuuuu.data.spec import LoaderSpec, SizeRamp

# A sample's labels: one class, or (multi-label data) a list of classes.
Labels = torch.Tensor | Sequence[int | Sequence[int]]


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


class ResumableTrainSampler(Sampler[tuple[int, ...]]):
    """Shuffled, sharded training order that can start mid-epoch.

    Each epoch has one global order of ``size`` positions padded to a multiple
    of the world size: ``size`` draws from ``seed + epoch`` (the same for any
    world size), each of its entries repeated ``repeats`` times in a row and
    the result cut to that length; rank r takes positions r, r + W, r + 2W,
    ...  :meth:`set_epoch` with ``start`` skips the first ``start`` positions
    of the global order: the samples the run consumed before it stopped, even
    when it stopped with another world size.

    The draws are a permutation, or with per-sample ``weights`` (DATA.SAMPLER
    other than random: :func:`sample_weights`) ``size`` independent draws
    with replacement, sample i with probability ``weights[i] / sum(weights)``;
    an epoch keeps its length either way.

    Repeated augmentation (``repeats`` k > 1; Hoffer et al. 2020, DeiT's
    RASampler): the epoch keeps its length L but holds the first ceil(L / k)
    draws (all of them when that exceeds the size), each k times; the k copies
    sit at consecutive positions, so on k or more ranks they go to k
    different ranks (at the same or the next step). Copy r of sample i in
    epoch e is augmented with ``sample_seed(seed, e * k + r, i)``, so every
    copy looks different; with k = 1 the order and the seeds are those
    without repetition.  Drawn with replacement, a sample may come up in
    several draws: the j-th draw's copies take ``i + size * j`` for ``i``, so
    that each draw looks different too.

    It yields ``(index, seed)`` pairs; :class:`SeededDataset` seeds the
    augmentation of each sample with ``seed``, so augmentation depends on
    (RNG_SEED, epoch, draw, copy) only: not on workers, world size or restarts.
    With a ``ramp`` (TRAIN.PROGRESSIVE) it yields ``(index, seed, size)``,
    ``size`` the epoch's training crop, which the data set's transforms take.
    """

    def __init__(
        self,
        size: int,
        rank: int,
        world_size: int,
        seed: int,
        repeats: int = 1,
        weights: torch.Tensor | None = None,
        ramp: SizeRamp | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if weights is not None and weights.shape != (size,):
            raise ValueError(f"{tuple(weights.shape)} weights for {size} samples")
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.repeats, self.weights, self.ramp = repeats, weights, ramp
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use ``epoch``'s order, beginning at global position ``start``."""
        self.epoch, self.start = epoch, start

    def _length(self) -> int:
        """Positions of an epoch's global order: the size padded to the world."""
        return self.size + (-self.size % self.world_size)

    def draws(self) -> list[int]:
        """The epoch's ``size`` draws of sample indices, before the repeats."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.weights is None:
            return torch.randperm(self.size, generator=generator).tolist()
        return torch.multinomial(
            self.weights, self.size, replacement=True, generator=generator
        ).tolist()

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        order, k = self.draws(), self.repeats
        size = () if self.ramp is None else (self.ramp.size(self.epoch),)
        # A permutation draws each sample once: its index alone names the draw.
        once = 0 if self.weights is None else self.size
        for position in range(self.start + self.rank, self._length(), self.world_size):
            copy, draw = position % k, position // k % self.size
            index = order[draw]
            augment = sample_seed(self.seed, self.epoch * k + copy, index + once * draw)
            yield index, augment, *size

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self._length(), self.world_size))


def rarest_label_frequency(labels: Labels) -> torch.Tensor:
    """Each sample's class frequency: the share of the samples that carry its
    label (float64); a sample of several labels takes its rarest label's.
    ``labels``: class indices, lists of them, or ``N x classes`` multi-hot rows
    (as :func:`~distribuuuu.data.datasets.stored_labels` gives label sets)."""
    if isinstance(labels, torch.Tensor) and labels.dim() == 1:
        counts = torch.bincount(labels.to(torch.int64))
        return counts[labels.to(torch.int64)].to(torch.float64) / len(labels)
    if isinstance(labels, torch.Tensor) and labels.dim() == 2:
        return _rarest_of_rows(labels > 0)
    classes = [_classes(label) for label in labels]
    carriers = Counter(label for sample in classes for label in set(sample))
    for number, sample in enumerate(classes):
        if not sample:
            raise ValueError(f"sample {number} has no label to sample it by")
    rarest = [min(carriers[label] for label in sample) for sample in classes]
    return torch.tensor(rarest, dtype=torch.float64) / len(classes)


def _rarest_of_rows(carries: torch.Tensor) -> torch.Tensor:
    """:func:`rarest_label_frequency` of boolean ``N x classes`` rows."""
    empty = torch.nonzero(~carries.any(dim=1)).flatten()
    if len(empty):
        raise ValueError(f"sample {int(empty[0])} has no label to sample it by")
    carriers = carries.sum(dim=0, dtype=torch.float64)
    unused = torch.tensor(float("inf"), dtype=torch.float64)
    rarest = torch.where(carries, carriers, unused).amin(dim=1)
    return rarest / len(carries)


def _classes(label: int | Sequence[int] | torch.Tensor) -> list[int]:
    """A sample's ``label`` (one class, or a list or tensor of them) as a list."""
    if isinstance(label, torch.Tensor):
        return [int(c) for c in label.reshape(-1).tolist()]
    if isinstance(label, Sequence):
        return [int(c) for c in label]
    return [int(label)]


def sample_weights(sampler: str, labels: Labels, threshold: float) -> torch.Tensor:
    """Each sample's weight in the draws of DATA.SAMPLER ``sampler`` (not
    random), from its class frequency f (:func:`rarest_label_frequency`):

    - balanced: 1 / f, so each class is drawn equally often (a class of n
      samples weighs n x N / n = N);
    - sqrt: 1 / sqrt(f), so a class is drawn in proportion to sqrt(n);
    - repeat_factor: LVIS's repeat factor (Gupta et al. 2019), r = max(1,
      sqrt(t / f)) with ``threshold`` t (DATA.REPEAT_THRESHOLD): classes
      rarer than t are drawn more often, the others as they come; the max
      over a sample's labels is its rarest label's.
    """
    frequency = rarest_label_frequency(labels)
    if sampler == "balanced":
        return 1 / frequency
    if sampler == "sqrt":
        return frequency.rsqrt()
    if sampler == "repeat_factor":
        return (threshold / frequency).sqrt().clamp(min=1)
    raise ValueError(f"no weights for DATA.SAMPLER {sampler!r}")


def build_train_sampler(
    spec: LoaderSpec, dataset: Dataset, *, rank: int, world_size: int, seed: int
) -> ResumableTrainSampler:
    """The training sampler of ``dataset`` for DATA.SAMPLER and
    DATA.REPEATED_AUG: ``rank``'s share of the global order."""
    weights = None
    if spec.sampler != "random":
        labels = ds.stored_labels(dataset)
        if labels is None:
            raise ValueError(f"DATA.SAMPLER {spec.sampler} needs the data set's labels")
        weights = sample_weights(spec.sampler, labels, spec.repeat_threshold)
    size = len(dataset)  # type: ignore[arg-type]
    return ResumableTrainSampler(
        size,
        rank,
        world_size,
        seed,
        repeats=spec.repeated_aug,
        weights=weights,
        ramp=spec.ramp,
    )


class SeededDataset(Dataset):
    """Serves the training sampler's requests: ``(index, seed)`` seeds torch's
    CPU generator, then loads; ``(index, seed, size)`` (TRAIN.PROGRESSIVE)
    first makes the data set's transforms crop ``size`` pixels.

    The transforms draw their randomness from torch's default generator, so a
    sample's augmentation is fixed by its seed (cheap: about 1 us a sample).
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.resize = CropSizer(training_transform(dataset))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, ...]):
        index, seed, *size = item
        if size:
            self.resize(size[0])
        torch.default_generator.manual_seed(seed)
        return self.dataset[index]
