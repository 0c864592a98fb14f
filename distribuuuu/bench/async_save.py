"""Training blocked by a checkpoint save, at once and in the background, for
tools/benchmark.py (``--only async``).

One process saves a training-like state (a model's weights and two optimizer
buffers of each, ``megabytes`` in all) through
:class:`distribuuuu.checkpoint.CheckpointWriter`, the writer a run uses, as
CHECKPOINT.ASYNC False and True, alternating repeat after repeat.  A figure
is the seconds from the save's start until training could go on (the save
returned); beside the background's, the seconds until its file was complete.
The files go to a temporary folder on the local disk; each save's ``fsync``
waits for the disk, as a run's does.
"""

from __future__ import annotations

import tempfile
import time

import torch

from distribuuuu.bench.overheads import summarize
from distribuuuu.checkpoint import CheckpointWriter, Retention

SIDES = ("at once", "background")


def training_state(megabytes: int) -> dict:
    """A state of about ``megabytes`` MB: weights and two optimizer buffers
    (as SGD with momentum and an EMA would keep) of 1 M-float tensors."""
    count = max(1, megabytes * 10**6 // (3 * 4 * 2**20))
    weights = {f"layer{i}.weight": torch.randn(2**20) for i in range(count)}
    return {
        "model": weights,
        "optimizer": {name: torch.zeros_like(t) for name, t in weights.items()},
        "ema": {name: t.clone() for name, t in weights.items()},
        "epoch": 0,
    }


def _save(writer: CheckpointWriter, state: dict, step: int) -> tuple[float, float]:
    """Seconds training is blocked by one save, and until it is complete."""
    started = time.perf_counter()
    writer.save((0, step), state, Retention(keep=1), None, started)
    blocked = time.perf_counter() - started
    writer.finish()
    return blocked, time.perf_counter() - started


def measure_async_save(megabytes: int = 512, repeats: int = 3) -> dict:
    """Blocked and complete seconds of each side, and the blocked ratio of
    the background to a save at once."""
    state = training_state(megabytes)
    parts = ("model", "optimizer", "ema")
    size = sum(t.numel() * 4 for part in parts for t in state[part].values())
    blocked: dict[str, list[float]] = {side: [] for side in SIDES}
    complete: dict[str, list[float]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="distribuuuu-async-") as out_dir:
        writers = {side: CheckpointWriter(out_dir, side == SIDES[1]) for side in SIDES}
        for repeat in range(repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            for number, side in enumerate(order):
                step = 1 + 2 * repeat + number
                seconds = _save(writers[side], state, step)
                blocked[side].append(seconds[0])
                complete[side].append(seconds[1])
    ratios = [b / a for a, b in zip(blocked[SIDES[0]], blocked[SIDES[1]])]
    return {
        "megabytes": size / 1e6,
        "blocked": {side: summarize(values) for side, values in blocked.items()},
        "complete": {side: summarize(values) for side, values in complete.items()},
        "ratio": summarize(ratios),
    }


def format_async_save(result: dict) -> str:
    """The rows of the benchmark table."""

    def cells(figures: dict) -> str:
        return "  ".join(
            f"{side} {figures[side]['median']:.3f} ({figures[side]['min']:.3f}-"
            f"{figures[side]['max']:.3f})"
            for side in SIDES
        )

    ratio = result["ratio"]
    return (
        f"{'save blocked':<18} {'s':<6} {cells(result['blocked'])}  ratio "
        f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})\n"
        f"{'save complete':<18} {'s':<6} {cells(result['complete'])}  "
        f"({result['megabytes']:.0f} MB a save)"
    )
