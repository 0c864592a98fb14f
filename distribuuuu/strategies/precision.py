"""Mixed precision: what TRAIN.MIXED_PRECISION ``auto`` stands for on a device,
and the autocast dtype of a precision."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from yacs.config import CfgNode

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


def fp16_allowed(cfg: CfgNode) -> bool:
    """Whether the run's strategy takes fp16 (FSDP, the pipeline, DeepSpeed and
    tensor parallelism refuse it: see distribuuuu.config.validation)."""
    refused = cfg.DIST.STRATEGY in ("fsdp", "pipeline", "deepspeed")
    return not (refused or cfg.DIST.TENSOR_PARALLEL > 1)


def resolve_auto_precision(cfg: CfgNode, device: torch.device) -> None:
    """Replace TRAIN.MIXED_PRECISION ``auto`` in ``cfg`` with what it stands for
    on ``device`` (logged), so that the saved config.yaml holds the precision
    the run used; an explicit value is left as it is."""
    if cfg.TRAIN.MIXED_PRECISION != "auto":
        return
    name = auto_precision(device, fp16_allowed(cfg))
    was_frozen = cfg.is_frozen()
    cfg.defrost()
    cfg.TRAIN.MIXED_PRECISION = name
    if was_frozen:
        cfg.freeze()
    logger.info("TRAIN.MIXED_PRECISION auto on %s: %s", device, name)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device`` in ``dtype``; off when ``dtype`` is None."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
