"""Every recipe in config/ loads and trains: one step and one evaluation batch.

The recipes are found in config/ itself, so a new file is covered without a
change here. Each runs on synthetic images with a tiny batch (and, where the
model allows, a tiny image) but keeps its model and every other recipe key:
optimizer, schedule, augmentation, mixing, precision, accumulation.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import yaml
from helpers import REPO

from distribuuuu.config import load_cfg
from distribuuuu.config.keys import get_key
from distribuuuu.engine import trainer
from distribuuuu.models import build_model

RECIPES = sorted(glob.glob(os.path.join(REPO, "config", "*.yaml")))
# Models built for one input size (torchvision's ViTs check it); the others
# run at SMALL_SIZE. On 2 CPU cores a ViT-B/16 step at 224 px costs about 15 s
# per image, so these run one image without accumulation. Every recipe runs in
# float32: bf16 is emulated on most CPUs (several times slower) and is covered
# by the mixed-precision tests.
FIXED_SIZES = {"vit_": 224, "maxvit_": 224}
SMALL_SIZE = 32


def test_recipes_are_found():
    names = {os.path.basename(path) for path in RECIPES}
    assert {"resnet18.yaml", "vit_b_16.yaml", "cifar10_resnet18.yaml"} <= names


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> list[str]:
    """A small ImageNet-sized teacher standing in for a recipe's (whose
    weights a user downloads)."""
    path = str(tmp_path_factory.mktemp("teacher") / "resnet8.pth")
    torch.save(build_model("resnet8", 1000).state_dict(), path)
    return ["TRAIN.DISTILL.ARCH", "resnet8", "TRAIN.DISTILL.WEIGHTS", path]


def _shrunk(path: str, out_dir: str, teacher: list[str]) -> list[str]:
    """Overrides that make recipe ``path`` one quick step on synthetic images."""
    with open(path, encoding="utf-8") as f:
        distilled = "DISTILL:" in f.read()
    teacher = teacher if distilled else []
    # Synthetic images carry one label each: a multi-label recipe's best
    # metric (map) gives way to the loss, which every run reports.
    synthetic = ["DATA.NAME", "synthetic", "CHECKPOINT.BEST_METRIC", "loss"]
    cfg = load_cfg(path, [*synthetic, *teacher])
    fixed = [px for p, px in FIXED_SIZES.items() if cfg.MODEL.ARCH.startswith(p)]
    size, batch = (fixed[0], 1) if fixed else (SMALL_SIZE, 2)
    accum = 1 if fixed else min(cfg.TRAIN.ACCUM_STEPS, 2)  # still accumulates
    train_images = batch * accum * cfg.DATA.REPEATED_AUG
    # A progressive-resizing ramp keeps its epochs, at the small size.
    ramp = ["START_SIZE", "END_SIZE"] if cfg.TRAIN.PROGRESSIVE.START_SIZE else []
    ramp = [v for key in ramp for v in (f"TRAIN.PROGRESSIVE.{key}", str(size))]
    return [
        *synthetic,
        *("DEVICE", "cpu", "OUT_DIR", out_dir),
        *("DATA.SYNTHETIC_SIZE", f"[{train_images}, {batch}]"),
        *("TRAIN.BATCH_SIZE", str(batch), "TRAIN.ACCUM_STEPS", str(accum)),
        *("TEST.BATCH_SIZE", str(batch), "TRAIN.WORKERS", "0"),
        *("TRAIN.IM_SIZE", str(size), "TEST.IM_SIZE", str(size)),
        *("TEST.CROP_SIZE", "0", "TEST.CROP_PCT", "0"),
        *("TRAIN.MIXED_PRECISION", "none"),
        *ramp,
        *teacher,
    ]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_trains_one_step_and_evaluates(path, tmp_path, teacher):
    out_dir = str(tmp_path / "never")
    overrides = _shrunk(path, out_dir, teacher)
    cfg = load_cfg(path, overrides)
    stats = trainer.dry_run(cfg)
    # One evaluation batch, every image counted. (Its loss is not checked: one
    # step on 1-2 images leaves BatchNorm statistics that can overflow it.)
    assert stats["samples"] == cfg.TEST.BATCH_SIZE
    assert stats["train_step_s"] > 0 and stats["peak_mem_mb"] > 0
    # Accuracies are counts of images: top-1 is k of the batch, top-k at least k.
    correct = stats["top1"] * stats["samples"] / 100
    assert correct == pytest.approx(round(correct), abs=1e-6)
    assert stats["topk"] >= stats["top1"]
    assert not os.path.exists(out_dir)  # a dry run writes nothing


def _set_in(node: dict, prefix: str = "") -> dict:
    """The dotted keys a recipe file sets itself, with their values."""
    found = {}
    for key, value in node.items():
        if key == "_BASE_":
            continue
        if isinstance(value, dict):
            found.update(_set_in(value, f"{prefix}{key}."))
        else:
            found[prefix + key] = value
    return found


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_print_config_shows_what_each_recipe_sets(path, teacher):
    """Every value a recipe file writes (the ones its comment cites) is the
    merged config's: no later default or base file overrides it."""
    with open(path, encoding="utf-8") as f:
        values = _set_in(yaml.safe_load(f) or {})
    extra = teacher if any(k.startswith("TRAIN.DISTILL") for k in values) else []
    # The embedded digits need no files; other images are stood in for (and a
    # multi-label recipe keeps its data, which its best metric needs).
    embedded = values.get("DATA.NAME") in ("mnist5k", "mnist5k_pairs")
    cfg = load_cfg(path, ([] if embedded else ["DATA.NAME", "synthetic"]) + extra)
    for key, value in values.items():
        if key in ("TRAIN.DISTILL.ARCH", "TRAIN.DISTILL.WEIGHTS", "DATA.NAME"):
            continue  # stood in for: a small teacher, images that need no files
        merged = get_key(cfg, key)
        assert merged == value or (isinstance(value, list) and list(merged) == value), (
            f"{key}: {merged!r} in the merged config, {value!r} in the file"
        )
