"""Test-time augmentation (TEST.TTA): the logits of an image averaged over
views of it.

``flip`` averages the image and its mirror; ``five_crop`` the four corner
crops and the centre crop of TEST.CROP_SIZE from the evaluation image, which
is then resized and cropped square to the evaluation resize instead;
``ten_crop`` those five and their mirrors.  The views of a batch go through
the model as one batch, so a sharded model runs one forward per batch as
without TTA, and each sample is still counted once.  Runs of a sigmoid loss
(MODEL.LOSS bce, asl) average the views' sigmoid probabilities instead.
"""

from __future__ import annotations

import torch
from torch import nn

TTA_MODES = ("none", "flip", "five_crop", "ten_crop")


def views(images: torch.Tensor, mode: str, crop: int) -> list[torch.Tensor]:
    """The views of a batch (N x C x H x W) that ``mode`` averages over."""
    if mode == "none":
        return [images]
    if mode == "flip":
        return [images, images.flip(-1)]
    height, width = images.shape[-2:]
    bottom, right = height - crop, width - crop
    corners = [(0, 0), (0, right), (bottom, 0), (bottom, right)]
    corners.append((bottom // 2, right // 2))
    crops = [images[..., t : t + crop, s : s + crop] for t, s in corners]
    if mode == "ten_crop":
        crops += [view.flip(-1) for view in crops]
    return crops


def tta_logits(
    model: nn.Module,
    images: torch.Tensor,
    mode: str,
    crop: int,
    sigmoid: bool = False,
):
    """``model``'s logits of ``images`` averaged over the views of ``mode``
    (None where the model returns none: a pipeline's earlier stages).

    ``sigmoid``: the logits whose sigmoid is the views' mean probability
    (the views' probabilities averaged, per class)."""
    if mode == "none":
        return model(images)
    seen = views(images, mode, crop)
    logits = model(torch.cat(seen))
    if logits is None:
        return None
    logits = logits.unflatten(0, (len(seen), images.shape[0]))
    if not sigmoid:
        return logits.mean(0)
    mean = torch.sigmoid(logits.float()).mean(0)
    return torch.logit(mean, eps=1e-7).to(logits.dtype)
