"""MODEL.DROPOUT, MODEL.DROP_PATH, MODEL.BN_MOMENTUM and MODEL.BN_EPS, applied
to a model that has the layers they set, and refused (ValueError naming the
key) for one that has not.

Dropout and stochastic depth go through the model's own constructor argument
(ours' ``dropout`` and ``drop_path``, torchvision's ``dropout`` and
``stochastic_depth_prob``, timm's ``drop_rate`` and ``drop_path_rate``), so
each family keeps its own placement and per-block schedule.  What torchvision
has no argument for is added after building, with the checkpoint keys
unchanged: stochastic depth on both residual branches of every block of its
ViTs and on the residual branch of every block of its ResNets, its rate
rising linearly with depth (:func:`drop_path_rates`); and dropout before the
classifier (its last linear layer) of a model without a dropout layer of its
own, where timm's ``drop_rate`` puts it.  A constructor that swallows an
unknown argument is caught by looking for the layers afterwards.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.models import resnet as torchvision_resnet
from torchvision.ops import StochasticDepth

from distribuuuu.models.spec import ModelSpec

# Constructor arguments -> the key that gives them.
OPTION_KEYS = {
    "dropout": "DROPOUT",
    "drop_rate": "DROPOUT",
    "stochastic_depth_prob": "DROP_PATH",
    "drop_path_rate": "DROP_PATH",
    "drop_path": "DROP_PATH",
}
# The arguments of MODEL.DROPOUT and MODEL.DROP_PATH, by who builds the model.
_ARGUMENTS = {
    "distribuuuu": ("dropout", "drop_path"),
    "torchvision": ("dropout", "stochastic_depth_prob"),
    "timm": ("drop_rate", "drop_path_rate"),
}
# torchvision's arguments whose layers are added after building when its
# constructor has no such argument.
ADDED_AFTER = ("dropout", "stochastic_depth_prob")


def drop_path_rates(rate: float, blocks: int) -> list[float]:
    """The stochastic depth of each of ``blocks`` blocks in order, block i of
    L at ``rate * i / (L - 1)``: none at the first, ``rate`` at the last.

    The linear rule of timm's ResNets (``make_blocks`` in ``resnet.py``, which
    the ResNet-strikes-back recipes train with) and of DeiT's ViTs; Huang et
    al. ("Deep Networks with Stochastic Depth", 2016) count from the input,
    so that their first block already drops at ``rate / L``.
    """
    return [rate * index / max(blocks - 1, 1) for index in range(blocks)]


def _is_torchvision_vit(arch: str, model: nn.Module | None = None) -> bool:
    from torchvision.models import VisionTransformer

    if model is not None:
        return isinstance(model, VisionTransformer)
    return arch.startswith("vit_")


def constructor_options(
    spec: ModelSpec, library: str | None, own: Collection[str] = ()
) -> dict:
    """The constructor arguments that MODEL.DROPOUT and MODEL.DROP_PATH give
    ``spec.arch`` (a negative value keeps the model's own); ``library``: who
    builds it (``distribuuuu``, ``torchvision`` or ``timm``); ``own``: the
    arguments of the constructor of one of ours, which refuses a key it has
    no argument for."""
    arch = spec.arch
    torchvision_vit = library == "torchvision" and _is_torchvision_vit(arch)
    if spec.dropout >= 0 and torchvision_vit:
        raise ValueError(
            f"MODEL.DROPOUT: {arch} has no classifier dropout (torchvision's "
            "dropout argument of its ViTs is the encoder's)"
        )
    names = _ARGUMENTS.get(library or "", _ARGUMENTS["torchvision"])
    options = {}
    for name, value in zip(names, (spec.dropout, spec.drop_path)):
        if value < 0:
            continue
        if library == "distribuuuu" and name not in own:
            raise ValueError(
                f"MODEL.{OPTION_KEYS[name]}: {arch} has no such layers to set"
            )
        options[name] = value
    if torchvision_vit:  # added after building
        options.pop("stochastic_depth_prob", None)
    return options


def _vit_drop_path(model: Any, rate: float) -> None:
    """Stochastic depth on torchvision's ViT (untyped): after the attention's
    dropout and at the end of the MLP of block i of L, with probability
    rate * i / (L - 1)."""
    blocks = list(model.encoder.layers)
    for block, p in zip(blocks, drop_path_rates(rate, len(blocks))):
        block.dropout = nn.Sequential(block.dropout, StochasticDepth(p, "row"))
        block.mlp.append(StochasticDepth(p, "row"))


class _BasicBlockWithDropPath(torchvision_resnet.BasicBlock):
    """torchvision's BasicBlock whose residual branch ``drop_path`` scales
    before the shortcut is added (where timm's ResNet blocks have it)."""

    drop_path: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.drop_path(self.bn2(self.conv2(out)))
        return self.relu(out + shortcut)


class _BottleneckWithDropPath(torchvision_resnet.Bottleneck):
    """torchvision's Bottleneck whose residual branch ``drop_path`` scales
    before the shortcut is added."""

    drop_path: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.drop_path(self.bn3(self.conv3(out)))
        return self.relu(out + shortcut)


_WITH_DROP_PATH: dict[type, type] = {
    torchvision_resnet.BasicBlock: _BasicBlockWithDropPath,
    torchvision_resnet.Bottleneck: _BottleneckWithDropPath,
}


def _resnet_drop_path(model: nn.Module, rate: float) -> int:
    """Stochastic depth on the residual branch of each block of torchvision's
    ResNets (and ResNeXts, wide ResNets) at :func:`drop_path_rates`; how many
    blocks.  A block becomes its subclass above: its weights, their names and
    ``isinstance`` stay."""
    blocks = [m for m in model.modules() if type(m) in _WITH_DROP_PATH]
    for block, p in zip(blocks, drop_path_rates(rate, len(blocks))):
        block.__class__ = _WITH_DROP_PATH[type(block)]
        block.drop_path = StochasticDepth(p, "row")
    return len(blocks)


class DropoutLinear(nn.Linear):
    """A linear classifier that drops its inputs first (``dropout``), holding
    the parameters of the linear layer it replaces under the same names."""

    def __init__(self, linear: nn.Linear, p: float):
        sizes, bias = (linear.in_features, linear.out_features), linear.bias is not None
        super().__init__(*sizes, bias=bias, device="meta")  # replaced below
        self.weight, self.bias = linear.weight, linear.bias
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.dropout(x))


def _classifier_dropout(model: nn.Module, p: float) -> None:
    """Dropout before the classifier, the last linear layer of ``model``."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears:
        parent, _, name = linears[-1].rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, DropoutLinear(getattr(owner, name), p))


def _has_drop_path(model: nn.Module) -> bool:
    return any(
        isinstance(m, StochasticDepth) or type(m).__name__ == "DropPath"
        for m in model.modules()
    )


def _set_drop_path(
    model: nn.Module, spec: ModelSpec, timm: bool, refused: Collection[str]
) -> str:
    """MODEL.DROP_PATH, added where the constructor could not give it."""
    arch, rate = spec.arch, spec.drop_path
    if _is_torchvision_vit(arch, model):
        _vit_drop_path(model, rate)
    elif "stochastic_depth_prob" in refused and not _resnet_drop_path(model, rate):
        raise ValueError(f"MODEL.DROP_PATH: {arch} has no such layers to set")
    timm_default = timm and rate == 0
    if not (_has_drop_path(model) or timm_default):
        raise ValueError(f"MODEL.DROP_PATH: {arch} has no stochastic depth")
    return f"drop path {rate:g}"


def _set_dropout(model: nn.Module, spec: ModelSpec, timm: bool) -> str:
    """MODEL.DROPOUT, before the classifier of a model that has no dropout
    layer of its own (its constructor has no such argument, or swallows it);
    timm's models place their own."""
    p = spec.dropout
    before = not timm and not any(isinstance(m, nn.Dropout) for m in model.modules())
    if before:
        _classifier_dropout(model, p)
    found = getattr(model, "drop_rate", None) == p or any(
        isinstance(m, nn.Dropout) and m.p == p for m in model.modules()
    )
    if not found:
        raise ValueError(f"MODEL.DROPOUT: {spec.arch} has no dropout it sets")
    where = " before the classifier" if before else ""
    return f"dropout {p:g}{where}"


def regularize(
    model: nn.Module,
    spec: ModelSpec,
    timm: bool = False,
    refused: Collection[str] = (),
) -> list[str]:
    """Set what the constructor could not on the built ``model`` of
    ``spec.arch``, check that every key asked for found its layers; what was
    set, for the log (``timm``: built by timm; ``refused``: the arguments of
    :func:`constructor_options` that the constructor has not)."""
    arch, done = spec.arch, []
    for name in refused:
        if name not in ADDED_AFTER:
            key = OPTION_KEYS[name]
            raise ValueError(f"MODEL.{key}: {arch} has no such layers to set")
    if spec.drop_path >= 0:
        done.append(_set_drop_path(model, spec, timm, refused))
    if spec.dropout >= 0:
        done.append(_set_dropout(model, spec, timm))
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    settings = [
        ("BN_MOMENTUM", "momentum", spec.bn_momentum),
        ("BN_EPS", "eps", spec.bn_eps),
    ]
    for key, attribute, value in settings:
        if value < 0:
            continue
        if not norms:
            raise ValueError(f"MODEL.{key}: {arch} has no BatchNorm layers")
        for norm in norms:
            setattr(norm, attribute, value)
        done.append(f"BatchNorm {attribute} {value:g} ({len(norms)} layers)")
    return done
