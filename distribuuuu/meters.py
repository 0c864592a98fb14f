"""Metric sums kept on the device, reduced across processes only when read."""

from __future__ import annotations

import datetime

import torch

from distribuuuu import distributed as du


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...]):
    """Number of samples whose target is among the top-k logits, for each k."""
    top = logits.topk(max(ks), dim=1).indices
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
        self.sums[3] += targets.numel()

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


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (or ``D days, H:MM:SS``) for a number of seconds."""
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))
