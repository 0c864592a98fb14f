"""The model registry."""

from __future__ import annotations

import pytest
import torch

from distribuuuu.models import build_model, is_model, list_models


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
