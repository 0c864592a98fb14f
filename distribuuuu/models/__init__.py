"""The model registry: an architecture name -> a constructor.

Names: the models defined here (the small ResNets of
:mod:`distribuuuu.models.small`, LeNet-5, a small ViT, BoTNet-50), every
torchvision classification model by its torchvision name, and timm's models
when timm is installed: as ``timm/<name>``, or by their plain name when
neither we nor torchvision have it (``regnetx_160``), as the original
Distribuuuu looked names up.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

from distribuuuu.models import botnet, regularize, small, vit
from distribuuuu.models.spec import ModelSpec

logger = logging.getLogger(__name__)

# name -> constructor(num_classes, **options) of the models defined here.
_OWN: dict[str, Callable[..., nn.Module]] = {
    **{
        f"resnet{d}": functools.partial(small.cifar_resnet, d)
        for d in (8, 14, 20, 32, 44, 56, 110)
    },
    "resnet18_cifar": small.resnet18_cifar,
    "lenet5": small.LeNet5,
    "vit_tiny_patch4": vit.vit_tiny_patch4,
    "botnet50": botnet.botnet50,
}
TIMM_PREFIX = "timm/"
# The repeated blocks of the common timm families, by module of timm.models, as
# class names: the classes come and go between timm releases, so a missing one
# is skipped.  CondConvResidual subclasses InvertedResidual; DeiT builds
# vision_transformer's Block; MobileNetV3 and MNASNet build EfficientNet's.
_TIMM_BLOCKS: dict[str, tuple[str, ...]] = {
    "resnet": ("BasicBlock", "Bottleneck"),
    "resnetv2": ("PreActBasic", "PreActBottleneck", "Bottleneck"),
    "regnet": ("Bottleneck", "PreBottleneck"),
    "byobnet": (
        "BasicBlock",
        "BottleneckBlock",
        "DarkBlock",
        "EdgeBlock",
        "RepVggBlock",
        "MobileOneBlock",
        "SelfAttnBlock",
    ),
    "_efficientnet_blocks": (
        "ConvBnAct",
        "DepthwiseSeparableConv",
        "InvertedResidual",
        "UniversalInvertedResidual",
        "MobileAttention",
        "EdgeResidual",
    ),
    "rexnet": ("LinearBottleneck",),
    "ghostnet": ("GhostBottleneck", "GhostBottleneckV3"),
    "convnext": ("ConvNeXtBlock",),
    "vision_transformer": (
        "Block",
        "ResPostBlock",
        "ParallelScalingBlock",
        "DiffParallelScalingBlock",
        "ParallelThingsBlock",
    ),
    "eva": ("EvaBlock", "EvaBlockPostNorm"),
    "beit": ("Block",),
    "swin_transformer": ("SwinTransformerBlock",),
    "mlp_mixer": ("MixerBlock", "ResBlock", "SpatialGatingBlock"),
}


@functools.lru_cache(maxsize=1)
def _torchvision_names() -> tuple[str, ...]:
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def list_models() -> list[str]:
    """Every name the registry builds (timm models not listed)."""
    return sorted(_OWN) + sorted(_torchvision_names())


TIMM_EXTRA = "pip install 'distribuuuu[timm]'"


def timm_installed() -> bool:
    """True when timm can be imported."""
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def model_library(name: str) -> str | None:
    """Which library builds ``name``: ``distribuuuu``, ``torchvision`` or
    ``timm`` (None: none of them, or timm's but timm is not installed).

    A plain name is looked up here, then in torchvision, then in timm, so a
    name both libraries have (``resnet50``) is torchvision's; ``timm/<name>``
    is always timm's.
    """
    timm_name = name.removeprefix(TIMM_PREFIX)
    if name == timm_name:
        if name in _OWN:
            return "distribuuuu"
        if name in _torchvision_names():
            return "torchvision"
    if not timm_installed():
        return None
    import timm

    return "timm" if timm.is_model(timm_name) else None


def is_model(name: str) -> bool:
    """True when :func:`build_model` knows ``name``."""
    return model_library(name) is not None


def build_model(
    name: str, num_classes: int, pretrained: bool = False, **options
) -> nn.Module:
    """Build architecture ``name`` with a ``num_classes``-way head.

    ``pretrained`` loads torchvision's (or timm's) ImageNet weights; a head of
    another size is left freshly initialised.  ``options`` go to the
    constructor (see :func:`model_options`).
    """
    library = model_library(name)
    if library == "distribuuuu":
        if pretrained:
            raise ValueError(f"{name} has no pretrained weights")
        return _OWN[name](num_classes, **options)
    if library == "timm":
        import timm

        return timm.create_model(
            name.removeprefix(TIMM_PREFIX),
            pretrained=pretrained,
            num_classes=num_classes,
            **options,
        )
    import torchvision

    model = torchvision.models.get_model(
        name, weights=None, num_classes=num_classes, **options
    )
    if pretrained:
        source = torchvision.models.get_model(name, weights="DEFAULT")
        own = model.state_dict()
        state = {
            k: v for k, v in source.state_dict().items() if own[k].shape == v.shape
        }
        skipped = sorted(set(own) - set(state))
        model.load_state_dict(state, strict=False)
        if skipped:
            logger.info(
                "pretrained %s: head left freshly initialised: %s", name, skipped
            )
    return model


def model_options(spec: ModelSpec) -> dict:
    """The constructor arguments of MODEL.DROPOUT and MODEL.DROP_PATH for
    ``spec.arch`` (ValueError for one of ours whose constructor has no such
    argument)."""
    library = model_library(spec.arch)
    own = _OWN.get(spec.arch) if library == "distribuuuu" else None
    arguments = inspect.signature(own).parameters if own else ()
    return regularize.constructor_options(spec, library, arguments)


def _build_with_options(
    spec: ModelSpec, num_classes: int, options: dict
) -> tuple[nn.Module, list[str]]:
    """The model of ``spec`` with the ``options`` its constructor takes; the
    names of those it has no argument for."""
    options = dict(options)
    refused: list[str] = []
    while True:
        try:
            model = build_model(
                spec.arch, num_classes, pretrained=spec.pretrained, **options
            )
            return model, refused
        except TypeError as error:  # a constructor without that argument
            if not options:
                raise
            named = [arg for arg in options if f"'{arg}'" in str(error)]
            if not named:
                raise ValueError(
                    f"MODEL.DROPOUT or MODEL.DROP_PATH: {spec.arch} has no such "
                    "layers to set"
                ) from None
            refused.append(named[0])
            del options[named[0]]


def build_configured(spec: ModelSpec, num_classes: int | None = None) -> nn.Module:
    """The model of ``spec`` (the MODEL section), its regularisation applied;
    ``num_classes`` replaces the spec's head size."""
    arch = spec.arch
    classes = spec.num_classes if num_classes is None else num_classes
    model, refused = _build_with_options(spec, classes, model_options(spec))
    library = model_library(arch)
    logger.info("model: %s built by %s", arch, library)
    done = regularize.regularize(model, spec, timm=library == "timm", refused=refused)
    if done:
        logger.info("model: %s", ", ".join(done))
    return model


def _last_residual_norm(block: nn.Module) -> nn.Module | None:
    """The normalization that ends the residual branch of a ResNet block:
    torchvision's and our small ResNets' (bn2 of a BasicBlock, bn3 of a
    Bottleneck)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    if isinstance(block, Bottleneck):
        return block.bn3
    if isinstance(block, BasicBlock | small.BasicBlock):
        return block.bn2
    return None


def zero_init_residual(model: nn.Module) -> int:
    """Zero the scale of the last normalization of every residual branch, so
    each block starts as the identity (Goyal et al. 2017, torchvision's
    ``zero_init_residual``); timm blocks do it themselves
    (``zero_init_last``).  The number of blocks changed (0: none found)."""
    count = 0
    for module in model.modules():
        zero_init_last = getattr(module, "zero_init_last", None)
        if callable(zero_init_last):  # timm's blocks
            zero_init_last()
            count += 1
            continue
        norm = _last_residual_norm(module)
        if norm is not None and isinstance(norm.weight, torch.Tensor):  # not None
            nn.init.zeros_(norm.weight)
            count += 1
    return count


def _timm_block_types() -> tuple[type, ...]:
    """Classes of :data:`_TIMM_BLOCKS` in the installed timm; none before timm
    is imported (no timm model can exist then, and the import costs time)."""
    if "timm" not in sys.modules:
        return ()
    found = []
    for module_name, class_names in _TIMM_BLOCKS.items():
        try:
            module = importlib.import_module(f"timm.models.{module_name}")
        except ImportError:
            continue
        found += [
            getattr(module, name) for name in class_names if hasattr(module, name)
        ]
    return tuple(found)


def _block_types() -> tuple[type, ...]:
    """Classes of the repeated blocks of the registry's model families."""
    from torchvision.models import (
        convnext,
        efficientnet,
        mobilenetv2,
        mobilenetv3,
        regnet,
        resnet,
        swin_transformer,
        vision_transformer,
    )

    return (
        small.BasicBlock,
        vit.Block,
        botnet.AttentionBottleneck,
        resnet.BasicBlock,
        resnet.Bottleneck,
        efficientnet.MBConv,
        efficientnet.FusedMBConv,
        regnet.ResBottleneckBlock,
        vision_transformer.EncoderBlock,
        convnext.CNBlock,
        swin_transformer.SwinTransformerBlock,
        mobilenetv2.InvertedResidual,
        mobilenetv3.InvertedResidual,
        *_timm_block_types(),
    )


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost residual / transformer blocks of ``model``, in order.

    These are the units of activation checkpointing (and of sharding): the
    blocks of the torchvision and small models of the registry and of the
    common timm families (ResNet, ResNetV2 / BiT, RegNet, ByobNet, EfficientNet
    / MobileNet, ReXNet, GhostNet, ConvNeXt, ViT / DeiT, EVA, BEiT, Swin,
    MLP-Mixer).
    """
    types, found = _block_types(), []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, types):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found
