"""MODEL.DROPOUT, MODEL.DROP_PATH, MODEL.BN_MOMENTUM and MODEL.BN_EPS, applied
to a model that has the layers they set, and refused (ValueError naming the
key) for one that has not.

Dropout and stochastic depth go through the model's own constructor argument
(torchvision's ``dropout`` and ``stochastic_depth_prob``, timm's ``drop_rate``
and ``drop_path_rate``), so each family keeps its own placement and per-block
schedule; torchvision's ViT, which has no stochastic depth, gets it on both
residual branches of every encoder block, its rate rising linearly with depth
as in DeiT.  A constructor that swallows an unknown argument is caught by
looking for the layers afterwards.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from distribuuuu.models.spec import ModelSpec


def _is_torchvision_vit(arch: str, model: nn.Module | None = None) -> bool:
    from torchvision.models import VisionTransformer

    if model is not None:
        return isinstance(model, VisionTransformer)
    return arch.startswith("vit_")


def constructor_options(spec: ModelSpec, small: bool, timm: bool) -> dict:
    """The constructor arguments that MODEL.DROPOUT and MODEL.DROP_PATH give
    ``spec.arch`` (a negative value keeps the model's own); ``small``: one of
    ours, which has no such layers; ``timm``: built by timm."""
    arch, dropout, drop_path = spec.arch, spec.dropout, spec.drop_path
    for key, value in (("DROPOUT", dropout), ("DROP_PATH", drop_path)):
        if small and value >= 0:
            raise ValueError(f"MODEL.{key}: {arch} has no such layers to set")
    if dropout >= 0 and not timm and _is_torchvision_vit(arch):
        raise ValueError(
            f"MODEL.DROPOUT: {arch} has no classifier dropout (torchvision's "
            "dropout argument of its ViTs is the encoder's)"
        )
    options = {}
    if dropout >= 0:
        options["drop_rate" if timm else "dropout"] = dropout
    if drop_path >= 0 and (timm or not _is_torchvision_vit(arch)):
        options["drop_path_rate" if timm else "stochastic_depth_prob"] = drop_path
    return options


def _vit_drop_path(model: Any, rate: float) -> None:
    """Stochastic depth on torchvision's ViT (untyped): after the attention's
    dropout and at the end of the MLP of block i of L, with probability
    rate * i / (L - 1)."""
    from torchvision.ops import StochasticDepth

    blocks = list(model.encoder.layers)
    for index, block in enumerate(blocks):
        p = rate * index / max(len(blocks) - 1, 1)
        block.dropout = nn.Sequential(block.dropout, StochasticDepth(p, "row"))
        block.mlp.append(StochasticDepth(p, "row"))


def _has_drop_path(model: nn.Module) -> bool:
    from torchvision.ops import StochasticDepth

    return any(
        isinstance(m, StochasticDepth) or type(m).__name__ == "DropPath"
        for m in model.modules()
    )


def regularize(model: nn.Module, spec: ModelSpec, timm: bool = False) -> list[str]:
    """Set what the constructor could not on the built ``model`` of
    ``spec.arch``, check that every key asked for found its layers; what was
    set, for the log (``timm``: built by timm)."""
    arch, done = spec.arch, []
    if spec.drop_path >= 0:
        if _is_torchvision_vit(arch, model):
            _vit_drop_path(model, spec.drop_path)
        timm_default = timm and spec.drop_path == 0
        if not (_has_drop_path(model) or timm_default):
            raise ValueError(f"MODEL.DROP_PATH: {arch} has no stochastic depth")
        done.append(f"drop path {spec.drop_path:g}")
    if spec.dropout >= 0:
        p = spec.dropout
        found = getattr(model, "drop_rate", None) == p or any(
            isinstance(m, nn.Dropout) and m.p == p for m in model.modules()
        )
        if not found:
            raise ValueError(f"MODEL.DROPOUT: {arch} has no dropout it sets")
        done.append(f"dropout {p:g}")
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
