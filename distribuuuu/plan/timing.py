"""Timing on a device: the median of a few calls, the device synchronized."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device's kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``run()`` after one warm-up call."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - tic)
    return statistics.median(times)
