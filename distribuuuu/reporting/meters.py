"""Metric sums kept on the device, reduced across processes only when read."""

from __future__ import annotations

import collections
import datetime
import resource
import statistics
import sys

import torch

from distribuuuu.dist import group as du


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...]):
    """Number of samples whose target is among the top-k logits, for each k;
    with multi-hot targets (N x C), whose top-k logits hold one of its labels."""
    top = logits.topk(max(ks), dim=1).indices
    if targets.ndim == 2:
        hits = targets.gather(1, top) > 0.5
    else:
        hits = top.eq(targets.unsqueeze(1))
    return torch.stack([hits[:, :k].any(dim=1).sum() for k in ks])


class MetricSums:
    """Sums of loss, top-1 hits, top-k hits and samples, on the device.

    ``update`` never synchronizes with the host; ``reduce`` sums over all
    processes (every rank must call it at the same point) and returns floats.
    """

    def __init__(self, device: torch.device, topk: int):
        self.topk = topk
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def update(
        self, loss_sum: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
    ):
        """Add a batch: ``loss_sum`` is the summed (not averaged) loss."""
        hits = topk_correct(logits, targets, (1, self.topk))
        batch = torch.stack([loss_sum.double(), *hits.double()])
        self.sums[:3] += batch
        self.sums[3] += targets.shape[0]

    def reduce(self) -> dict:
        """Global totals: loss (mean), top1 and topk (percent), samples."""
        loss, top1, topk, samples = du.all_reduce_sum(self.sums.clone()).tolist()
        samples = int(samples)
        scale = 100.0 / max(samples, 1)
        return {
            "loss": loss / max(samples, 1),
            "top1": top1 * scale,
            "topk": topk * scale,
            "samples": samples,
        }

    def reset(self) -> None:
        """Start new sums."""
        self.sums.zero_()


class ConfusionMatrix:
    """Counts of (true class, predicted class) pairs, on the device.

    ``update`` never synchronizes with the host; ``reduce`` sums over all
    processes (a collective) and returns a CPU int64 matrix whose row ``t``
    holds the predictions for the samples of class ``t``.
    """

    def __init__(self, device: torch.device, num_classes: int):
        self.num_classes = num_classes
        self.counts = torch.zeros(num_classes**2, dtype=torch.int64, device=device)

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Add a batch of predictions; a label outside ``[0, num_classes)`` is an
        error (IndexError on the CPU, a device-side assert on CUDA)."""
        pairs = targets * self.num_classes + logits.argmax(dim=1)
        # index_add_, not torch.bincount: on CUDA bincount reads the min and max
        # of its input back to the host to size its output (two synchronizations
        # per batch), where index_add_ adds into the counts we already hold.
        self.counts.index_add_(0, pairs, torch.ones_like(pairs))

    def reduce(self) -> torch.Tensor:
        """The global matrix (num_classes x num_classes) on the CPU."""
        counts = du.all_reduce_sum(self.counts.clone()).cpu()
        return counts.view(self.num_classes, self.num_classes)


def per_class_top1(matrix: torch.Tensor) -> list[float | None]:
    """Top-1 accuracy (percent) of each class; None for a class without samples."""
    samples = matrix.sum(dim=1).tolist()
    correct = matrix.diagonal().tolist()
    return [100.0 * c / n if n else None for c, n in zip(correct, samples)]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process on ``device``, in MiB.

    CUDA: the most memory tensors held on ``device`` since the last
    ``torch.cuda.reset_peak_memory_stats`` (``max_memory_allocated``); CPU:
    the peak resident set size since the process started (``ru_maxrss``,
    which cannot be reset).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # B or KiB


class PeakMemory:
    """Peak memory of a phase of the run (a training epoch, an evaluation) on
    each of this process's devices.

    :meth:`reset` starts the phase, :meth:`read` gives one figure per device.
    On the CPU there is nothing to reset: the figure is the process's peak
    resident set size since it started.
    """

    def __init__(self, devices: list[torch.device]):
        self.devices = list(devices)

    def reset(self) -> None:
        """Forget the peaks so far (CUDA devices)."""
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> list[float]:
        """The peak of each device since :meth:`reset`, in MiB."""
        return [peak_memory_mb(device) for device in self.devices]


class DataBoundWatch:
    """Tells once per run when loading data holds the training steps back.

    It trips when the data share of the step time exceeds a threshold in
    ``windows`` logged windows in a row: one slow window (a worker start, a
    cold file cache) is not a data-bound run.
    """

    def __init__(self, windows: int = 3):
        self.windows, self.in_a_row, self.tripped = windows, 0, False

    def update(self, data_s: float, step_s: float, share: float) -> bool:
        """Add a window's mean data and step seconds; True the first time it trips.

        ``share`` 0 turns the watch off.
        """
        slow = share > 0 and data_s > share * step_s
        self.in_a_row = self.in_a_row + 1 if slow else 0
        if self.tripped or self.in_a_row < self.windows:
            return False
        self.tripped = True
        return True


class GradSpikeWatch:
    """Tells once per run when the gradient norm jumps: past ``factor`` times
    the median of the last ``history`` norms logged before it (once there are
    ``warmup`` of them)."""

    def __init__(self, history: int = 100, warmup: int = 5):
        self.norms: collections.deque[float] = collections.deque(maxlen=history)
        self.warmup, self.tripped = warmup, False

    def update(self, norm: float, factor: float) -> float | None:
        """Add a logged norm; the median it exceeds ``factor`` times, the
        first time one does (None otherwise; ``factor`` 0 turns it off)."""
        enough = len(self.norms) >= self.warmup
        median = statistics.median(self.norms) if enough else None
        self.norms.append(norm)
        if factor <= 0 or self.tripped or median is None:
            return None
        if not norm > factor * median:  # a NaN norm is no spike
            return None
        self.tripped = True
        return median


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """A text bar such as ``[#####-----]`` for ``done`` out of ``total``."""
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (or ``D days, H:MM:SS``) for a number of seconds."""
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))
