"""The model registry."""

from __future__ import annotations

import pytest
import torch

from distribuuuu.models import build_model, find_blocks, is_model, list_models


def test_registry_has_torchvision_and_small_models():
    names = list_models()
    for name in (
        "resnet18",
        "resnet50",
        "efficientnet_b0",
        "regnet_x_16gf",
        "resnet20",
        "resnet8",
        "resnet18_cifar",
    ):
        assert name in names and is_model(name)
    assert not is_model("nosuchnet")
    assert "fasterrcnn_resnet50_fpn" not in names  # classification models only


@pytest.mark.parametrize(
    "name, params", [("resnet20", 0.27e6), ("resnet18_cifar", 11.2e6)]
)
def test_small_resnets(name, params):
    model = build_model(name, num_classes=7)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) / params < 0.03
    for size in (28, 32):
        assert model(torch.randn(2, 3, size, size)).shape == (2, 7)


def test_torchvision_model_gets_the_head_size():
    model = build_model("resnet18", num_classes=3)
    assert model.fc.out_features == 3
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_timm_models_when_installed():
    timm = pytest.importorskip("timm")
    assert is_model("timm/resnet10t") == timm.is_model("resnet10t")


@pytest.mark.parametrize(
    "name, blocks",
    [
        ("resnet10t", 4),  # BasicBlocks of 4 stages of depth 1
        ("resnetv2_50", 16),  # pre-activation Bottlenecks, 3 + 4 + 6 + 3
        ("regnetx_002", 13),  # 1 + 1 + 4 + 7
        ("efficientnet_b0", 16),  # 1 DepthwiseSeparableConv + 15 MBConv
        ("mobilenetv3_small_050", 12),  # 11 + the last ConvBnAct stage
        ("convnext_atto", 12),  # 2 + 2 + 6 + 2
        ("vit_tiny_patch16_224", 12),
    ],
)
def test_find_blocks_finds_the_blocks_of_timm_families(name, blocks):
    """Activation checkpointing and FSDP wrap these; parameter names unchanged."""
    pytest.importorskip("timm")
    assert len(find_blocks(build_model(f"timm/{name}", 3))) == blocks
