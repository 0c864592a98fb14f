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
from helpers import REPO

from distribuuuu import trainer
from distribuuuu.config import load_cfg

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


def _shrunk(path: str, out_dir: str) -> list[str]:
    """Overrides that make recipe ``path`` one quick step on synthetic images."""
    cfg = load_cfg(path, ["DATA.NAME", "synthetic"])
    fixed = [px for p, px in FIXED_SIZES.items() if cfg.MODEL.ARCH.startswith(p)]
    size, batch = (fixed[0], 1) if fixed else (SMALL_SIZE, 2)
    accum = 1 if fixed else min(cfg.TRAIN.ACCUM_STEPS, 2)  # still accumulates
    train_images = batch * accum * cfg.DATA.REPEATED_AUG
    return [
        *("DATA.NAME", "synthetic", "DEVICE", "cpu", "OUT_DIR", out_dir),
        *("DATA.SYNTHETIC_SIZE", f"[{train_images}, {batch}]"),
        *("TRAIN.BATCH_SIZE", str(batch), "TRAIN.ACCUM_STEPS", str(accum)),
        *("TEST.BATCH_SIZE", str(batch), "TRAIN.WORKERS", "0"),
        *("TRAIN.IM_SIZE", str(size), "TEST.IM_SIZE", str(size)),
        *("TEST.CROP_SIZE", "0", "TEST.CROP_PCT", "0"),
        *("TRAIN.MIXED_PRECISION", "none"),
    ]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_trains_one_step_and_evaluates(path, tmp_path):
    out_dir = str(tmp_path / "never")
    overrides = _shrunk(path, out_dir)
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
