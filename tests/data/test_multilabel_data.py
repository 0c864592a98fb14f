"""Multi-label data: the embedded mnist5k_pairs task through the loaders,
samplers, repeated augmentation and labels-only loaders (the losses and
metrics that read its targets: tests/engine)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from helpers import refused
from PIL import Image

from distribuuuu.config import load_cfg
from distribuuuu.config.validation import is_multi_label
from distribuuuu.data import build_dataset, build_train_loader, flip_probability
from distribuuuu.data.datasets import TensorImageDataset, load_mnist5k, stored_labels
from distribuuuu.data.labels import labels_only
from distribuuuu.data.pairs import pair_up
from distribuuuu.data.samplers import rarest_label_frequency
from distribuuuu.engine.specs import data_spec, loader_spec

CPU = torch.device("cpu")
RECIPE = "config/mnist5k_multilabel.yaml"
# The canvases whole (the recipe trains them resized to 28 px).
FULL_SIZE = ["TRAIN.IM_SIZE", "56", "TEST.IM_SIZE", "56"]
SPEC = loader_spec(load_cfg(None, ["TRAIN.WORKERS", "0"]))


@pytest.fixture(scope="module")
def pairs() -> dict:
    """The train and val sets of the recipe's DATA.NAME mnist5k_pairs."""
    spec = data_spec(load_cfg(RECIPE, FULL_SIZE))
    return {split: build_dataset(spec, split == "train") for split in ("train", "val")}


def _label_set(target: torch.Tensor) -> set[int]:
    return set(torch.nonzero(target).flatten().tolist())


def test_a_pair_shows_two_digits_of_its_split_and_carries_both_labels(pairs):
    """Val image i: val digit i on the left half of a 56 px canvas, another
    val digit on the right, both vertically centred; its target is the
    float32 multi-hot set of their classes (one class when they are the same
    digit). A second load gives the same pairs."""
    digits, classes = load_mnist5k(train=False)
    val = pairs["val"]
    assert len(pairs["train"]) == 4000 and len(val) == len(digits) == 1000
    sizes = []
    for index in range(0, 1000, 97):
        image, target = val[index]
        assert image.shape == (3, 56, 56) and image.dtype == torch.uint8
        assert target.dtype == torch.float32 and target.shape == (10,)
        assert torch.equal(image[0, 14:42, :28], digits[index, 0])
        assert not image[0, :14].any() and not image[0, 42:].any()
        right = image[0, 14:42, 28:]
        partner = [i for i in range(1000) if torch.equal(digits[i, 0], right)]
        assert partner, "the right half is not a val digit"
        expected = {int(classes[index]), int(classes[partner[0]])}
        assert _label_set(target) == expected
        sizes.append(len(expected))
    spec = data_spec(load_cfg(RECIPE, [*FULL_SIZE, "RNG_SEED", "5"]))
    assert torch.equal(build_dataset(spec, train=False).labels, val.labels)
    totals = val.labels.sum(dim=1)
    assert set(totals.tolist()) == {1.0, 2.0} and (totals == 1).sum() < 200


def test_the_recipe_is_multi_label_and_digits_are_not_flipped():
    """The recipe resolves to label sets with a sigmoid loss; digits keep
    their sides (a mirrored digit is no digit), CIFAR's images flip."""
    cfg = load_cfg(RECIPE, [])
    assert is_multi_label(cfg) and cfg.MODEL.LOSS == "bce"
    sizes = data_spec(cfg).transform
    assert flip_probability(sizes, "mnist5k_pairs") == 0.0
    assert flip_probability(sizes, "cifar10") == 0.5


def test_batches_of_pairs_hold_multi_hot_targets(pairs):
    """A training batch: B x 3 x 56 x 56 uint8 images and B x 10 float32
    targets, the rows of the samples that the sampler drew."""
    loader = build_train_loader(
        SPEC, pairs["train"], rank=0, world_size=1, seed=3, device=CPU, batch_size=16
    )
    loader.sampler.set_epoch(0)
    order = [index for index, _ in loader.sampler][:16]
    images, targets = next(iter(loader))
    assert images.shape == (16, 3, 56, 56) and images.dtype == torch.uint8
    assert targets.shape == (16, 10) and targets.dtype == torch.float32
    assert torch.equal(targets, pairs["train"].labels[order])


def _skewed_pairs() -> TensorImageDataset:
    """Pairs of 400 digits (blank images): 390 of classes 0 and 1, 10 of class
    2, so about 20 of the 400 pairs carry class 2."""
    labels = torch.tensor([0, 1] * 195 + [2] * 10)
    images = torch.zeros((len(labels), 1, 28, 28), dtype=torch.uint8)
    canvases, targets = pair_up(images, labels, seed=1)
    return TensorImageDataset(canvases, targets, ["0", "1", "2"])


def test_balanced_sampling_draws_pairs_by_their_rarest_label():
    """DATA.SAMPLER balanced on label sets: the multi-hot rows count as the
    lists of their classes; the ~5% of pairs that carry the rare class make
    about a third of the draws (each class's pairs weigh alike)."""
    dataset = _skewed_pairs()
    rows = stored_labels(dataset)
    assert rows is not None and rows.shape == (400, 10)
    as_lists = [torch.nonzero(row).flatten().tolist() for row in rows]
    assert torch.equal(rarest_label_frequency(rows), rarest_label_frequency(as_lists))
    with pytest.raises(ValueError, match="sample 1 has no label"):
        rarest_label_frequency(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    carriers = rows[:, 2] > 0
    assert 10 <= carriers.sum() <= 20
    shares = []
    for sampler in ("random", "balanced"):
        spec = dataclasses.replace(SPEC, sampler=sampler)
        loader = build_train_loader(
            spec, dataset, rank=0, world_size=1, seed=0, device=CPU, batch_size=40
        )
        draws = []
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            draws += [index for index, _ in loader.sampler]
        shares.append(carriers[draws].float().mean().item())
    assert shares[0] < 0.06 and 0.25 < shares[1] < 0.45


def test_repeated_copies_of_a_pair_share_its_labels_not_its_crop(pairs):
    """DATA.REPEATED_AUG 2: consecutive copies of a pair carry its label set
    and differ in their random crop."""
    spec = dataclasses.replace(SPEC, repeated_aug=2)
    loader = build_train_loader(
        spec, pairs["train"], rank=0, world_size=1, seed=3, device=CPU, batch_size=8
    )
    loader.sampler.set_epoch(1)
    images, targets = next(iter(loader))
    assert torch.equal(targets[0::2], targets[1::2])
    different = [not torch.equal(images[i], images[i + 1]) for i in range(0, 8, 2)]
    assert sum(different) >= 3


def test_labels_only_batches_of_pairs_are_the_full_loaders(pairs):
    """A pipeline's later stage serves the same multi-hot rows, batch by
    batch, as the full loader, with stand-in images of the training size."""
    dataset = _skewed_pairs()
    spec = dataclasses.replace(SPEC, sampler="balanced", repeated_aug=2)
    where = dict(rank=1, world_size=2, seed=4, device=CPU, batch_size=16)
    full = build_train_loader(spec, dataset, **where)
    only = labels_only(build_train_loader(spec, dataset, **where), dataset, 56)
    full.sampler.set_epoch(2, 6)
    only.sampler.set_epoch(2, 6)
    served = list(only)
    expected = [targets for _, targets in full]
    assert len(served) == len(expected) == (400 - 6) // 2 // 16
    for (stand_ins, targets), wanted in zip(served, expected, strict=True):
        assert stand_ins.shape == (16, 0, 56, 56)
        assert targets.dtype == torch.float32 and torch.equal(targets, wanted)


# --------------------------------------------------------------------------- #
# TRAIN.LABELS_FILE / TEST.LABELS_FILE: label sets of an image folder
# --------------------------------------------------------------------------- #

TRAIN_ROWS = ["a/0.png,cat dog", "a/1.png,dog", "b/2.png,bird cat", "b/3.png,dog"]
VAL_ROWS = ["x/0.png,dog", "x/1.png,cat bird"]


def _write_split(root: Path, rows: list[str], csv_path: Path) -> None:
    """The images that ``rows`` name (8 px PNGs) under ``root``, and the CSV."""
    for row in rows:
        image = root / row.split(",")[0]
        image.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (len(row) * 9 % 256, 0, 0)).save(image)
    csv_path.write_text("path,labels\n" + "\n".join(rows) + "\n", encoding="utf-8")


def _labelled(tmp_path: Path, val_rows: list[str] = VAL_ROWS) -> list[str]:
    """Overrides of a labelled image folder under ``tmp_path``: 3 classes."""
    data = tmp_path / "data"
    _write_split(data / "train", TRAIN_ROWS, tmp_path / "train.csv")
    _write_split(data / "val", VAL_ROWS, tmp_path / "val.csv")
    (tmp_path / "val.csv").write_text(
        "path,labels\n" + "\n".join(val_rows) + "\n", encoding="utf-8"
    )
    return [
        *("DATA.NAME", "imagefolder", "TRAIN.DATASET", str(data)),
        *("TEST.DATASET", str(data), "MODEL.NUM_CLASSES", "3"),
        *("TRAIN.LABELS_FILE", str(tmp_path / "train.csv")),
        *("TEST.LABELS_FILE", str(tmp_path / "val.csv")),
        *("MODEL.LOSS", "bce", "CHECKPOINT.BEST_METRIC", "map"),
        *("TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "2"),
        *("TRAIN.WORKERS", "0", "MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1"),
    ]


def test_a_labels_file_serves_multi_hot_targets_over_the_training_classes(
    tmp_path,
):
    """The classes are the training file's sorted names, for both splits (the
    names a run records); each image's target marks its listed classes, in a
    batch as B x 3 float32 rows; no folder index is written."""
    spec = data_spec(load_cfg(None, _labelled(tmp_path)))
    train, val = build_dataset(spec, train=True), build_dataset(spec, train=False)
    assert train.classes == val.classes == ["bird", "cat", "dog"]
    assert len(train) == 4 and len(val) == 2
    image, target = val[1]
    assert image.shape[-2:] == (8, 8) and target.tolist() == [1.0, 1.0, 0.0]
    expected = [[0, 1, 1], [0, 0, 1], [1, 1, 0], [0, 0, 1]]
    assert stored_labels(train).tolist() == expected
    loader = build_train_loader(
        SPEC, train, rank=0, world_size=1, seed=0, device=CPU, batch_size=2
    )
    loader.sampler.set_epoch(0)
    order = [index for index, _ in loader.sampler]
    batches = [targets for _, targets in loader]
    assert all(b.shape == (2, 3) and b.dtype == torch.float32 for b in batches)
    assert torch.cat(batches).tolist() == [expected[i] for i in order]
    assert not os.path.exists(spec.index_cache)


@pytest.mark.parametrize(
    ("val_rows", "extra", "message"),
    [
        (["x/0.png,dog fish"], [], "x/0.png has class fish, which the training"),
        (["../train/a/0.png,dog"], [], "path '../train/a/0.png' is outside the split"),
        (["x/0.png,dog", "x/0.png,cat"], [], "x/0.png is listed twice"),
        (["x/0.png,"], [], "x/0.png has no labels"),
        (VAL_ROWS, ["MODEL.NUM_CLASSES", "4"], "names 3 classes but MODEL.NUM_CLASSES"),
        (["x/0.png,dog", "x/9.png,cat"], [], "no image file x/9.png"),
    ],
)
def test_a_bad_labels_file_is_refused_before_the_run_writes(
    tmp_path, val_rows, extra, message
):
    """Exit 2 with one error line naming the fault, and no OUT_DIR."""
    args = [*_labelled(tmp_path, val_rows), *extra]
    error = refused(str(tmp_path / "out"), *args)
    assert message in error


def test_labels_files_stay_inside_their_split_and_are_read_safely(tmp_path):
    """A link that resolves outside the split, a CSV that is not UTF-8, and a
    labels file on shards are each refused with one error line."""
    args = _labelled(tmp_path)
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8)).save(outside)
    (tmp_path / "data" / "val" / "x" / "link.png").symlink_to(outside)
    (tmp_path / "val.csv").write_text("path,labels\nx/link.png,dog\n")
    error = refused(str(tmp_path / "out"), *args)
    assert "x/link.png resolves to" in error and "outside the split" in error
    (tmp_path / "val.csv").write_bytes(b"path,labels\nx/0.png,\xff\xfe\n")
    assert "not UTF-8 text" in refused(str(tmp_path / "out"), *args)
    shards = [*args, "DATA.NAME", "webdataset"]
    assert "DATA.NAME imagefolder" in refused(str(tmp_path / "out"), *shards)
