"""Layer ids for layer-wise learning-rate decay (OPTIM.LAYER_DECAY).

A parameter's layer id counts from the input: 0 for the embedding (the stem),
``i + 1`` for the i-th block, ``L + 1`` for what follows the last of ``L``
blocks (final norm, head).  The ids follow BEiT's fine-tuning recipe (Bao et
al. 2021) for ViTs; ConvNeXt's blocks are counted across its stages, each
downsampling layer going with the stage it starts, as the ConvNeXt paper's
fine-tuning code does.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from distribuuuu.models import vit


def _by_pattern(names: list[str], stem: str, block: str, blocks: int) -> dict:
    ids = {}
    for name in names:
        match = re.match(block, name)
        if match:
            ids[name] = int(match.group(1)) + 1
        else:
            ids[name] = 0 if re.match(stem, name) else blocks + 1
    return ids


def _convnext(model: Any, names: list[str]) -> tuple[dict, int]:
    """torchvision's ConvNeXt (untyped): features 0 the stem, odd features the
    stages of blocks, even ones the downsampling before the next stage."""
    first, count = {}, 0  # the id of each stage's first block
    for index in range(1, len(model.features), 2):
        first[index] = count + 1
        count += len(model.features[index])
    ids = {}
    for name in names:
        match = re.match(r"features\.(\d+)\.(\d+)\.", name)
        index = int(match.group(1)) if match else -1
        if name.startswith("features.0."):
            ids[name] = 0
        elif match and index in first:  # (index -1 is never in first)
            ids[name] = first[index] + int(match.group(2))
        elif index + 1 in first:  # a downsampling layer: the next stage's
            ids[name] = first[index + 1]
        else:
            ids[name] = count + 1
    return ids, count


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int] | None:
    """Each parameter name's layer id and the number of blocks, for the
    families that have them (ViTs, ConvNeXt); None for another model."""
    from torchvision.models import ConvNeXt, VisionTransformer

    names = [name for name, _ in model.named_parameters()]
    if isinstance(model, vit.VisionTransformer):
        blocks = len(model.blocks)
        stem = r"(cls_token|pos_embed|patch_embed)"
        return _by_pattern(names, stem, r"blocks\.(\d+)\.", blocks), blocks
    if isinstance(model, VisionTransformer):
        blocks = len(model.encoder.layers)
        stem = r"(class_token|conv_proj|encoder\.pos_embedding)"
        block = r"encoder\.layers\.encoder_layer_(\d+)\."
        return _by_pattern(names, stem, block, blocks), blocks
    if isinstance(model, ConvNeXt):
        return _convnext(model, names)
    return None
