"""TEST.TTA: the views of an image and the logits averaged over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import refused
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distribuuuu.engine.evaluation import EvalSpec, evaluate
from distribuuuu.engine.tta import tta_logits, views


def _image(size: int = 6) -> torch.Tensor:
    return torch.arange(size * size, dtype=torch.float32).reshape(1, 1, size, size)


def test_flip_and_the_five_and_ten_crops():
    image = _image()  # pixel (r, c) holds 6 r + c
    plain, mirror = views(image, "flip", 4)
    assert torch.equal(mirror, image.flip(-1))
    five = views(image, "five_crop", 4)
    assert [int(v[0, 0, 0, 0]) for v in five] == [0, 2, 12, 14, 7]  # corners, centre
    assert all(v.shape == (1, 1, 4, 4) for v in five)
    ten = views(image, "ten_crop", 4)
    assert len(ten) == 10
    assert all(torch.equal(a.flip(-1), b) for a, b in zip(ten[:5], ten[5:]))


def test_flip_changes_the_logits_of_an_asymmetric_model_to_their_mean():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 3))
    images = torch.randn(5, 1, 6, 6)
    flipped = tta_logits(model, images, "flip", 6)
    assert not torch.allclose(flipped, model(images))
    expected = (model(images) + model(images.flip(-1))) / 2
    torch.testing.assert_close(flipped, expected)


def test_evaluation_counts_each_image_once_with_ten_crops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    images = torch.randint(0, 255, (7, 1, 6, 6), dtype=torch.uint8)
    targets = torch.randint(0, 3, (7,))
    loader = DataLoader(TensorDataset(images, targets), batch_size=3)
    spec = EvalSpec(torch.device("cpu"), lambda x: x.float() / 255, 1, 3,
                    tta="ten_crop", crop=4)  # fmt: skip
    stats, _ = evaluate(model, loader, spec)
    assert stats["samples"] == 7
    with torch.no_grad():
        crops = views(images.float() / 255, "ten_crop", 4)
        logits = torch.stack([model(v) for v in crops]).mean(0)
    expected = F.cross_entropy(logits, targets).item()
    assert stats["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "keys, words",
    [
        (["TEST.TTA", "five_crop"], "TEST.TTA 'five_crop' is invalid: needs an"),
        (["TEST.TTA", "mirror"], "TEST.TTA 'mirror' is invalid: choose one of"),
    ],
)
def test_bad_tta_is_refused(tmp_path, keys, words):
    assert words in refused(str(tmp_path / "out"), *keys)


def test_crop_views_come_from_the_square_of_the_resize():
    from distribuuuu.config import load_cfg
    from distribuuuu.data import build_dataset
    from distribuuuu.engine.specs import data_spec

    keys = ["TEST.TTA", "ten_crop", "TEST.IM_SIZE", "32"]
    image, _ = build_dataset(data_spec(load_cfg(None, keys)), train=False)[0]
    assert image.shape == (3, 32, 32)  # cropped to 28 on the device


@pytest.mark.distributed
@pytest.mark.slow
def test_ten_crop_evaluation_is_the_same_on_1_and_2_processes(tmp_path):
    """LeNet-5 (adaptive pooling) at 32 px: 10 crops of each of the 1,000
    validation digits, split over the 2 processes."""
    from helpers import assert_ok, read_metrics, torchrun, train_net

    from distribuuuu.models import build_model

    torch.manual_seed(0)
    weights = str(tmp_path / "lenet5.pth")
    torch.save(build_model("lenet5", 10).state_dict(), weights)
    args = ["--eval-only", "MODEL.ARCH", "lenet5", "MODEL.WEIGHTS", weights]
    args += ["TEST.TTA", "ten_crop"]
    args += ["TEST.IM_SIZE", "32"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert_ok(train_net(*args, "OUT_DIR", one))
    assert_ok(torchrun(2, *args, "OUT_DIR", two))
    (a,), (b,) = read_metrics(one, "val"), read_metrics(two, "val")
    assert a["samples"] == b["samples"] == 1000
    assert (a["top1"], a["topk"]) == (b["top1"], b["topk"])
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
