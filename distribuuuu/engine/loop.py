"""The training loop: :func:`train_epoch`, its steps, and stop requests.

One optimizer step takes ``plan.accum`` micro-batches from the loader, puts
them on the device (normalised, mixed under Mixup/CutMix), and hands them to
the strategy, which runs forward, backward and the optimizer step.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from distribuuuu.data.labels import is_stand_in
from distribuuuu.data.spec import Loader
from distribuuuu.dist import group as du
from distribuuuu.dist.slurm import requeue_slurm_job
from distribuuuu.engine.losses import (
    Distilled,
    LossSpec,
    TrainLoss,
    build_train_loss,
    mix_seed,
)
from distribuuuu.engine.micro_batch import step_out_of_memory
from distribuuuu.engine.profiling import ProfileSpec, StepProfiler
from distribuuuu.engine.run_log import (
    LogSpec,
    TrainStatus,
    log_crop_size,
    log_train_window,
)
from distribuuuu.engine.state import TrainState
from distribuuuu.logger import end_status, live_console
from distribuuuu.optim import build as optim
from distribuuuu.optim.spec import ScheduleSpec
from distribuuuu.reporting.meters import MetricSums
from distribuuuu.reporting.stragglers import ComputeClock, SlowRankWatch
from distribuuuu.strategies.base import MicroBatch
from distribuuuu.strategies.precision import autocast

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSpec:
    """What the training loop reads of the run's settings."""

    schedule: ScheduleSpec  # the learning rate, before the batch plan's scale
    loss: LossSpec
    log: LogSpec
    print_freq: int = 10  # TRAIN.PRINT_FREQ: log every this many steps
    profile: ProfileSpec | None = None  # TRAIN.PROFILE_STEPS; None: off
    # TRAIN.MICRO_BATCH auto: OUT_DIR, where a step out of memory leaves the
    # next smaller split for the rerun; "": off
    micro_batch_dir: str = ""


def train_epoch(
    state: TrainState,
    loader: Loader,
    spec: LoopSpec,
    after_step: Callable[[], bool] = lambda: False,
) -> bool:
    """Train the rest of epoch ``progress.epoch``; True if ``after_step`` stopped it.

    The learning rate is set before every step.  Micro-batches that cannot
    fill a whole step at the end of the epoch are skipped.
    ``progress.consumed`` advances with every step, so a checkpoint taken in
    ``after_step`` resumes at the next unseen batch.  A step that runs out of
    device memory stops this rank with StepOutOfMemoryError, at once.
    """
    progress, plan = state.progress, state.plan
    state.model.train()
    loader.sampler.set_epoch(progress.epoch, progress.consumed)
    log_crop_size(spec.log, progress.epoch)
    first = progress.consumed // plan.global_batch
    total = first + len(loader) // plan.accum
    meter = MetricSums(state.device, spec.log.topk)
    loss_fn = build_train_loss(spec.loss)
    status = TrainStatus(spec.log, state, first, total) if live_console() else None
    batches: Iterator = iter(loader)
    profiler = StepProfiler.for_epoch(spec.profile, state, total - first)  # or None
    if profiler:
        batches = profiler.watch(batches)
    window = TrainWindow(state.device)
    try:
        for step in range(first, total):
            lr = set_step_lr(spec.schedule, state, step / total)
            # A step that prints: the strategy measures the gradients' norm.
            state.norm_wanted = (step + 1) % spec.print_freq == 0 or step + 1 == total
            try:
                with profiler.step() if profiler else nullcontext():
                    seconds = train_step(state, batches, meter, loss_fn, window.compute)
            except torch.OutOfMemoryError as error:  # no collective from here on
                raise step_out_of_memory(plan, spec.micro_batch_dir) from error
            window.took(seconds)
            progress.consumed += plan.global_batch
            state.clock.step()
            if state.norm_wanted:
                stats = end_window(
                    spec, state, meter, window, step=step, steps=total, lr=lr
                )
                if status:
                    status.window = stats
            if status:
                status.show(step, lr)
            if after_step():
                return True
        return False
    finally:
        if profiler:
            profiler.close()
        end_status(keep=True)


class TrainWindow:
    """This rank's print window: its optimizer steps, and its seconds since it
    began, waiting for the loader, and computing."""

    def __init__(self, device: torch.device):
        self.compute = ComputeClock(device)
        self.start, self.data, self.steps = time.perf_counter(), 0.0, 0

    def took(self, data_seconds: float) -> None:
        """One more step, which waited ``data_seconds`` for the loader."""
        self.steps, self.data = self.steps + 1, self.data + data_seconds

    def restart(self) -> None:
        """Begin the next window (the compute clock was read)."""
        self.start, self.data, self.steps = time.perf_counter(), 0.0, 0


def end_window(
    spec: LoopSpec,
    state: TrainState,
    meter: MetricSums,
    window: TrainWindow,
    *,
    step: int,
    steps: int,
    lr: float,
) -> dict:
    """Log the print window that ends after optimizer step ``step`` (0-based)
    of ``steps`` and return its metrics; hold this rank's data and compute
    seconds per step for the next stop check (:class:`StopRequest`) to carry
    to rank 0."""
    stats = log_train_window(
        spec.log,
        state,
        meter,
        step=step,
        steps=steps,
        lr=lr,
        elapsed=time.perf_counter() - window.start,
        data_time=window.data,
        window_steps=window.steps,
    )
    # Read after the window's metrics were: on CUDA their read waited already.
    compute = window.compute.read()
    state.slow_ranks.hold(window.data / window.steps, compute / window.steps)
    meter.reset()
    window.restart()
    return stats


def set_step_lr(schedule: ScheduleSpec, state: TrainState, fraction: float) -> float:
    """Set (and return) the learning rate of the step ``fraction`` into the
    epoch."""
    at = optim.lr_epoch(schedule, state.progress.epoch, fraction)
    lr = optim.lr_at(schedule, at) * state.plan.lr_scale
    optim.set_lr(state.optimizer, lr)
    return lr


class DataClock:
    """Seconds spent waiting for the loader; the step's compute clock starts
    once its first micro-batch is in, and the later waits are not compute."""

    def __init__(self, compute: ComputeClock | None = None):
        self.seconds = self.later = 0.0  # all waits; those after the first
        self.compute = compute

    def waited(self, seconds: float, first: bool) -> None:
        """The loader took ``seconds`` for a micro-batch (the step's ``first``)."""
        self.seconds += seconds
        if not first:
            self.later += seconds
        elif self.compute:
            self.compute.start()


def micro_batches(
    state: TrainState, batches: Iterator, loss_fn: TrainLoss, clock: DataClock
) -> Iterator[MicroBatch]:
    """The ``plan.accum`` micro-batches of one step, fetched as they are needed.

    Each is normalised and put on the device (where the process reads the
    images; its labels in any case), then mixed by ``loss_fn``
    (seeded by the micro-batch's place in the epoch's global order).
    """
    progress, plan, device = state.progress, state.plan, state.device
    loss_targets: torch.Tensor | Distilled
    # A process that gets activations instead (a pipeline's later stage)
    # leaves the images as loaded; mixing draws from the batch's shape only,
    # which the stand-ins of a labels-only loader have (data/labels.py).
    reads = state.strategy.reads_images(state.model)
    mixes = loss_fn.mixer is not None
    # Micro-batch m of this replica starts at global position first + m * stride.
    replica = state.strategy.data_parallel()[0]
    first, stride = progress.consumed + replica, plan.per_rank * plan.world_size
    for micro in range(plan.accum):
        tic = time.perf_counter()
        images, targets = next(batches)
        clock.waited(time.perf_counter() - tic, first=micro == 0)
        if reads or (mixes and not is_stand_in(images)):
            images = state.normalize(images)
        elif mixes:  # beside the labels, for the order mixing draws
            images = images.to(device)
        targets = targets.to(device, non_blocking=True)
        seed = mix_seed(progress.seed, progress.epoch, first + micro * stride)
        images, targets, loss_targets = loss_fn.mix(images, targets, seed)
        if state.teacher is not None:  # it sees the very images the student does
            with torch.no_grad(), autocast(device, state.amp_dtype):
                taught = state.teacher(images)
            loss_targets = Distilled(loss_targets, taught)
        yield images, targets, loss_targets


# Host synchronizations of a CUDA training step (each stalls the GPU queue);
# keep this list true when the step changes.
# Every step:
# - fp16 only (GradScaler enabled): GradScaler.step reads its found-inf flag
#   with .item() (GradScaler._maybe_opt_step, torch/amp/grad_scaler.py), once
#   per device holding gradients. The EMA learns of a skipped step from that
#   same read (strategies.base.step_optimizer); bf16 and full precision have no
#   scaler.
# - MODEL.SYNCBN: torch's SyncBatchNorm forward drops the statistics of empty
#   ranks with a boolean mask (count_all[mask] in torch/nn/modules/_functions.py,
#   pytorch issue 78549): one sync per SyncBN layer and micro-batch.
# - stop.agreed() in after_step every DIST.STOP_CHECK_STEPS steps, with more
#   than one process: all_reduce_max_int through a CPU gloo group (.item() of a
#   CPU tensor). No GPU sync, but a host collective: that step waits for the
#   slowest rank's host. The first check after a print step reduces every
#   rank's data and compute seconds with the signal instead, in that one
#   collective (all_reduce_max_int_with_rows, 8 + 16 x ranks bytes).
# - DATA.DECODER gpu, per micro-batch (per run of DECODE_PIXELS): the input
#   step waits for the current stream before nvJPEG writes (data/gpu_decode.py
#   decode_jpegs, pytorch/vision#9606), and torchvision's decode waits for its
#   own stream before it returns.
# Not syncs: waiting for the data loader (host); the .to(device,
# non_blocking=True) of images (in the normalizer) and targets, from the
# loader's pinned batches (TRAIN.PIN_MEMORY; from pageable memory CUDA may copy
# synchronously); the mixing order (pinned, losses.host_to_device) and
# torchvision's Mixup/CutMix draws (on the CPU generator); scaler.scale,
# unscale_ and update (device-side kernels); clip_grad_norm_ (it reads back only
# with error_if_nonfinite, off); SGD and AdamW steps (AdamW's step counts live
# on the CPU unless capturable or fused); ZeRO-1's broadcasts (NCCL waits order
# streams); the EMA's lerp (a host float weight); MetricSums.update.
# At print steps: the gradient norm (the strategy's; a collective where the
# gradients are sharded or staged), read with the window's metrics;
# MetricSums.reduce (all_reduce + .tolist(), one sync); when the
# window's loss is not finite, all_finite (one sync per device + a CPU collective).
# The compute clock's CUDA events (two recorded per step, not syncs) are read
# after that sync, when the last step's end event has passed already.
# At checkpoint steps: all_finite and the state dicts copied to the CPU.
def train_step(
    state: TrainState,
    batches: Iterator,
    meter: MetricSums,
    loss_fn: TrainLoss,
    compute: ComputeClock | None = None,
) -> float:
    """One optimizer step of ``plan.accum`` micro-batches; seconds spent on data.

    The strategy runs the step (gradients synchronized on the last
    micro-batch only); the EMA follows every step the optimizer took.
    ``compute`` measures the step from its first micro-batch on, the waits
    for the later ones aside.
    """
    clock = DataClock(compute)
    micro = micro_batches(state, batches, loss_fn, clock)
    stepped = state.strategy.train_step(state, micro, meter, loss_fn)
    if stepped and state.ema is not None:
        state.ema.step()
    if compute:
        compute.stop(waited=clock.later)
    return clock.seconds


class StopRequest:
    """Turns SIGTERM / SIGUSR1 (Slurm's warning before preemption or the time
    limit) into a request that every rank agrees on at the next check.

    With more than one process the ranks check together every ``every``
    optimizer steps (DIST.STOP_CHECK_STEPS) and whenever :meth:`agreed` is
    called without a step (an epoch's end); one process checks every call.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, every: int = 1):
        self.every = every
        self.signum = 0
        self.noted = False  # this rank's signal logged
        self.stopping = False  # agreed: the run stops
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        # A stop that start-up's handler received but whose StartupStop was
        # swallowed (cli._StopRaiser) is this run's stop request.
        received = [getattr(h, "received", 0) for h in self._previous.values()]
        self.signum = max(self.signum, *received)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(
        self, step: int | None = None, times: SlowRankWatch | None = None
    ) -> int:
        """The signal any rank received (0 if none), after optimizer step
        ``step`` (1-based; None: the end of an epoch).  A collective call at
        the steps that check, with more than one process; a check that finds
        this rank's timings held in ``times`` carries every rank's in the same
        collective (into ``times.rows``)."""
        if self.signum and not self.noted:
            self.noted = True
            when = "an epoch's end" if step is None else f"step {step}"
            logger.info(
                "%s received by this rank before %s; the ranks stop at their "
                "next check (every %d steps with DIST.STOP_CHECK_STEPS)",
                signal.Signals(self.signum).name,
                when,
                self.every,
            )
        if step is not None and step % self.every and du.is_distributed():
            return 0
        held = times.take() if times else None
        if times and held and du.is_distributed():
            # Held after the same print steps on every rank: all carry here.
            agreed, times.rows = du.all_reduce_max_int_with_rows(self.signum, held)
        else:
            agreed = du.all_reduce_max_int(self.signum)
        self.stopping = self.stopping or bool(agreed)
        return agreed

    def restore(self, failed: bool = False) -> None:
        """Put the previous signal handlers back, unless the run stops: then
        more of these signals (srun sends SIGTERM to every task once the first
        one exits) are only recorded until the process exits 128+N.  A run
        that ``failed`` gets their default action instead: the launcher's
        SIGTERM, once another rank failed, ends this one without a word (the
        failed rank said why; this one may still wait on it)."""
        if self.stopping:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if failed else handler)


def end_stopped_run(signum: int, requeue: bool) -> dict:
    """End a run that a signal stopped after saving (requeue the Slurm job
    with ``requeue``, DIST.REQUEUE)."""
    name = signal.Signals(signum).name
    logger.info("stopped by %s after saving a checkpoint", name)
    if requeue and du.is_main_process() and requeue_slurm_job():
        logger.info("requeued the Slurm job: it resumes from the checkpoint")
    # The first rank to exit (128+N) ends a --kill-on-bad-exit step: not
    # before rank 0 has requeued.
    du.barrier()
    return {"stopped_by": signum}
