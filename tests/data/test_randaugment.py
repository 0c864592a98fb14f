"""timm's RandAugment (DATA.RANDAUG_MSTD, DATA.RANDAUG_INC) beside torchvision's."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torchvision.transforms import v2

from distribuuuu.config import load_cfg
from distribuuuu.data import SeededDataset, build_dataset
from distribuuuu.data.datasets import IMAGENET_MEAN
from distribuuuu.data.randaugment import (
    OPERATIONS,
    RAND_INCREASING_OPERATIONS,
    RAND_OPERATIONS,
    Style,
    TimmRandAugment,
)
from distribuuuu.data.samplers import sample_seed
from distribuuuu.data.spec import TransformSpec
from distribuuuu.data.transforms import auto_augment
from distribuuuu.engine.specs import data_spec
from distribuuuu.errors import ConfigError


def _photo(channels: int = 3, size: int = 48) -> torch.Tensor:
    """A smooth uint8 image with some texture, covering most of 0-255."""
    torch.manual_seed(0)
    ramp = torch.linspace(0, 1, size)
    base = (ramp[:, None] * 0.6 + ramp[None, :] * 0.4).expand(channels, size, size)
    tint = torch.linspace(0.7, 1.0, channels)[:, None, None]
    noise = torch.rand(channels, size, size) * 0.15
    return ((base * tint + noise).clamp(0, 1) * 255).round().to(torch.uint8)


def _spec(**randaug) -> TransformSpec:
    return TransformSpec(
        im_size=32, test_im_size=32, auto_augment="randaugment", **randaug
    )


def test_default_keys_keep_torchvision_randaugment_bitwise():
    augment = auto_augment(_spec(randaug_n=2, randaug_m=9))
    assert type(augment) is v2.RandAugment
    reference = v2.RandAugment(2, 9, interpolation=v2.InterpolationMode.BILINEAR)
    image = _photo()
    for seed in range(5):
        torch.manual_seed(seed)
        ours = augment(image)
        torch.manual_seed(seed)
        assert torch.equal(ours, reference(image))


@pytest.mark.parametrize(
    "randaug, increasing",
    [({"randaug_mstd": 1.5}, False), ({"randaug_inc": True}, True)],
)
def test_mstd_or_inc_make_randaugment_timms(randaug, increasing):
    spec = _spec(randaug_n=2, randaug_m=21, **randaug)
    augment = auto_augment(spec, "imagenet", IMAGENET_MEAN)
    assert isinstance(augment, TimmRandAugment)
    expected = RAND_INCREASING_OPERATIONS if increasing else RAND_OPERATIONS
    assert augment.operations == expected and len(expected) == 15
    assert augment.num_ops == 2 and augment.magnitude == 21
    # The ImageNet mean colour, rounded, fills what geometry uncovers.
    assert augment.fill == [124.0, 116.0, 104.0]


def test_draws_follow_torch_seed_only():
    augment = TimmRandAugment(3, 21, magnitude_std=1.5, increasing=True)
    image = _photo()
    outputs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        random.seed(len(outputs))  # Python's generator plays no part
        outputs.append(augment(image))
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], outputs[2])


def test_loader_samples_are_deterministic_given_seed_epoch_and_index():
    overrides = ["DATA.AUTO_AUGMENT", "randaugment", "DATA.RANDAUG_M", "27"]
    overrides += ["DATA.RANDAUG_MSTD", "3", "DATA.RANDAUG_INC", "True"]
    cfg = load_cfg(None, overrides)  # the embedded digits
    dataset = SeededDataset(build_dataset(data_spec(cfg), train=True))
    first = [dataset[(i, sample_seed(5, 2, i))][0] for i in range(8)]
    torch.rand(10)  # the global generator's state does not matter
    again = [dataset[(i, sample_seed(5, 2, i))][0] for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = [dataset[(i, sample_seed(5, 3, i))][0] for i in range(8)]
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    assert all(a.dtype == torch.uint8 and a.shape[-2:] == (28, 28) for a in first)


@pytest.mark.parametrize("magnitude, std", [(21, 1.5), (15, 6.0), (30, 3.0)])
def test_drawn_magnitudes_have_the_configured_mean_and_std(magnitude, std):
    augment = TimmRandAugment(2, magnitude, magnitude_std=std)
    torch.manual_seed(0)
    draws = torch.tensor([augment.draw_magnitude() for _ in range(20000)])
    assert draws.min() >= 0 and draws.max() <= 30
    # The normal clipped to [0, 30]: at 30 half the draws sit on the clip and
    # the mean drops by std / sqrt(2 pi); away from the ends it is N(M, std).
    if magnitude == 30:
        assert (draws == 30).float().mean().item() == pytest.approx(0.5, abs=0.02)
        expected = 30 - std / math.sqrt(2 * math.pi)
        assert draws.mean().item() == pytest.approx(expected, abs=0.05)
    else:
        assert draws.mean().item() == pytest.approx(magnitude, abs=0.1)
        assert draws.std().item() == pytest.approx(std, rel=0.03)
    fixed = TimmRandAugment(2, magnitude)
    assert {fixed.draw_magnitude() for _ in range(10)} == {float(magnitude)}


STYLE = Style([124.0, 116.0, 104.0], v2.InterpolationMode.BILINEAR)


def _change(name: str, level: float, image: torch.Tensor) -> float:
    """Mean absolute pixel change of operation ``name`` at ``level``."""
    out = OPERATIONS[name].apply(image, level, STYLE)
    return (out.float() - image.float()).abs().mean().item()


INCREASING = [
    "posterize_increasing",
    "solarize_increasing",
    "solarize_add",
    "color_increasing",
    "contrast_increasing",
    "brightness_increasing",
    "sharpness_increasing",
]
SIGNS = [
    (n, s) for n in INCREASING for s in ((1, -1) if OPERATIONS[n].signed else (1,))
]


@pytest.mark.parametrize("name, sign", SIGNS)
def test_increasing_operations_are_monotone_in_magnitude(name, sign):
    image = _photo()
    changes = [_change(name, sign * step / 10, image) for step in range(11)]
    if name != "posterize_increasing":  # which keeps 4 bits at magnitude 0
        assert changes[0] == pytest.approx(0, abs=0.01)  # the image itself
    assert all(b >= a - 0.05 for a, b in zip(changes, changes[1:])), changes
    assert changes[-1] > changes[5] > 1


@pytest.mark.parametrize("name", ["posterize", "solarize"])
def test_plain_posterize_and_solarize_weaken_with_magnitude(name):
    # timm's non-increasing variants, which inc1 replaces: strongest at 0.
    image = _photo()
    assert _change(name, 0.0, image) > _change(name, 0.5, image) > 0
    assert _change(name, 1.0, image) < 0.5 * _change(name, 0.0, image)


@pytest.mark.parametrize("name", sorted(OPERATIONS))
@pytest.mark.parametrize("channels", [1, 3])
def test_every_operation_keeps_dtype_and_shape(name, channels):
    image = _photo(channels, size=20)[:, :, :17]  # not square
    level = -0.7 if OPERATIONS[name].signed else 0.7
    style = Style([124.0] * channels, v2.InterpolationMode.BILINEAR)
    out = OPERATIONS[name].apply(image, level, style)
    assert out.dtype == torch.uint8 and out.shape == image.shape
    augment = TimmRandAugment(4, 30, magnitude_std=5.0, increasing=True)
    assert augment(image).shape == image.shape
    with pytest.raises(TypeError, match="uint8"):
        augment(image.float())


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["DATA.RANDAUG_MSTD", "-0.5"], "DATA.RANDAUG_MSTD"),
        (["DATA.RANDAUG_MSTD", "31.0"], "DATA.RANDAUG_MSTD"),
        (["DATA.RANDAUG_MSTD", "1.5"], "set DATA.AUTO_AUGMENT randaugment"),
        (["DATA.RANDAUG_INC", "True"], "set DATA.AUTO_AUGMENT randaugment"),
        (
            ["DATA.AUTO_AUGMENT", "trivialaugment", "DATA.RANDAUG_INC", "True"],
            "is trivialaugment",
        ),
    ],
)
def test_keys_are_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_cfg(None, overrides)
    ok = ["DATA.AUTO_AUGMENT", "randaugment", *overrides[-2:]]
    if "-0.5" not in ok and "31.0" not in ok:
        load_cfg(None, ok)
