"""DATA.SAMPLER: the class shares each sampler draws on a long-tailed set, one
global draw dealt out to any number of ranks, and the class frequency of
multi-label samples (a run killed and rerun: tests/engine/test_resume.py)."""

from __future__ import annotations

import math

import pytest
import torch

from distribuuuu.config import load_cfg
from distribuuuu.data import build_train_loader
from distribuuuu.data.datasets import TensorImageDataset
from distribuuuu.data.samplers import (
    ResumableTrainSampler,
    rarest_label_frequency,
    sample_weights,
)
from distribuuuu.engine.specs import loader_spec

# A long-tailed training set: classes of 1000, 100 and 10 samples.
SIZES = (1000, 100, 10)
LABELS = torch.cat([torch.full((n,), c) for c, n in enumerate(SIZES)])
# The chi-square quantile of 2 degrees of freedom (3 classes) at p = 0.001:
# -2 ln(0.001) (the distribution with 2 degrees is exponential of mean 2).
CHI_SQUARE_2_AT_0_001 = -2 * math.log(0.001)
THRESHOLD = 0.1  # DATA.REPEAT_THRESHOLD: classes under 10% of the set repeat


def _expected_shares(sampler: str) -> list[float]:
    """Each class's share of the draws, from the samplers' definitions."""
    total = len(LABELS)
    mass = {
        "random": [float(n) for n in SIZES],
        "balanced": [1.0 for _ in SIZES],
        "sqrt": [math.sqrt(n) for n in SIZES],
        # LVIS: every sample of class c repeats max(1, sqrt(t / f(c))) times.
        "repeat_factor": [n * max(1, math.sqrt(THRESHOLD * total / n)) for n in SIZES],
    }[sampler]
    return [m / sum(mass) for m in mass]


def _sampler(sampler: str, rank=0, world=1, repeats=1) -> ResumableTrainSampler:
    weights = None
    if sampler != "random":
        weights = sample_weights(sampler, LABELS, THRESHOLD)
    return ResumableTrainSampler(len(LABELS), rank, world, 7, repeats, weights)


def _chi_square(counts: list[int], shares: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, shares))


@pytest.mark.parametrize("sampler", ["balanced", "sqrt", "repeat_factor"])
def test_an_epoch_draws_each_class_within_chi_square_of_its_share(sampler):
    """Over each of 3 epochs (1,110 draws, as many as samples), the class
    counts pass a chi-square test of the sampler's shares at p = 0.001; the
    shuffled order (random) fails the balanced one by far."""
    drawn = _sampler(sampler)
    for epoch in range(3):
        drawn.set_epoch(epoch)
        indices = [index for index, _ in drawn]
        assert len(indices) == len(LABELS)  # an epoch keeps its length
        counts = torch.bincount(LABELS[indices], minlength=3).tolist()
        statistic = _chi_square(counts, _expected_shares(sampler))
        assert statistic < CHI_SQUARE_2_AT_0_001, (counts, statistic)
    shuffled = torch.bincount(LABELS[[i for i, _ in _sampler("random")]]).tolist()
    assert shuffled == list(SIZES)
    assert _chi_square(shuffled, _expected_shares("balanced")) > 1000


@pytest.mark.parametrize("repeats", [1, 3])
def test_ranks_take_disjoint_positions_of_one_global_draw(repeats):
    """On 1, 2 and 3 ranks, from an epoch's start and from position 100 (a
    resume): rank r serves positions r, r + W, ... of one global order of
    (sample, augmentation seed), the order of 1 rank; no draw is augmented
    alike, though rare samples come up many times."""
    reference = _sampler("balanced", repeats=repeats)
    reference.set_epoch(2)
    order = list(reference)
    assert len({seed for _, seed in order}) == len(order)
    assert len(set(order[i][0] for i in range(0, len(order), repeats))) < 1000
    for world in (1, 2, 3):
        for start in (0, 100):
            served = []
            for rank in range(world):
                sampler = _sampler("balanced", rank, world, repeats)
                sampler.set_epoch(2, start)
                mine = list(sampler)
                assert len(mine) == len(sampler)
                assert mine == order[start + rank :: world][: len(mine)]
                served += mine
            # One position each, padded to the world by the order's start.
            assert len(served) == len(order) - start + (-len(order) % world)
    other = _sampler("balanced", repeats=repeats)
    other.set_epoch(3)
    assert list(other) != order


def test_a_sample_of_several_labels_counts_as_its_rarest():
    """Class 0 is on 3 samples of 4, class 1 on 2, class 2 on 1: a sample's
    frequency is its rarest label's share, and its repeat factor the largest
    of its labels' (LVIS's max over the classes in an image)."""
    labels = [[0, 1], [0], [0, 2], [1, 1]]
    frequency = rarest_label_frequency(labels)
    assert frequency.tolist() == [2 / 4, 3 / 4, 1 / 4, 2 / 4]
    carriers = {0: 3, 1: 2, 2: 1}
    per_class = {c: max(1, math.sqrt(0.5 / (n / 4))) for c, n in carriers.items()}
    expected = [max(per_class[c] for c in sample) for sample in labels]
    factors = sample_weights("repeat_factor", labels, 0.5).tolist()
    assert factors == pytest.approx(expected)
    assert sample_weights("balanced", labels, 0.5).tolist() == [2, 4 / 3, 4, 2]
    # Single labels, as a tensor or a list, alike.
    singles = rarest_label_frequency([int(label) for label in LABELS])
    assert torch.equal(singles, rarest_label_frequency(LABELS))
    assert singles[-1] == 10 / len(LABELS)
    with pytest.raises(ValueError, match="sample 1 has no label"):
        rarest_label_frequency([[0], []])


def test_the_loader_of_a_config_draws_by_class():
    """DATA.SAMPLER balanced through the config: the loader's epoch has the
    steps of the random sampler's and the rare class in about a third of it."""
    images = torch.zeros((len(LABELS), 1, 2, 2), dtype=torch.uint8)
    dataset = TensorImageDataset(images, LABELS, ["a", "b", "c"])
    where = dict(rank=1, world_size=2, seed=3, device=torch.device("cpu"))
    steps = []
    for sampler in ("random", "balanced"):
        opts = ["DATA.SAMPLER", sampler, "TRAIN.WORKERS", "0"]
        spec = loader_spec(load_cfg(None, opts))
        loader = build_train_loader(spec, dataset, **where, batch_size=37)
        loader.sampler.set_epoch(0)
        labels = torch.cat([label for _, label in loader])
        steps.append(len(loader))
    assert steps[0] == steps[1] == len(LABELS) // 2 // 37
    assert 0.25 < (labels == 2).float().mean() < 0.42
