"""Mixed precision: the autocast dtype of TRAIN.MIXED_PRECISION on a device."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def resolve_precision(
    name: str, device: torch.device
) -> tuple[torch.dtype | None, bool]:
    """Autocast dtype (None = full precision) and whether to scale the loss.

    fp16 uses a GradScaler on CUDA; on other devices it falls back to bf16,
    whose range needs no loss scaling.
    """
    if name == "none":
        return None, False
    if name == "fp16" and device.type != "cuda":
        logger.info("TRAIN.MIXED_PRECISION fp16 on %s: using bf16 instead", device.type)
        name = "bf16"
    return (torch.float16, True) if name == "fp16" else (torch.bfloat16, False)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device`` in ``dtype``; off when ``dtype`` is None."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
