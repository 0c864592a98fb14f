"""Fakes for testing device choices on a machine without a GPU: torch.cuda's
device calls, and a model whose moves to a GPU are recorded, not made."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class FakeCuda:
    """torch.cuda's current device and device count, for a process that sees
    ``count`` GPUs; :meth:`install` puts it in torch.cuda for one test."""

    def __init__(self, count: int, current: int = 0):
        self.count, self.current = count, current
        self.set_to: list[int] = []  # every set_device, in order

    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index})")
        self.current = index
        self.set_to.append(index)

    def current_device(self) -> int:
        return self.current

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        return self


class GpuShyLinear(nn.Linear):
    """A layer that records a move to a GPU instead of making it.

    ``moved_to`` is the GPU it was sent to; a deep copy keeps it, so a copy
    tells whether it was made before or after the move.
    """

    moved_to: torch.device | None = None

    def __init__(self):
        super().__init__(4, 2)

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        a_device = isinstance(target, str | torch.device)
        if a_device and torch.device(target).type == "cuda":
            self.moved_to = torch.device(target)
            return self
        return super().to(*args, **kwargs)
