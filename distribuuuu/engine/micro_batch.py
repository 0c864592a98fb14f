"""``TRAIN.MICRO_BATCH auto``: the micro-batch that fits, found before a new
run trains and kept when a later step runs out of memory.

Before a new run (:meth:`MicroBatchFit.plan`), every rank tries the step at
the planned micro-batch on its plain model, outside any collective (no
gradient sync), on random images; one all-reduce on the control group tells
every rank which ranks ran out of memory.  While any did, all take the next
smaller split (:func:`smaller_split`), which keeps the process's samples per
step and so the global batch, and try again.  Then the model's parameters and
buffers, the optimizer's state, the modules' training flags and every RNG are
put back as they were: the run goes on as one started with that split.

A rank whose training step runs out of memory later stops at once with
:func:`step_out_of_memory`'s error, before any other collective (its peers,
waiting in one it will never join, lose it and stop too).  Under auto it
first leaves the next smaller split in ``OUT_DIR/micro_batch.json``, which
the rerun, resumed from the last checkpoint, adopts (:func:`adopt_record`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from distribuuuu.checkpoint.format import capture_rng_state, restore_rng_state
from distribuuuu.checkpoint.writer import host_copy
from distribuuuu.dist import group as du
from distribuuuu.engine.state import BatchPlan, plan_batches
from distribuuuu.errors import NoMicroBatchFitsError, StepOutOfMemoryError
from distribuuuu.fileio import atomic_write, read_small_file
from distribuuuu.strategies import Strategy
from distribuuuu.strategies.chain import runs_channels_last
from distribuuuu.strategies.precision import autocast

logger = logging.getLogger(__name__)

RECORD = "micro_batch.json"
MAX_RECORD_BYTES = 4096
# Steps each try runs: the second meets the optimizer's state and the first
# step's gradients, as every later step of the run does.
TRIED_STEPS = 2


@dataclass(frozen=True)
class MicroBatchSpec:
    """What TRAIN.MICRO_BATCH auto reads: the images' size, the classes, and
    OUT_DIR, where a step out of memory leaves the next split."""

    image_size: int
    num_classes: int
    out_dir: str


def smaller_split(per_rank: int, accum: int) -> tuple[int, int] | None:
    """The split after ``per_rank`` x ``accum``: half the micro-batch, rounded
    up, where that divides the process's samples per step, else the largest
    micro-batch below it that does (the accumulation steps take the rest, so
    the global batch stays); None from a micro-batch of 1."""
    if per_rank <= 1:
        return None
    samples, micro = per_rank * accum, (per_rank + 1) // 2
    while samples % micro:
        micro -= 1
    return micro, samples // micro


def split_keys(plan: BatchPlan) -> dict[str, int]:
    """The config keys that give ``plan``'s split (for config.yaml)."""
    return {"TRAIN.BATCH_SIZE": plan.per_rank, "TRAIN.ACCUM_STEPS": plan.accum}


def _record_path(out_dir: str) -> str:
    return os.path.join(out_dir, RECORD)


def read_record(out_dir: str) -> tuple[int, int] | None:
    """The split ``OUT_DIR/micro_batch.json`` holds; None when there is none.
    Read as untrusted: ValueError (or OSError) for anything but a small
    regular file of two positive integers."""
    try:
        data = read_small_file(_record_path(out_dir), MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    record = json.loads(data)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    per_rank, accum = record.get("batch_per_rank"), record.get("accum")
    if not (type(per_rank) is int and type(accum) is int and min(per_rank, accum) >= 1):
        raise ValueError("batch_per_rank and accum must be integers >= 1")
    return per_rank, accum


def write_record(out_dir: str, per_rank: int, accum: int) -> str:
    """Leave the split ``per_rank`` x ``accum`` for the rerun; its path."""
    path = _record_path(out_dir)
    text = json.dumps({"batch_per_rank": per_rank, "accum": accum}).encode()
    atomic_write(path, lambda f: f.write(text + b"\n"))
    return path


def adopt_record(plan: BatchPlan, out_dir: str) -> BatchPlan:
    """``plan`` with the smaller split a step out of memory left in
    ``out_dir``, where it keeps the process's samples per step; a record
    that is unusable or does not fit is logged and ignored."""
    path = _record_path(out_dir)
    try:
        split = read_record(out_dir)
    except (OSError, ValueError, RecursionError) as error:
        logger.warning("TRAIN.MICRO_BATCH auto: ignored %s: %s", path, error)
        return plan
    if split is None or split[0] >= plan.per_rank:
        return plan
    per_rank, accum = split
    if per_rank * accum != plan.per_rank * plan.accum:
        logger.warning(
            "TRAIN.MICRO_BATCH auto: ignored %s: its %d x %d is not the %d samples "
            "per step of each process",
            path,
            per_rank,
            accum,
            plan.per_rank * plan.accum,
        )
        return plan
    logger.info(
        "TRAIN.MICRO_BATCH auto: a micro-batch of %d x %d accumulation steps, "
        "as %s records (a step ran out of memory at %d)",
        per_rank,
        accum,
        path,
        plan.per_rank,
    )
    return BatchPlan(per_rank, accum, plan.world_size, plan.lr_scale)


def step_out_of_memory(plan: BatchPlan, out_dir: str) -> StepOutOfMemoryError:
    """The error of a rank whose training step at ``plan`` ran out of memory;
    under TRAIN.MICRO_BATCH auto (``out_dir`` given) the next smaller split
    is written first, for the rerun.  Nothing here is a collective."""
    where = (
        f"rank {du.get_rank()} ran out of device memory in a training step at a "
        f"micro-batch of {plan.per_rank} x {plan.accum} accumulation steps"
    )
    kept = "the last checkpoint is kept as it was"
    if not out_dir:
        return StepOutOfMemoryError(
            f"{where}; {kept}: lower TRAIN.BATCH_SIZE and raise TRAIN.ACCUM_STEPS, "
            "or set TRAIN.MICRO_BATCH auto, and run again"
        )
    smaller = smaller_split(plan.per_rank, plan.accum)
    if smaller is None:
        return StepOutOfMemoryError(
            f"{where}; a micro-batch of 1 is the smallest: the model does not fit "
            f"this device ({kept})"
        )
    path = write_record(out_dir, *smaller)
    return StepOutOfMemoryError(
        f"{where}; {path} records {smaller[0]} x {smaller[1]}, which the same "
        f"command adopts when it resumes ({kept})"
    )


class Snapshot:
    """What a tried step changes, copied to the host: ``model``'s parameters
    and buffers (BatchNorm's statistics and counts among them), the
    optimizer's state, the modules' training flags, and every RNG of this
    process (Python, NumPy, torch's CPU and ``devices``' generators)."""

    def __init__(self, model: nn.Module, optimizer, devices: list[torch.device]):
        self.model, self.optimizer, self.devices = model, optimizer, devices
        tensors = chain(model.parameters(), model.buffers())
        self.tensors = [(live, host_copy(live)) for live in tensors]
        self.optimizer_state = host_copy(optimizer.state_dict())
        self.training = [(module, module.training) for module in model.modules()]
        self.rng = capture_rng_state(devices)

    def restore(self) -> None:
        """Put everything back as it was copied; no gradients left."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, copied in self.tensors:
                live.copy_(copied)
        self.optimizer.load_state_dict(self.optimizer_state)
        for module, training in self.training:
            module.training = training
        restore_rng_state(self.rng, self.devices)


class MicroBatchFit:
    """TRAIN.MICRO_BATCH auto on the run's ``strategy``, prepared ``model``
    and ``optimizer``: :meth:`plan` is the split the run trains with."""

    def __init__(self, spec: MicroBatchSpec, strategy: Strategy, model, optimizer):
        self.spec, self.strategy = spec, strategy
        self.model, self.optimizer = model, optimizer

    def plan(
        self, asked: BatchPlan, saved: BatchPlan | None, resume_batch: str
    ) -> BatchPlan:
        """The plan of :func:`~distribuuuu.engine.state.plan_batches`, but
        resuming with ``saved``'s split rather than TRAIN.ACCUM_STEPS; then
        with the split a step out of memory recorded, if smaller; then, for a
        new run, the first that fits on every rank.  Every rank calls it."""
        if saved is not None:
            asked = dataclasses.replace(asked, accum=saved.accum)
        plan = plan_batches(asked, saved, resume_batch=resume_batch)
        plan = adopt_record(plan, self.spec.out_dir)
        if saved is not None:
            return plan
        plain = self.strategy.plain_model(self.model)
        snapshot = Snapshot(plain, self.optimizer, self.strategy.devices(self.model))
        try:
            return self._agree(plan, plain)
        finally:
            snapshot.restore()

    def _agree(self, plan: BatchPlan, plain: nn.Module) -> BatchPlan:
        """Try ``plan``'s micro-batch, then smaller ones, until no rank runs
        out of memory: one all-reduce per try."""
        asked, failed_at = plan.per_rank, []
        while True:
            fits = self._try(plain, plan.per_rank)
            failed, rows = du.all_reduce_max_int_with_rows(int(not fits), [not fits])
            if not failed:
                break
            ranks = ", ".join(str(rank) for rank, row in enumerate(rows) if row[0])
            failed_at.append(f"{plan.per_rank} on rank {ranks}")
            smaller = smaller_split(plan.per_rank, plan.accum)
            if smaller is None:
                raise NoMicroBatchFitsError(
                    "TRAIN.MICRO_BATCH auto: every micro-batch ran out of memory "
                    f"({'; '.join(failed_at)}): the model does not fit the device"
                )
            plan = BatchPlan(*smaller, plan.world_size, plan.lr_scale)
        if failed_at:
            logger.info(
                "TRAIN.MICRO_BATCH auto: out of memory at a micro-batch of %s; "
                "%d x %d accumulation steps fit (TRAIN.BATCH_SIZE %d asked, global "
                "batch %d kept)",
                "; ".join(failed_at),
                plan.per_rank,
                plan.accum,
                asked,
                plan.global_batch,
            )
        else:
            logger.info("TRAIN.MICRO_BATCH auto: a micro-batch of %d fits", asked)
        return plan

    def _try(self, plain: nn.Module, batch: int) -> bool:
        """Whether :data:`TRIED_STEPS` steps of ``batch`` random images ran on
        this rank without running out of device memory."""
        device, spec = self.strategy.device, self.spec
        generator = torch.Generator().manual_seed(batch)  # not the run's RNG
        size = (batch, 3, spec.image_size, spec.image_size)
        layout = torch.channels_last if runs_channels_last(self.strategy) else None
        images = torch.randn(size, generator=generator).to(
            device, memory_format=layout or torch.contiguous_format
        )
        labels = torch.randint(spec.num_classes, (batch,), generator=generator)
        plain.train()
        fits, loss = True, None
        try:
            for _ in range(TRIED_STEPS):
                with autocast(device, self.strategy.amp_dtype):
                    loss = F.cross_entropy(plain(images), labels.to(device))
                self.optimizer.zero_grad(set_to_none=True)  # where the loop does
                loss.backward()
                self.optimizer.step()
        except torch.OutOfMemoryError:
            fits = False
        del loss  # and the graph it holds, once the error's frames are gone
        self.optimizer.zero_grad(set_to_none=True)
        if not fits:
            logger.warning(
                "TRAIN.MICRO_BATCH auto: a micro-batch of %d ran out of memory on "
                "this rank",
                batch,
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return fits
