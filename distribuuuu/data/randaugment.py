"""RandAugment with magnitude noise and increasing operations, as timm's
``rand-m7-mstd0.5-inc1`` of the ResNet strikes back recipes (Wightman, Touvron
and Jégou 2021), on uint8 image tensors with torchvision's v2 kernels.

RandAugment (Cubuk et al. 2020, "RandAugment: Practical automated data
augmentation with a reduced search space") applies N operations drawn
uniformly, each at one magnitude M.  timm's version (``rand_augment_transform``
in ``timm/data/auto_augment.py``), which this follows where its behaviour is
written down there:

- the N operations are drawn with replacement from 15 (timm's
  ``_RAND_TRANSFORMS``, or ``_RAND_INCREASING_TRANSFORMS`` with ``inc1``), and
  each is applied with probability 0.5;
- with ``mstd`` each application draws its own magnitude from a normal
  distribution of mean M and that std, clipped to the scale;
- the increasing variants make a larger magnitude always stronger: posterize
  keeps fewer bits, solarize inverts from a lower threshold, and the enhance
  operations (colour, contrast, brightness, sharpness) move their factor away
  from 1 (the image itself) in a random direction, to at most 0.1 or 1.9;
- geometric operations take a random sign and fill with the data set's mean
  colour.

One difference of scale: timm's magnitudes run over 0-10, ours over
torchvision's 0-30 (DATA.RANDAUG_M), so timm's ``m7-mstd0.5`` is M 21 and
MSTD 1.5 here, and the clip is to [0, 30].  A magnitude is used as its
``level``, M / 30 in [0, 1] (timm's M / 10).  Every random number comes from
torch's default generator, which the loader seeds per sample, so the draws
follow the run's seed and resume with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

# The top of DATA.RANDAUG_M's scale (torchvision's 31 magnitude bins: 0-30).
MAX_MAGNITUDE = 30.0


@dataclass(frozen=True)
class Style:
    """How geometric operations resample and what they fill uncovered pixels with."""

    fill: list[float]
    interpolation: v2.InterpolationMode


def _affine(image: torch.Tensor, style: Style, **params) -> torch.Tensor:
    base = {"angle": 0.0, "translate": [0.0, 0.0], "scale": 1.0, "shear": [0.0, 0.0]}
    base.update(params)
    return F.affine_image(
        image,
        **base,
        interpolation=style.interpolation,
        fill=style.fill,
        center=[0.0, 0.0],
    )


def _shear_degrees(level: float) -> float:
    # timm shears by a factor of up to 0.3 (PIL's affine matrix); torchvision
    # takes the shear as an angle, whose tangent is that factor.
    return math.degrees(math.atan(0.3 * level))


def _rotate(image: torch.Tensor, level: float, style: Style) -> torch.Tensor:
    angle = 30.0 * level  # up to 30 degrees
    return F.rotate_image(
        image, angle, interpolation=style.interpolation, fill=style.fill
    )


def _shear_x(image: torch.Tensor, level: float, style: Style) -> torch.Tensor:
    return _affine(image, style, shear=[_shear_degrees(level), 0.0])


def _shear_y(image: torch.Tensor, level: float, style: Style) -> torch.Tensor:
    return _affine(image, style, shear=[0.0, _shear_degrees(level)])


def _translate_x(image: torch.Tensor, level: float, style: Style) -> torch.Tensor:
    pixels = 0.45 * level * image.shape[-1]  # up to 45% of the width
    return _affine(image, style, translate=[pixels, 0.0])


def _translate_y(image: torch.Tensor, level: float, style: Style) -> torch.Tensor:
    pixels = 0.45 * level * image.shape[-2]
    return _affine(image, style, translate=[0.0, pixels])


def _keep_bits(image: torch.Tensor, bits: int) -> torch.Tensor:
    return image if bits >= 8 else F.posterize_image(image, bits)


def _posterize(image: torch.Tensor, level: float, _style: Style) -> torch.Tensor:
    return _keep_bits(image, int(4 * level))  # 0-4 bits kept: weaker with level


def _posterize_increasing(
    image: torch.Tensor, level: float, _style: Style
) -> torch.Tensor:
    return _keep_bits(image, 4 - int(4 * level))  # 4-0 bits kept: stronger


def _invert_from(image: torch.Tensor, threshold: int) -> torch.Tensor:
    # Pixels at or above the threshold are inverted; 256 inverts none.
    return image if threshold > 255 else F.solarize_image(image, float(threshold))


def _solarize(image: torch.Tensor, level: float, _style: Style) -> torch.Tensor:
    return _invert_from(image, int(256 * level))  # weaker with level


def _solarize_increasing(
    image: torch.Tensor, level: float, _style: Style
) -> torch.Tensor:
    return _invert_from(image, 256 - int(256 * level))  # stronger with level


def _solarize_add(image: torch.Tensor, level: float, _style: Style) -> torch.Tensor:
    add = int(110 * level)  # added to the pixels below 128, up to 110
    brighter = (image.to(torch.int16) + add).clamp_(max=255).to(torch.uint8)
    return torch.where(image < 128, brighter, image)


Kernel = Callable[[torch.Tensor, float], torch.Tensor]


def _enhance(kernel: Kernel) -> Callable:
    def op(image: torch.Tensor, level: float, _style: Style) -> torch.Tensor:
        return kernel(image, 1.8 * level + 0.1)  # factor 0.1-1.9, 1 at level 0.5

    return op


def _enhance_increasing(kernel: Kernel) -> Callable:
    def op(image: torch.Tensor, level: float, _style: Style) -> torch.Tensor:
        # level carries the random sign: factor 1 - 0.9 level or 1 + 0.9 level
        return kernel(image, max(0.1, 1.0 + 0.9 * level))

    return op


@dataclass(frozen=True)
class _Operation:
    apply: Callable[[torch.Tensor, float, Style], torch.Tensor]
    signed: bool  # its level takes a random sign


def _unary(kernel: Callable[[torch.Tensor], torch.Tensor]) -> _Operation:
    return _Operation(lambda image, _level, _style: kernel(image), signed=False)


OPERATIONS = {
    "auto_contrast": _unary(F.autocontrast_image),
    "equalize": _unary(F.equalize_image),
    "invert": _unary(F.invert_image),
    "rotate": _Operation(_rotate, signed=True),
    "posterize": _Operation(_posterize, signed=False),
    "posterize_increasing": _Operation(_posterize_increasing, signed=False),
    "solarize": _Operation(_solarize, signed=False),
    "solarize_increasing": _Operation(_solarize_increasing, signed=False),
    "solarize_add": _Operation(_solarize_add, signed=False),
    "shear_x": _Operation(_shear_x, signed=True),
    "shear_y": _Operation(_shear_y, signed=True),
    "translate_x": _Operation(_translate_x, signed=True),
    "translate_y": _Operation(_translate_y, signed=True),
}
_ENHANCE = {
    "color": F.adjust_saturation_image,
    "contrast": F.adjust_contrast_image,
    "brightness": F.adjust_brightness_image,
    "sharpness": F.adjust_sharpness_image,
}
for _name, _kernel in _ENHANCE.items():
    OPERATIONS[_name] = _Operation(_enhance(_kernel), signed=False)
    OPERATIONS[f"{_name}_increasing"] = _Operation(
        _enhance_increasing(_kernel), signed=True
    )

_COMMON = ("auto_contrast", "equalize", "invert", "rotate")
_GEOMETRY = ("shear_x", "shear_y", "translate_x", "translate_y")
# timm's _RAND_TRANSFORMS and _RAND_INCREASING_TRANSFORMS, in their order.
RAND_OPERATIONS = (
    *_COMMON,
    *("posterize", "solarize", "solarize_add"),
    *("color", "contrast", "brightness", "sharpness"),
    *_GEOMETRY,
)
RAND_INCREASING_OPERATIONS = (
    *_COMMON,
    *("posterize_increasing", "solarize_increasing", "solarize_add"),
    *("color_increasing", "contrast_increasing"),
    *("brightness_increasing", "sharpness_increasing"),
    *_GEOMETRY,
)


class TimmRandAugment(torch.nn.Module):
    """timm's RandAugment of a uint8 image tensor (C x H x W, any C).

    Args:
        num_ops: N, the operations drawn per image (with replacement).
        magnitude: M on the 0-30 scale of DATA.RANDAUG_M.
        magnitude_std: the std of the normal noise drawn for the magnitude of
            each application, on the same scale (0: always M).
        increasing: timm's increasing operations (``inc1``).
        fill: the colour of uncovered pixels, 0-255 per channel (an image of
            another number of channels takes the first value for all).
        probability: the chance that a drawn operation is applied (timm: 0.5).
    """

    def __init__(
        self,
        num_ops: int,
        magnitude: float,
        magnitude_std: float = 0.0,
        increasing: bool = False,
        fill: tuple = (128, 128, 128),
        interpolation: v2.InterpolationMode = v2.InterpolationMode.BILINEAR,
        probability: float = 0.5,
    ):
        super().__init__()
        self.num_ops, self.magnitude = num_ops, float(magnitude)
        self.magnitude_std, self.probability = magnitude_std, probability
        self.operations = RAND_INCREASING_OPERATIONS if increasing else RAND_OPERATIONS
        self.fill = [float(value) for value in fill]
        self.interpolation = interpolation

    def draw_magnitude(self) -> float:
        """One application's magnitude: M plus the noise, clipped to [0, 30]."""
        magnitude = self.magnitude
        if self.magnitude_std > 0:
            magnitude += self.magnitude_std * float(torch.randn(()))
        return min(max(magnitude, 0.0), MAX_MAGNITUDE)

    def apply_operation(self, name: str, image: torch.Tensor) -> torch.Tensor:
        """Operation ``name`` at a drawn magnitude (and sign, where it has one)."""
        operation = OPERATIONS[name]
        level = self.draw_magnitude() / MAX_MAGNITUDE
        if operation.signed and float(torch.rand(())) < 0.5:
            level = -level
        fill = self.fill if len(self.fill) == image.shape[-3] else self.fill[:1]
        return operation.apply(image, level, Style(fill, self.interpolation))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8:
            raise TypeError(f"expected a uint8 image tensor, got {type(image)}")
        picks = torch.randint(len(self.operations), (self.num_ops,)).tolist()
        for pick in picks:
            if float(torch.rand(())) < self.probability:
                image = self.apply_operation(self.operations[pick], image)
        return image

    def extra_repr(self) -> str:
        return (
            f"num_ops={self.num_ops}, magnitude={self.magnitude}, "
            f"magnitude_std={self.magnitude_std}, "
            f"increasing={self.operations is RAND_INCREASING_OPERATIONS}"
        )
