"""What the model-side helpers need to know about wrapped models."""

from __future__ import annotations

from typing import cast

from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP (or DataParallel) wrapper."""
    return cast(nn.Module, model.module) if hasattr(model, "module") else model
