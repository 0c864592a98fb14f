"""The step profiler (``TRAIN.PROFILE_STEPS N``): ``torch.profiler`` over N
optimizer steps at the start of a launch.

In the first epoch this launch trains (fresh or resumed), the profiler skips
``SKIP_STEPS`` steps (one-time costs: allocator growth, cuDNN's benchmark,
lazy initialisation), warms up for ``WARMUP_STEPS`` (it runs, its events are
dropped, so its own start-up stays out of the trace) and records the next N.
An epoch with fewer steps left gets what fits, recorded steps first, and one
warning.  Every rank then writes its own trace and logs the operators with
the most self time and the share of the step time spent waiting for the
data loader.  When ``TRAIN.PROFILE_STEPS`` is 0 nothing here runs: no
profiler object, no labels in the loop.

One file per rank serves both viewers: ``OUT_DIR/profile/rank{R}.pt.trace.json``
is the Chrome trace-event JSON that Perfetto UI and ``chrome://tracing`` open,
named the way ``torch.profiler.tensorboard_trace_handler`` names its files
(``<worker>.pt.trace.json``), which is the pattern the PyTorch Profiler plugin
of tensorboard (``torch-tb-profiler``) looks for in the folders under its
logdir.  That plugin is deprecated (PyTorch points to Perfetto); the
maintained ``tensorboard-plugin-profile`` (XProf) reads XPlane files
(``plugins/profile/<run>/<host>.xplane.pb``), which ``torch.profiler`` does
not write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, record_function

from distribuuuu.dist import group as du
from distribuuuu.engine.state import TrainState

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
SKIP_STEPS = 1  # steps run unprofiled first
WARMUP_STEPS = 1  # then steps profiled but not recorded
STEP_LABEL = "train_step"  # the range of one optimizer step in the trace
DATA_LABEL = "data_wait"  # the range of one wait for the loader
TOP_OPERATORS = 15  # rows of the logged table


@dataclass(frozen=True)
class ProfileSpec:
    """TRAIN.PROFILE_STEPS: how many steps to profile, and the run's OUT_DIR."""

    steps: int  # optimizer steps recorded; 0: no profiling
    out_dir: str  # the traces go to out_dir/profile/


def trace_path(out_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its trace."""
    return os.path.join(out_dir, PROFILE_DIR, f"rank{rank}.pt.trace.json")


def profiler_activities(device: torch.device) -> list[ProfilerActivity]:
    """What the profiler records on ``device``: the host, and CUDA's kernels
    and copies when it is a CUDA device."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def plan_steps(wanted: int, steps_left: int) -> tuple[int, int, int]:
    """(skip, warm-up, recorded) steps of a profile of ``wanted`` steps in an
    epoch with ``steps_left``: recorded steps come first, then warm-up, then
    skipped ones, as far as the epoch holds them."""
    recorded = min(wanted, steps_left)
    warmup = min(WARMUP_STEPS, steps_left - recorded)
    skip = min(SKIP_STEPS, steps_left - recorded - warmup)
    return skip, warmup, recorded


class StepProfiler:
    """``torch.profiler`` over the first steps of an epoch (see the module doc).

    :meth:`watch` labels the waits for the loader, :meth:`step` wraps each
    optimizer step; :meth:`close` ends profiling early (a trace of the steps
    recorded so far is still written).
    """

    def __init__(
        self, spec: ProfileSpec, device: torch.device, rank: int, steps_left: int
    ):
        wanted = spec.steps
        skip, warmup, self.recorded = plan_steps(wanted, steps_left)
        if steps_left < SKIP_STEPS + WARMUP_STEPS + wanted:
            logger.warning(
                "TRAIN.PROFILE_STEPS %d: this epoch has %d steps left, so %d are "
                "profiled after %d skipped and %d of warm-up (instead of %d and "
                "%d); the first steps of a run carry one-time costs",
                wanted,
                steps_left,
                self.recorded,
                skip,
                warmup,
                SKIP_STEPS,
                WARMUP_STEPS,
            )
        self.path = trace_path(spec.out_dir, rank)
        activities = profiler_activities(device)
        self.cuda = ProfilerActivity.CUDA in activities
        if not self.cuda:
            # Kineto logs an ERROR line when it finds no GPU; on a CPU run that
            # is noise (a user's own KINETO_LOG_LEVEL wins).
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        with warnings.catch_warnings():
            # torch warns of a schedule without warm-up; ours said so above.
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=skip, warmup=warmup, active=self.recorded, repeat=1
            )
        self._profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._report
        )
        self.running, self._reported = True, False
        logger.info(
            "TRAIN.PROFILE_STEPS: profiling %d step(s) after %d skipped and %d of "
            "warm-up",
            self.recorded,
            skip,
            warmup,
        )
        self._profiler.start()

    @classmethod
    def for_epoch(
        cls, spec: ProfileSpec | None, state: TrainState, steps_left: int
    ) -> StepProfiler | None:
        """The profiler of the epoch about to train: None unless ``spec``
        profiles some steps and no step of this launch has run yet.  The MFU
        meter counts the model's FLOPs first, outside the trace."""
        clock = state.clock
        first_epoch = clock.done_iters == clock.start_iters
        if spec is None or spec.steps <= 0 or not first_epoch or steps_left <= 0:
            return None
        if state.flops is not None:  # counted before it starts: not in its trace
            state.flops.count_once(state.progress.epoch)
        return cls(spec, state.device, du.get_rank(), steps_left)

    def watch(self, batches: Iterator) -> Iterator:
        """``batches``, each wait for the next one labelled while profiling."""
        return _WatchedBatches(batches, self)

    def step(self) -> AbstractContextManager:
        """The context of one optimizer step: labelled while profiling; the
        schedule moves on at its end."""
        if not self.running:
            return contextlib.nullcontext()
        return self._profiled_step()

    @contextlib.contextmanager
    def _profiled_step(self) -> Iterator[None]:
        with record_function(STEP_LABEL):
            yield
        self._profiler.step()
        if self._reported:
            self.close()

    def close(self) -> None:
        """Stop profiling (idempotent)."""
        if self.running:
            self.running = False
            self._profiler.stop()
            if not self._reported:
                logger.warning("training stopped before a profiled step was recorded")

    def _report(self, profiler: torch.profiler.profile) -> None:
        """Write this rank's trace; log its data wait and top operators."""
        self._reported = True
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)
        # Host times: on CUDA a step's range ends when its work is queued.
        events = profiler.key_averages()
        steps = [e for e in events if e.key == STEP_LABEL]
        count = sum(e.count for e in steps)
        step_us = sum(e.cpu_time_total for e in steps)
        wait_us = sum(e.cpu_time_total for e in events if e.key == DATA_LABEL)
        logger.info(
            "profiled %d step(s): trace %s; waiting for data %.1f%% of the step time "
            "(%.2f of %.2f ms per step)",
            count,
            self.path,
            100 * wait_us / max(step_us, 1e-9),
            wait_us / 1e3 / max(count, 1),
            step_us / 1e3 / max(count, 1),
        )
        sorts = [("CPU", "self_cpu_time_total")]
        if self.cuda:
            sorts.append(("CUDA", "self_device_time_total"))
        for name, key in sorts:
            table = events.table(sort_by=key, row_limit=TOP_OPERATORS)
            logger.info(
                "top %d operators by self %s time:\n%s", TOP_OPERATORS, name, table
            )


class _WatchedBatches:
    """An iterator of batches whose waits a profiler labels while it runs."""

    def __init__(self, batches: Iterator, profiler: StepProfiler):
        self._batches, self._profiler = batches, profiler

    def __iter__(self) -> _WatchedBatches:
        return self

    def __next__(self):
        if not self._profiler.running:
            return next(self._batches)
        with record_function(DATA_LABEL):
            return next(self._batches)
