"""The original Distribuuuu's configs, kept verbatim in
tests/fixtures/distribuuuu_eaaa922 (see its README): each passes
``--print-config`` unchanged and builds the model of the original's table,
to the parameter."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, call_main

from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import model_spec
from distribuuuu.models import build_configured, model_library

CONFIGS = os.path.join(REPO, "tests", "fixtures", "distribuuuu_eaaa922")
# Params(M) in the original README's table of results, and the library that
# builds the model here (torchvision first, as its names come first).
ORIGINAL = {
    "resnet18": (11.690, "torchvision"),
    "resnet50": (25.557, "torchvision"),
    "efficientnet_b0": (5.289, "torchvision"),
    "botnet50": (20.859, "distribuuuu"),
    "regnetx_160": (54.279, "timm"),
    "regnety_160": (83.590, "timm"),
    "regnety_320": (145.047, "timm"),
}


@pytest.fixture
def imagenet_cwd(tmp_path, monkeypatch):
    """A working directory with the ./data/ILSVRC/{train,val} folders that the
    configs name (validation checks that data folders exist)."""
    for split in ("train", "val"):
        os.makedirs(tmp_path / "data" / "ILSVRC" / split)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", ORIGINAL)
def test_an_original_config_prints_and_builds_its_model(name, imagenet_cwd):
    millions, library = ORIGINAL[name]
    if library == "timm":
        pytest.importorskip("timm")
    path = os.path.join(CONFIGS, f"{name}.yaml")
    result = call_main("--cfg", path, "--print-config")
    assert result.returncode == 0, result.stderr
    assert f"  ARCH: {name}  # default: " in result.stdout
    assert not os.path.exists(name)  # its OUT_DIR: nothing written
    cfg = load_cfg(path)
    assert model_library(cfg.MODEL.ARCH) == library
    with torch.device("meta"):  # the layers without memory or initialisation
        model = build_configured(model_spec(cfg))
    count = sum(p.numel() for p in model.parameters()) / 1e6
    if name == "botnet50":  # ours, written from the paper: 20.852
        assert count == pytest.approx(millions, rel=0.001)
    else:
        assert round(count, 3) == millions
