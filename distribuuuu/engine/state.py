"""The state of a training run: ``Progress`` (where the run stands),
``BatchPlan`` (its batch geometry), ``RunClock`` (for the ETA) and
``TrainState`` (everything a run works on). The checkpoint format
(:mod:`distribuuuu.checkpoint.format`) saves and reads them as plain values.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from distribuuuu.checkpoint import format as ckpt_format
from distribuuuu.reporting.meters import DataBoundWatch, GradSpikeWatch
from distribuuuu.reporting.stragglers import SlowRankWatch

if TYPE_CHECKING:  # imported for the annotations only
    from distribuuuu.models.ema import ModelEma
    from distribuuuu.plan.flops import FlopMeter
    from distribuuuu.reporting.writer import MetricsWriter
    from distribuuuu.strategies import Strategy

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run stands; what a checkpoint must carry to continue exactly."""

    epoch: int = 0  # whole epochs done
    consumed: int = 0  # positions of this epoch's global sample order trained on
    best_top1: float = -1.0
    seed: int = 0
    best_ema_top1: float = -1.0  # of the weights' moving average (MODEL.EMA)

    def values(self) -> dict:
        """The progress as plain values, for the checkpoint."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchPlan:
    """Batch geometry of this run (it may differ from the config after a resume)."""

    per_rank: int  # micro-batch per process
    accum: int  # micro-batches per optimizer step
    world_size: int
    lr_scale: float = 1.0  # multiplies the scheduled learning rate

    @property
    def global_batch(self) -> int:
        return self.per_rank * self.accum * self.world_size

    def values(self) -> dict:
        """The plan as plain values, for the checkpoint."""
        return {
            "batch_per_rank": self.per_rank,
            "accum": self.accum,
            "world_size": self.world_size,
            "lr_scale": self.lr_scale,
        }

    def check_fits(self, loader_batches: int, images: int) -> None:
        """Refuse a step larger than the ``loader_batches`` micro-batches (of
        the ``images`` training images) each process gets."""
        if loader_batches < self.accum:
            raise ValueError(
                f"a batch of {self.per_rank} x {self.accum} accumulation steps is "
                f"larger than the {images} training images each of the "
                f"{self.world_size} processes gets; lower TRAIN.BATCH_SIZE"
            )

    @classmethod
    def of(cls, saved: dict) -> BatchPlan:
        """The plan of a checkpoint (:attr:`SavedRun.plan`)."""
        return cls(
            saved["batch_per_rank"],
            saved["accum"],
            saved["world_size"],
            saved["lr_scale"],
        )


def plan_batches(
    asked: BatchPlan, saved: BatchPlan | None, resume_batch: str = "global"
) -> BatchPlan:
    """The batch plan, continuing a checkpoint's (``saved``) when resuming.

    ``asked``: the plan of a fresh run (TRAIN.BATCH_SIZE, TRAIN.ACCUM_STEPS,
    the data-parallel world size, the linear scaling rule's LR scale).  When
    resuming, its accumulation steps and world size count; on another world
    size the global batch is kept (per-process batch recomputed) unless
    ``resume_batch`` is ``per_rank`` (TRAIN.RESUME_BATCH), which keeps the
    per-process batch and scales the learning rate with the global batch.
    """
    if saved is None:
        return asked
    accum, world_size = asked.accum, asked.world_size
    old_global, lr_scale = saved.global_batch, saved.lr_scale
    per_rank = saved.per_rank * saved.accum // accum
    if saved.world_size == world_size:
        return BatchPlan(per_rank, accum, world_size, lr_scale)
    if resume_batch == "per_rank":
        new_global = per_rank * accum * world_size
        plan = BatchPlan(
            per_rank, accum, world_size, lr_scale * new_global / old_global
        )
    else:
        per_rank, rest = divmod(old_global, world_size * accum)
        if rest or per_rank < 1:
            raise ValueError(
                f"cannot keep the global batch {old_global} of the checkpoint on "
                f"{world_size} processes x TRAIN.ACCUM_STEPS {accum}: it does not "
                "divide; change the number of processes or set "
                "TRAIN.RESUME_BATCH per_rank"
            )
        plan = BatchPlan(per_rank, accum, world_size, lr_scale)
    logger.info(
        "resuming on %d processes instead of %d: batch %d per process, global "
        "batch %d, LR x %.4g",
        world_size,
        saved.world_size,
        plan.per_rank,
        plan.global_batch,
        plan.lr_scale,
    )
    return plan


class RunClock:
    """Iterations done and time spent since (re)start, for the whole-run ETA."""

    def __init__(self, total_iters: int, done_iters: int):
        self.total_iters, self.done_iters = total_iters, done_iters
        self.start_iters, self.start = done_iters, time.perf_counter()

    @classmethod
    def at(
        cls, progress: Progress, plan: BatchPlan, loader_batches: int, max_epoch: int
    ) -> RunClock:
        """The clock of a run that stands at ``progress``: optimizer steps over
        ``max_epoch`` epochs of ``loader_batches`` micro-batches each."""
        steps_per_epoch = loader_batches // plan.accum
        done = progress.epoch * steps_per_epoch + progress.consumed // plan.global_batch
        return cls(max_epoch * steps_per_epoch, done)

    def step(self) -> None:
        self.done_iters += 1

    def eta(self) -> float:
        done_now = self.done_iters - self.start_iters
        per_iter = (time.perf_counter() - self.start) / max(done_now, 1)
        return per_iter * (self.total_iters - self.done_iters)


@dataclass
class TrainState:
    """What a training run works on, built once by ``trainer.build_train_state``."""

    strategy: Strategy  # how the model is spread; owns the step and its state
    model: nn.Module  # prepared by ``strategy`` (wrapped or sharded, on device)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None  # autocast dtype; None = full precision
    device: torch.device
    normalize: nn.Module  # uint8 batches -> the model's input on ``device``
    plan: BatchPlan
    progress: Progress
    clock: RunClock
    writer: MetricsWriter
    classes: list[str]  # class names in label order, saved with the weights
    ema: ModelEma | None = None  # moving average of the weights (MODEL.EMA)
    teacher: nn.Module | None = None  # TRAIN.DISTILL's, in eval mode; never saved
    data_watch: DataBoundWatch = field(default_factory=DataBoundWatch)
    spike_watch: GradSpikeWatch = field(default_factory=GradSpikeWatch)
    # This rank's timings of the last print window, to the next stop check.
    slow_ranks: SlowRankWatch = field(default_factory=SlowRankWatch)
    flops: FlopMeter | None = None  # the TFLOP/s and MFU of its windows; None: off
    # Set by the loop for a step that prints: the strategy then measures the
    # gradients' global norm before clipping into grad_norm (None elsewhere;
    # a tensor on the device, or DeepSpeed's number).
    norm_wanted: bool = False
    grad_norm: torch.Tensor | float | None = None

    def state_dict(
        self, weights: dict, rng: list, *, arch: str, config_dump: str
    ) -> dict:
        """The training checkpoint: ``weights`` (the strategy's model,
        optimizer and EMA entries), every rank's ``rng`` state, the model's
        ``arch``, the run's config as yaml text, and the rest of the run's
        state."""
        run = {
            "arch": arch,
            "classes": self.classes,
            "cfg": config_dump,
            "tracker_runs": self.writer.run_ids(),
            "ema_counters": None if self.ema is None else self.ema.counters(),
        }
        return ckpt_format.training_checkpoint(
            weights,
            progress=self.progress.values(),
            plan=self.plan.values(),
            rng=rng,
            scaler=self.scaler.state_dict(),
            run=run,
        )
