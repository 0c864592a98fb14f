"""The slow-rank report: each rank's wait for data and compute time per step,
carried to rank 0 by a stop check, and the rank that holds the others back.

Data-parallel ranks wait for each other in every step's gradient sync, so
one slow rank (a starved loader, a throttled device) slows them all, and
nothing else in the log says which one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# What names a slow rank: its wait for data, or its compute.
DATA, COMPUTE = "data", "compute"


class ComputeClock:
    """Seconds this rank spends computing its training steps.

    On a CPU the host's clock; on CUDA a pair of timing events per step,
    recorded on the current stream and read (a host synchronization) only
    in :meth:`read`, after the reading step's metrics synchronized anyway.
    """

    def __init__(
        self,
        device: torch.device,
        event: Callable[[], torch.cuda.Event] | None = None,
    ):
        self.seconds = 0.0  # measured on the host, or read from the events
        self.tic, self.running = 0.0, False
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self.event = event
        if event is None and device.type == "cuda":
            self.event = lambda: torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        """A step's compute begins (its first micro-batch is in)."""
        self.running = True
        if self.event is None:
            self.tic = time.perf_counter()
            return
        self.spans.append((self.event(), self.event(), 0.0))
        self.spans[-1][0].record()

    def stop(self, waited: float = 0.0) -> None:
        """The step's compute ends; ``waited``: seconds of it spent waiting for
        the loader (its later micro-batches), which do not count."""
        if not self.running:  # the step had no micro-batch
            return
        self.running = False
        if self.event is None:
            self.seconds += max(time.perf_counter() - self.tic - waited, 0.0)
            return
        begin, end, _ = self.spans[-1]
        end.record()
        self.spans[-1] = (begin, end, waited)

    def read(self) -> float:
        """The seconds measured since the last read (and start afresh)."""
        seconds, self.seconds = self.seconds, 0.0
        if self.spans:
            self.spans[-1][1].synchronize()  # done already after a metrics read
        for begin, end, waited in self.spans:
            seconds += max(begin.elapsed_time(end) / 1000 - waited, 0.0)
        self.spans.clear()
        return seconds


@dataclass(frozen=True)
class SlowRank:
    """A rank that holds the others back, and by how much (seconds per step)."""

    rank: int
    cause: str  # DATA or COMPUTE: which part of its step is slow
    step: float  # its step, without waiting for the other ranks
    median_step: float  # the median rank's
    part: float  # its wait for data, or its compute
    median_part: float  # the median rank's


def slow_rank(rows: list[list[float]], ratio: float) -> SlowRank | None:
    """The rank whose step takes more than ``ratio`` times the median rank's,
    and whether its wait for data or its compute is slow (None: none is).

    ``rows``: every rank's ``[data, compute]`` seconds per step.  A rank's
    compute includes its wait for the others in the gradient sync: the rank
    that waited least, the one with the least compute, stands for what each
    computes alone.  So the rank that waits longest for data is slow when its
    wait plus that exceeds ``ratio`` times the median wait plus that.  Ranks
    that synchronize every step measure about the same whole step; a rank's
    compute is named only where its whole step exceeds ``ratio`` times the
    median step and its compute is what exceeds the median most.
    """
    data = [row[0] for row in rows]
    compute = [row[1] for row in rows]
    alone, median_data = min(compute), statistics.median(data)
    rank = max(range(len(rows)), key=data.__getitem__)
    step, median_step = data[rank] + alone, median_data + alone
    if step > ratio * median_step:
        return SlowRank(rank, DATA, step, median_step, data[rank], median_data)
    steps = [sum(row) for row in rows]
    rank = max(range(len(rows)), key=steps.__getitem__)
    median_step, median_compute = statistics.median(steps), statistics.median(compute)
    longer = steps[rank] > ratio * median_step
    if longer and compute[rank] - median_compute > data[rank] - median_data:
        return SlowRank(
            rank, COMPUTE, steps[rank], median_step, compute[rank], median_compute
        )
    return None


class SlowRankWatch:
    """Carries this rank's timings of a print window to the next stop check,
    and names a slow rank once per rank and cause (LOG.STRAGGLER_RATIO)."""

    def __init__(self) -> None:
        self.held: tuple[float, float] | None = None  # this rank's, to carry
        self.rows: list[list[float]] | None = None  # every rank's, carried
        self.named: set[tuple[int, str]] = set()

    def hold(self, data_s: float, compute_s: float) -> None:
        """This rank's seconds per step waiting for data and computing, for
        the next stop check to carry."""
        self.held = (data_s, compute_s)

    def take(self) -> tuple[float, float] | None:
        """What :meth:`hold` gave, once (None: nothing new to carry)."""
        held, self.held = self.held, None
        return held

    def update(self, ratio: float) -> SlowRank | None:
        """The slow rank of the rows carried last, the first time that rank
        is named for that cause (None otherwise; ``ratio`` 0 turns it off)."""
        rows, self.rows = self.rows, None
        if not rows or ratio <= 0:
            return None
        found = slow_rank(rows, ratio)
        if found is None or (found.rank, found.cause) in self.named:
            return None
        self.named.add((found.rank, found.cause))
        return found
