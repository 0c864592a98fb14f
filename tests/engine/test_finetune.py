"""Fine-tuning (MODEL.FINETUNE): a checkpoint of another number of classes."""

from __future__ import annotations

import functools

import pytest
import torch
import torchvision
from helpers import assert_ok, call_main, read_text, train_net

from distribuuuu import checkpoint as cp
from distribuuuu.models import build_model

# One training step of resnet8 on 32 synthetic images, 5 classes.
FIVE_CLASSES = [
    *("MODEL.ARCH", "resnet8", "MODEL.NUM_CLASSES", "5"),
    *("DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", "[32, 16]"),
    *("TRAIN.BATCH_SIZE", "32", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"),
    *("OPTIM.MAX_EPOCH", "1", "TRAIN.AUTO_RESUME", "False"),
]


@pytest.fixture(scope="module")
def ten_class_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    """A training checkpoint of a 10-class resnet8, with SGD momentum state."""
    torch.manual_seed(0)
    model = build_model("resnet8", 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3, 16, 16)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    path = str(tmp_path_factory.mktemp("source") / "ten_classes.pth")
    cp.save_weights(path, {**state, "epoch": 3})
    return path, state["model"]


@pytest.mark.slow
def test_finetune_starts_a_new_head_from_a_ten_class_checkpoint(
    ten_class_checkpoint, tmp_path
):
    path, source = ten_class_checkpoint
    out = tmp_path / "out"
    args = [*FIVE_CLASSES, "MODEL.WEIGHTS", path, "MODEL.FINETUNE", "True"]
    # A learning rate this small leaves the loaded weights where they were.
    result = train_net(*args, "OPTIM.BASE_LR", "1e-9", "OUT_DIR", str(out))
    assert_ok(result)
    log = read_text(str(out), "log.txt")
    assert "fine-tuning: 2 keys of" in log and "fc.weight, fc.bias" in log
    assert "the optimizer state of" in log and "is not loaded" in log
    tuned = cp.load_file(str(out / "checkpoints" / "ckpt_ep_0001.pth"))["model"]
    assert tuned["fc.weight"].shape == (5, 64)
    assert not torch.allclose(tuned["fc.weight"], source["fc.weight"][:5])
    convolutions = [key for key in source if "conv" in key]
    assert convolutions
    for key in convolutions:
        assert torch.allclose(tuned[key], source[key], atol=1e-6), key


def test_without_finetune_another_head_still_fails_clearly(
    ten_class_checkpoint, tmp_path
):
    path, _ = ten_class_checkpoint
    result = call_main(*FIVE_CLASSES, "MODEL.WEIGHTS", path, "OUT_DIR", str(tmp_path))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: MODEL.WEIGHTS")
    assert "fc.weight has shape (10, 64), the model expects (5, 64)" in error
    assert "MODEL.FINETUNE" in error


def test_finetune_refuses_another_architecture(ten_class_checkpoint, tmp_path):
    path, _ = ten_class_checkpoint
    args = [*FIVE_CLASSES, "MODEL.ARCH", "resnet14", "MODEL.WEIGHTS", path]
    result = call_main(*args, "MODEL.FINETUNE", "True", "OUT_DIR", str(tmp_path))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert "error: MODEL.WEIGHTS" in error and "another architecture" in error


def _small_vit(num_classes: int) -> torch.nn.Module:
    """torchvision's ViT class (as vit_b_16) at a size that builds in no time."""
    return torchvision.models.VisionTransformer(
        32, 16, 1, 2, 8, 16, num_classes=num_classes
    )


# The classifier keys of each model family of the registry, and a constructor.
HEADS = {
    "resnet18": (["fc.weight", "fc.bias"], None),
    "efficientnet_b0": (["classifier.1.weight", "classifier.1.bias"], None),
    "regnet_y_400mf": (["fc.weight", "fc.bias"], None),
    "vit": (["heads.head.weight", "heads.head.bias"], _small_vit),
    "mobilenet_v3_small": (["classifier.3.weight", "classifier.3.bias"], None),
    "resnet18_cifar": (["fc.weight", "fc.bias"], None),
    "lenet5": (["classifier.4.weight", "classifier.4.bias"], None),
}


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_finetune_skips_exactly_the_head_of_each_family(arch):
    head, build = HEADS[arch]
    build = build or functools.partial(build_model, arch)
    source, target = build(10), build(5)
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match="MODEL.FINETUNE True"):
        cp.load_model_weights(target, source.state_dict(), "ten.pth")
    skipped = cp.load_model_weights(
        target, source.state_dict(), "ten.pth", finetune_classes=5
    )
    assert skipped == head
    for key, value in target.state_dict().items():
        expected = fresh[key] if key in skipped else source.state_dict()[key]
        assert torch.equal(value, expected), key


def test_finetune_never_skips_a_body_of_another_shape():
    source = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 10))
    target = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 5))
    with pytest.raises(ValueError, match=r"0.weight has shape \(8, 4\)"):
        cp.load_model_weights(target, source.state_dict(), "x.pth", finetune_classes=5)
