"""The model registry."""

from __future__ import annotations

import pytest
import torch
from helpers import refused

from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import model_spec
from distribuuuu.models import (
    build_model,
    find_blocks,
    is_model,
    list_models,
    zero_init_residual,
)


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


@pytest.mark.parametrize(
    "arch, blocks, norm",
    [
        ("resnet18", 8, "bn2"),
        ("resnet50", 16, "bn3"),
        ("resnet8", 3, "bn2"),
    ],  # fmt: skip
)
def test_zero_init_residual_zeroes_the_last_norm_of_each_block(arch, blocks, norm):
    model = build_model(arch, 10)
    assert zero_init_residual(model) == blocks
    last = [getattr(m, norm) for m in model.modules() if hasattr(m, norm)]
    assert len(last) == blocks and all(not n.weight.any() for n in last)
    others = [m for n, m in model.named_modules() if n.endswith("bn1")]
    assert all(m.weight.all() for m in others)  # the rest keeps its init


def test_zero_init_residual_of_timm_and_of_a_model_without_blocks():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18", num_classes=10)
    for module in model.modules():
        if hasattr(module, "bn2"):
            torch.nn.init.ones_(module.bn2.weight)
    assert zero_init_residual(model) == 8
    assert not any(m.bn2.weight.any() for m in model.modules() if hasattr(m, "bn2"))
    assert zero_init_residual(build_model("lenet5", 10)) == 0


@pytest.mark.parametrize(
    "keys, words",
    [
        (["MODEL.ARCH", "lenet5"], "lenet5 has no residual block"),
        (["MODEL.PRETRAINED", "True"], "would zero layers of the pretrained"),
    ],
)
def test_zero_init_residual_refused_where_it_cannot_apply(tmp_path, keys, words):
    out = str(tmp_path / "out")
    assert words in refused(out, "MODEL.ZERO_INIT_RESIDUAL", "True", *keys)


# --- MODEL.DROPOUT, DROP_PATH, BN_MOMENTUM, BN_EPS ------------------------- #
def _configured(*keys: str):
    from distribuuuu.models import build_configured

    return build_configured(model_spec(load_cfg(None, list(keys))))


def test_drop_path_changes_training_outputs_only():
    from distribuuuu.models import regularize

    torch.manual_seed(0)
    images = torch.randn(4, 3, 64, 64)
    plain = _configured("MODEL.ARCH", "efficientnet_b0", "MODEL.DROP_PATH", "0")
    dropped = _configured("MODEL.ARCH", "efficientnet_b0", "MODEL.DROP_PATH", "0.5")
    dropped.load_state_dict(plain.state_dict())  # same weights, same keys
    plain.eval(), dropped.eval()
    with torch.no_grad():
        assert torch.equal(plain(images), dropped(images))
        plain.train(), dropped.train()
        torch.manual_seed(1)
        once = plain(images)
        torch.manual_seed(1)
        assert not torch.allclose(dropped(images), once)
    # torchvision's ViT, which has none of its own: both branches of each block
    from torchvision.models import VisionTransformer

    vit = VisionTransformer(32, 16, num_layers=3, num_heads=2, hidden_dim=16,
                            mlp_dim=32, num_classes=10)  # fmt: skip
    keys = set(vit.state_dict())
    cfg = load_cfg(None, ["MODEL.ARCH", "vit_b_16", "MODEL.DROP_PATH", "0.2"])
    regularize.regularize(vit, model_spec(cfg))
    rates = [m.p for m in vit.modules() if type(m).__name__ == "StochasticDepth"]
    assert rates == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.2, 0.2])
    assert set(vit.state_dict()) == keys  # checkpoints unchanged


def test_dropout_and_batchnorm_values_reach_every_layer():
    model = _configured(
        "MODEL.ARCH", "efficientnet_b0", "MODEL.DROPOUT", "0.35",
        "MODEL.BN_MOMENTUM", "0.01", "MODEL.BN_EPS", "0.001",
    )  # fmt: skip
    assert model.classifier[0].p == 0.35
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all((m.momentum, m.eps) == (0.01, 0.001) for m in norms)


@pytest.mark.parametrize(
    "keys, words",
    [
        (["MODEL.ARCH", "botnet50", "MODEL.DROPOUT", "0.2"], "botnet50 has no such"),
        (["MODEL.ARCH", "lenet5", "MODEL.DROP_PATH", "0.1"], "lenet5 has no such"),
        (["MODEL.ARCH", "vgg11", "MODEL.DROP_PATH", "0.1"], "vgg11 has no such"),
        (["MODEL.ARCH", "vit_b_16", "MODEL.BN_EPS", "0.001"], "has no BatchNorm"),
        (["MODEL.ARCH", "vit_b_16", "MODEL.DROPOUT", "0.1"], "no classifier dropout"),
        (["MODEL.DROP_PATH", "1.0"], "MODEL.DROP_PATH 1.0 is invalid"),
    ],
)
def test_regularisation_keys_refused_where_the_model_lacks_the_layers(
    tmp_path, keys, words
):
    assert words in refused(str(tmp_path / "out"), *keys)
