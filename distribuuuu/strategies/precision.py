"""Mixed precision: what TRAIN.MIXED_PRECISION ``auto`` stands for on a device,
and the autocast dtype of a precision."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def resolve_precision(
    name: str, device: torch.device
) -> tuple[torch.dtype | None, bool]:
    """Autocast dtype (None = full precision) and whether to scale the loss.

    fp16 uses a GradScaler on CUDA; on other devices it falls back to bf16,
    whose range needs no loss scaling.
    """
    if name == "auto":
        raise ValueError("TRAIN.MIXED_PRECISION auto must be resolved for the device")
    if name == "none":
        return None, False
    if name == "fp16" and device.type != "cuda":
        logger.info("TRAIN.MIXED_PRECISION fp16 on %s: using bf16 instead", device.type)
        name = "bf16"
    return (torch.float16, True) if name == "fp16" else (torch.bfloat16, False)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of the CUDA device ``device`` (major, minor)."""
    return torch.cuda.get_device_capability(device)


def auto_precision(
    device: torch.device,
    fp16_allowed: bool,
    capability: Callable[[torch.device], tuple[int, int]] | None = None,
) -> str:
    """The precision ``auto`` stands for on ``device``.

    bf16 on CUDA devices that compute in it natively (compute capability 8.0,
    Ampere, and newer: the bf16 tensor cores of the A100 whitepaper; older
    GPUs would emulate it slowly), fp16 with a GradScaler on older CUDA
    devices where the strategy takes fp16 (``fp16_allowed``), and none
    otherwise; none on the CPU, where bf16 autocast ran about 10x slower than
    float32 on the CPU we measured (README, "Performance").  ``capability``
    (default :func:`cuda_capability`) answers for the device itself, not for
    the current CUDA device.
    """
    if device.type != "cuda":
        return "none"
    capability = capability or cuda_capability
    if torch.version.hip or capability(device)[0] >= 8:
        return "bf16"
    return "fp16" if fp16_allowed else "none"


def resolve_auto_precision(
    requested: str, device: torch.device, fp16_allowed: bool
) -> str:
    """The precision the run uses for TRAIN.MIXED_PRECISION ``requested`` on
    ``device``: what ``auto`` stands for there (see :func:`auto_precision`;
    ``fp16_allowed``: the run's strategy takes fp16), an explicit value as
    it is.  The config keeps ``auto``: the resolved value is the run's."""
    if requested != "auto":
        return requested
    return auto_precision(device, fp16_allowed)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device`` in ``dtype``; off when ``dtype`` is None."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
