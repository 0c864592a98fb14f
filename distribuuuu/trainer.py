"""The training loop: ``train_model``, ``test_model``, ``train_epoch``, ``evaluate``."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu import distributed as du
from distribuuuu import optim, reports
from distribuuuu.config import dump_cfg, flat_cfg
from distribuuuu.data import (
    build_dataset,
    build_normalizer,
    build_test_loader,
    build_train_loader,
)
from distribuuuu.ema import ModelEma
from distribuuuu.logger import (
    STATUS_LINE,
    MetricsWriter,
    end_status,
    live_console,
    set_status,
    setup_logging,
)
from distribuuuu.losses import TrainLoss, build_train_loss, mix_seed
from distribuuuu.meters import (
    ConfusionMatrix,
    DataBoundWatch,
    MetricSums,
    PeakMemory,
    format_eta,
    per_class_top1,
    progress_bar,
)
from distribuuuu.models import build_model
from distribuuuu.parallel import (
    broadcast_buffers,
    enable_activation_checkpointing,
    gradient_sync,
    is_sharded,
    load_model_state,
    load_optimizer_state,
    load_sharded_state,
    model_devices,
    model_state_dict,
    optimizer_state_dict,
    shard_optimizer,
    sharded_state,
    unwrap_model,
    wrap_model,
)
from distribuuuu.syncbn import recompute_bn_statistics

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) in this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_seed(seed: int | None) -> int:
    """``RNG_SEED``, or a random seed chosen by rank 0 and shared by all ranks."""
    if seed is None:
        seed = du.broadcast_object(random.SystemRandom().randrange(2**31))
    return seed


@contextlib.contextmanager
def run_context(
    cfg: CfgNode, log_files: bool = True
) -> Iterator[tuple[du.LaunchInfo, torch.device]]:
    """Join the process group, set up logging and cuDNN; leave the group at exit.

    Without ``log_files`` nothing is written to OUT_DIR (console only).
    """
    if cfg.CUDNN.DETERMINISTIC:
        # cuBLAS needs this before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # FSDP's CPU offload clips gradients that live in host memory.
    offload = cfg.DIST.STRATEGY == "fsdp" and cfg.DIST.FSDP_CPU_OFFLOAD
    info, device = du.setup_distributed(
        cfg.DIST.BACKEND, cfg.DEVICE, cfg.DIST.INIT_TIMEOUT, cpu_collectives=offload
    )
    try:
        setup_logging(cfg.OUT_DIR if log_files else None, info.rank)
        if device.type == "cuda":
            set_cudnn_flags(cfg.CUDNN.BENCHMARK, cfg.CUDNN.DETERMINISTIC)
        logger.info(
            "launch: %s, rank %d of %d, local rank %d, device %s%s",
            info.launcher,
            info.rank,
            info.world_size,
            info.local_rank,
            device,
            f", backend {torch.distributed.get_backend()}"
            if du.is_distributed()
            else "",
        )
        yield info, device
    finally:
        du.cleanup_distributed()


def set_cudnn_flags(benchmark: bool, deterministic: bool) -> None:
    """Set cuDNN's ``benchmark`` and ``deterministic`` flags for the run.

    Benchmark mode times the candidate algorithms of each new input shape
    and keeps the fastest, which may differ from run to run: PyTorch's notes
    on reproducibility ask for it off when results must repeat, so
    ``deterministic`` turns it off (and says so).
    """
    if deterministic and benchmark:
        logger.info(
            "CUDNN.DETERMINISTIC True: CUDNN.BENCHMARK turned off (its timing-based "
            "choice of algorithms varies from run to run)"
        )
        benchmark = False
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.deterministic = deterministic


class RunClock:
    """Iterations done and time spent since (re)start, for the whole-run ETA."""

    def __init__(self, total_iters: int, done_iters: int):
        self.total_iters, self.done_iters = total_iters, done_iters
        self.start_iters, self.start = done_iters, time.perf_counter()

    def step(self) -> None:
        self.done_iters += 1

    def eta(self) -> float:
        done_now = self.done_iters - self.start_iters
        per_iter = (time.perf_counter() - self.start) / max(done_now, 1)
        return per_iter * (self.total_iters - self.done_iters)


def resolve_precision(
    name: str, device: torch.device
) -> tuple[torch.dtype | None, bool]:
    """Autocast dtype (None = full precision) and whether to scale the loss.

    fp16 uses a GradScaler on CUDA; on other devices it falls back to bf16,
    whose range needs no loss scaling.
    """
    if name == "none":
        return None, False
    if name == "fp16" and device.type != "cuda":
        logger.info("TRAIN.MIXED_PRECISION fp16 on %s: using bf16 instead", device.type)
        name = "bf16"
    return (torch.float16, True) if name == "fp16" else (torch.bfloat16, False)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _optimizer_step(
    model, optimizer, scaler, clip_grad_norm: float, check_skip: bool = False
) -> bool:
    """Step (with loss scaling and clipping); with ``check_skip``, False if the
    GradScaler skipped the step.

    The gradients stay until the next step's backward replaces them.
    """
    if clip_grad_norm > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    if not (check_skip and scaler.is_enabled()):
        scaler.step(optimizer)
        scaler.update()
        return True
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        # A fused optimizer (fused=True; we build none) always gets step() and
        # skips on the device. The scaler backs off (lowers its scale) exactly
        # when it skips: reading the scale before and after costs two syncs.
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() >= scale
    # GradScaler.step calls optimizer.step only if the gradients are finite, a
    # decision it reads on the host anyway (one .item() per step, in
    # GradScaler._maybe_opt_step of torch/amp/grad_scaler.py): a step post-hook
    # hears it without another synchronization.
    stepped = []
    hook = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    try:
        scaler.step(optimizer)
    finally:
        hook.remove()
    scaler.update()
    return bool(stepped)


@dataclass
class Progress:
    """Where the run stands; what a checkpoint must carry to continue exactly."""

    epoch: int = 0  # whole epochs done
    consumed: int = 0  # positions of this epoch's global sample order trained on
    best_top1: float = -1.0
    seed: int = 0
    best_ema_top1: float = -1.0  # of the weights' moving average (MODEL.EMA)


@dataclass(frozen=True)
class BatchPlan:
    """Batch geometry of this run (it may differ from cfg after a resume)."""

    per_rank: int  # micro-batch per process
    accum: int  # micro-batches per optimizer step
    world_size: int
    lr_scale: float = 1.0  # multiplies the scheduled learning rate

    @property
    def global_batch(self) -> int:
        return self.per_rank * self.accum * self.world_size


@dataclass
class TrainState:
    """What a training run works on, built once by :func:`train_model`."""

    model: nn.Module  # wrapped for the run (DDP, DP) and on ``device``
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
    data_watch: DataBoundWatch = field(default_factory=DataBoundWatch)


class NonFiniteError(RuntimeError):
    """The training loss or the weights became NaN or infinite; the run stops
    and nothing non-finite is saved."""


_NONFINITE_ADVICE = (
    "lower OPTIM.BASE_LR or set OPTIM.CLIP_GRAD_NORM, and check that "
    "MODEL.WEIGHTS (if set) holds finite values"
)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point value of ``tensors`` is finite on every rank.

    A collective: each rank checks what it stores (its shard of a DTensor)
    and the answer is agreed over all ranks.  One host synchronization, so
    call it at saves and print steps, not at every step.
    """
    flags = [
        torch.isfinite(tensor.to_local() if isinstance(tensor, DTensor) else tensor)
        .all()
        .detach()
        for tensor in tensors
        if tensor.is_floating_point()
    ]
    local = bool(torch.stack(flags).all()) if flags else True
    return du.all_reduce_max_int(int(not local)) == 0


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of a (wrapped) model, as this rank holds them."""
    module = unwrap_model(model)
    return [*module.parameters(), *module.buffers()]


def _check_saved_weights_finite(run: TrainState, what: str) -> None:
    """Raise NonFiniteError (on every rank) unless the model and its EMA are
    finite; ``what`` says where the run stands, for the message."""
    ema = [] if run.ema is None else list(run.ema.tensors().values())
    if not all_finite([*_model_tensors(run.model), *ema]):
        raise NonFiniteError(
            f"the weights became nan or inf by {what}; they were not saved; "
            + _NONFINITE_ADVICE
        )


def plan_batches(cfg: CfgNode, world_size: int, saved: dict | None) -> BatchPlan:
    """The batch plan, continuing a checkpoint's when resuming.

    On another world size the global batch is kept (per-process batch
    recomputed) unless ``TRAIN.RESUME_BATCH per_rank``, which keeps the
    per-process batch and scales the learning rate with the global batch.
    A fresh run starts from the linear scaling rule of
    ``OPTIM.REFERENCE_BATCH`` (1 when it is off).
    """
    accum = cfg.TRAIN.ACCUM_STEPS
    if saved is None:
        per_rank = cfg.TRAIN.BATCH_SIZE
        scale = optim.reference_lr_scale(cfg.OPTIM, per_rank * accum * world_size)
        return BatchPlan(per_rank, accum, world_size, scale)
    old_global, lr_scale = saved["global_batch"], saved["lr_scale"]
    per_rank = saved["batch_per_rank"] * saved["accum"] // accum
    if saved["world_size"] == world_size:
        return BatchPlan(per_rank, accum, world_size, lr_scale)
    if cfg.TRAIN.RESUME_BATCH == "per_rank":
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
        saved["world_size"],
        plan.per_rank,
        plan.global_batch,
        plan.lr_scale,
    )
    return plan


def train_epoch(
    run: TrainState,
    loader: DataLoader,
    cfg: CfgNode,
    after_step: Callable[[], bool] = lambda: False,
) -> bool:
    """Train the rest of epoch ``progress.epoch``; True if ``after_step`` stopped it.

    The learning rate is set before every step.  Micro-batches that cannot
    fill a whole step at the end of the epoch are skipped.
    ``progress.consumed`` advances with every step, so a checkpoint taken in
    ``after_step`` resumes at the next unseen batch.
    """
    progress, plan = run.progress, run.plan
    run.model.train()
    loader.sampler.set_epoch(progress.epoch, progress.consumed)
    first = progress.consumed // plan.global_batch
    total = first + len(loader) // plan.accum
    meter = MetricSums(run.device, min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES))
    loss_fn = build_train_loss(cfg.TRAIN, cfg.MODEL.NUM_CLASSES)
    status = _TrainStatus(cfg, run, first, total) if live_console() else None
    batches = iter(loader)
    data_time, window_start = 0.0, time.perf_counter()
    try:
        for step in range(first, total):
            lr = optim.lr_at(cfg.OPTIM, progress.epoch + step / total) * plan.lr_scale
            optim.set_lr(run.optimizer, lr)
            data_time += _train_step(
                run, batches, meter, loss_fn, cfg.OPTIM.CLIP_GRAD_NORM
            )
            progress.consumed += plan.global_batch
            run.clock.step()
            if (step + 1) % cfg.TRAIN.PRINT_FREQ == 0 or step + 1 == total:
                window_steps = (step - first) % cfg.TRAIN.PRINT_FREQ + 1
                elapsed = time.perf_counter() - window_start
                stats = _log_train(cfg, run, meter, step, total, lr, elapsed,
                                   data_time / window_steps)  # fmt: skip
                meter.reset()
                data_time, window_start = 0.0, time.perf_counter()
                if status:
                    status.window = stats
            if status:
                status.show(step, lr)
            if after_step():
                return True
        return False
    finally:
        end_status(keep=True)


# Host synchronizations of a CUDA training step (each stalls the GPU queue);
# keep this list true when the step changes.
# Every step:
# - fp16 only (GradScaler enabled): GradScaler.step reads its found-inf flag
#   with .item() (GradScaler._maybe_opt_step, torch/amp/grad_scaler.py), once
#   per device holding gradients. The EMA learns of a skipped step from that
#   same read (_optimizer_step); bf16 and full precision have no scaler.
# - MODEL.SYNCBN: torch's SyncBatchNorm forward drops the statistics of empty
#   ranks with a boolean mask (count_all[mask] in torch/nn/modules/_functions.py,
#   pytorch issue 78549): one sync per SyncBN layer and micro-batch.
# - stop.agreed() in after_step, with more than one process: all_reduce_max_int
#   through a CPU gloo group (.item() of a CPU tensor). No GPU sync, but a host
#   collective: every step waits for the slowest rank's host.
# Not syncs: waiting for the data loader (host); the .to(device,
# non_blocking=True) of images (in the normalizer) and targets, from the
# loader's pinned batches (TRAIN.PIN_MEMORY; from pageable memory CUDA may copy
# synchronously); the mixing order (pinned, losses.host_to_device) and
# torchvision's Mixup/CutMix draws (on the CPU generator); scaler.scale,
# unscale_ and update (device-side kernels); clip_grad_norm_ (it reads back only
# with error_if_nonfinite, off); SGD and AdamW steps (AdamW's step counts live
# on the CPU unless capturable or fused); ZeRO-1's broadcasts (NCCL waits order
# streams); the EMA's lerp (a host float weight); MetricSums.update.
# At print steps: MetricSums.reduce (all_reduce + .tolist(), one sync); when the
# window's loss is not finite, all_finite (one sync + a CPU collective).
# At checkpoint steps: all_finite and the state dicts copied to the CPU.
def _train_step(
    run: TrainState, batches, meter: MetricSums, loss_fn: TrainLoss, clip: float
) -> float:
    """One optimizer step of ``plan.accum`` micro-batches; seconds spent on data.

    DDP synchronizes gradients on the last micro-batch only.  ``loss_fn``
    mixes each micro-batch on the device (seeded by the micro-batch's place in
    the epoch) and gives its loss; top-1/top-k count the original labels.
    """
    model, device, accum = run.model, run.device, run.plan.accum
    progress, plan = run.progress, run.plan
    # Micro-batch m of this rank starts at global position first + m * stride.
    first, stride = progress.consumed + du.get_rank(), plan.per_rank * plan.world_size
    data_time = 0.0
    for micro in range(accum):
        tic = time.perf_counter()
        images, targets = next(batches)
        data_time += time.perf_counter() - tic
        images = run.normalize(images)
        targets = targets.to(device, non_blocking=True)
        seed = mix_seed(progress.seed, progress.epoch, first + micro * stride)
        images, targets, loss_targets = loss_fn.mix(images, targets, seed)
        with gradient_sync(model, sync=micro == accum - 1):
            with _autocast(device, run.amp_dtype):
                logits = model(images)
                loss = loss_fn(logits, loss_targets)
            if micro == 0:
                # Free the last step's gradients here, just before backward
                # allocates new ones, not after the step: then the allocator
                # hands backward the memory just freed, where freeing before
                # the forward made CPU runs page-fault twice as often and the
                # step 5-10% slower (tools/benchmark.py, resnet20 on CPU).
                # torchvision's reference loop zeroes at the same place.
                run.optimizer.zero_grad(set_to_none=True)
            run.scaler.scale(loss / accum).backward()
        meter.update(loss.detach() * targets.numel(), logits.detach(), targets)
    ema = run.ema
    stepped = _optimizer_step(model, run.optimizer, run.scaler, clip, ema is not None)
    if stepped and ema is not None:
        ema.step()
    return data_time


class _TrainStatus:
    """The live progress line of a training epoch (interactive terminals only).

    Loss and top-1 are those of the last ``TRAIN.PRINT_FREQ`` window over all
    ranks (updated at print steps); the rest is known on the host every step,
    so the bar costs no device synchronization.
    """

    def __init__(self, cfg: CfgNode, run: TrainState, first: int, total: int):
        self.cfg, self.run, self.first, self.total = cfg, run, first, total
        self.start = time.perf_counter()
        self.window: dict = {}

    def show(self, step: int, lr: float) -> None:
        """Redraw the line after optimizer step ``step`` (0-based)."""
        done = step + 1
        elapsed = time.perf_counter() - self.start
        img_per_s = (done - self.first) * self.run.plan.global_batch / elapsed
        metrics = "loss -  top1 -"
        if self.window:
            metrics = f"loss {self.window['loss']:.4f}  top1 {self.window['top1']:.2f}"
        eta = format_eta(self.run.clock.eta())
        set_status(
            f"ep {self.run.progress.epoch + 1}/{self.cfg.OPTIM.MAX_EPOCH} "
            f"{progress_bar(done, self.total)} {done}/{self.total}  {metrics}  "
            f"lr {lr:.5f}  {img_per_s:.0f} img/s  eta {eta}",
            force=done == self.total,
        )


def _log_train(cfg, run, meter, step, steps, lr, elapsed, data_time) -> dict:
    """Reduce the window's metrics over all ranks, log them (rank 0 writes) and
    return them."""
    epoch = run.progress.epoch
    stats = meter.reduce()
    speed = _throughput(cfg, run.plan.world_size, stats["samples"], elapsed)
    img_per_s = speed["img_per_s"]
    step_time = elapsed * run.plan.global_batch / max(stats["samples"], 1)
    _watch_data_time(cfg, run, data_time, step_time)
    logger.info(
        "train ep %d/%d it %d/%d  loss %.4f  top1 %.2f  top%d %.2f  lr %.5f  "
        "img/s %.0f%s  data %.1fms  eta %s",
        epoch + 1,
        cfg.OPTIM.MAX_EPOCH,
        step + 1,
        steps,
        stats["loss"],
        stats["top1"],
        meter.topk,
        stats["topk"],
        lr,
        img_per_s,
        _format_scaling(speed),
        1000 * data_time,
        format_eta(run.clock.eta()),
        extra={STATUS_LINE: True},
    )
    record = {
        "split": "train",
        "epoch": epoch + 1,
        "iter": step + 1,
        "lr": lr,
        **speed,
        "data_ms": 1000 * data_time,
        **stats,
    }
    scalars = {
        "train/loss": stats["loss"],
        "train/top1": stats["top1"],
        "train/lr": lr,
        "train/img_per_s": img_per_s,
        "train/img_per_s_per_rank": speed["img_per_s_per_rank"],
        "train/data_ms": 1000 * data_time,
    }
    run.writer.write(record, scalars, epoch * steps + step + 1)
    if not math.isfinite(stats["loss"]):
        _nonfinite_loss(run, stats, step)
    return stats


def _nonfinite_loss(run: TrainState, stats: dict, step: int) -> None:
    """The window's loss (summed over all ranks, so the same on every rank) is
    NaN or inf: raise NonFiniteError, unless a GradScaler skipped those steps.

    With fp16 loss scaling a step whose gradients overflow is skipped and the
    weights stay as they were: a non-finite loss then is a warning as long as
    the weights are finite.  Without it the step has already spoiled them.
    """
    epoch = run.progress.epoch + 1
    if run.scaler.is_enabled() and all_finite(_model_tensors(run.model)):
        logger.warning(
            "the training loss was %s in epoch %d up to iteration %d; the "
            "GradScaler skipped those steps and the weights are finite; if this "
            "repeats, the fp16 forward pass overflows: use TRAIN.MIXED_PRECISION "
            "bf16 or none",
            stats["loss"],
            epoch,
            step + 1,
        )
        return
    window = max(stats["samples"] // run.plan.global_batch, 1)
    earlier = f" (or earlier, from iteration {step + 2 - window})" * (window > 1)
    raise NonFiniteError(
        f"the training loss became {stats['loss']} at epoch {epoch}, iteration "
        f"{step + 1}{earlier}; nothing non-finite was saved; " + _NONFINITE_ADVICE
    )


def _throughput(cfg: CfgNode, world_size: int, samples: int, elapsed: float) -> dict:
    """Global and per-process img/s of a window, and the scaling efficiency.

    The efficiency (global img/s over ``world_size`` times the one-process
    figure TRAIN.SINGLE_PROCESS_IMG_PER_S) is there only with more than one
    process and that figure set.
    """
    img_per_s = samples / max(elapsed, 1e-9)
    speed = {
        "img_per_s": img_per_s,
        "img_per_s_per_rank": img_per_s / world_size,
        "world_size": world_size,
    }
    alone = cfg.TRAIN.SINGLE_PROCESS_IMG_PER_S
    if world_size > 1 and alone > 0:
        speed["scaling_efficiency"] = img_per_s / (world_size * alone)
    return speed


def _format_scaling(speed: dict) -> str:
    """`` (N/rank, eff. E%)`` for the log line; empty for one process."""
    if speed["world_size"] == 1:
        return ""
    text = f" ({speed['img_per_s_per_rank']:.0f}/rank"
    if "scaling_efficiency" in speed:
        text += f", scaling eff. {100 * speed['scaling_efficiency']:.0f}%"
    return text + ")"


def _watch_data_time(cfg: CfgNode, run: TrainState, data_s: float, step_s: float):
    """Rank 0 warns once when the steps wait for data (TRAIN.DATA_BOUND_SHARE)."""
    share = cfg.TRAIN.DATA_BOUND_SHARE
    if run.data_watch.update(data_s, step_s, share) and du.is_main_process():
        logger.warning(
            "data-bound: waiting for data took %.0f%% of the step time (more than "
            "TRAIN.DATA_BOUND_SHARE %.2f) in %d logged windows in a row; feed the "
            "model faster: raise TRAIN.WORKERS (now %d; about one per CPU core "
            "per process), keep DATA.DECODER tensor (now %s), or store the "
            "images pre-resized (shorter side about 1.15 x TRAIN.IM_SIZE)",
            100 * data_s / max(step_s, 1e-9),
            share,
            run.data_watch.windows,
            cfg.TRAIN.WORKERS,
            cfg.DATA.DECODER,
        )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    normalize: nn.Module,
    topk: int,
    num_classes: int,
    print_freq: int,
    amp_dtype: torch.dtype | None = None,
    max_iters: int | None = None,
) -> tuple[dict, torch.Tensor]:
    """Exact evaluation: every sample once, sums reduced over all processes.

    ``normalize`` turns the loader's uint8 batches into the model's input on
    ``device``.  Returns loss (mean), top1 and topk (percent) and the
    number of samples, and the confusion matrix (on the CPU).  ``max_iters``
    stops early (a check, not an evaluation).
    """
    broadcast_buffers(model)
    model = unwrap_model(model)  # ranks may run different numbers of batches
    model.eval()
    sums = MetricSums(device, topk)
    confusion = ConfusionMatrix(device, num_classes)
    iters = min(len(loader), max_iters or len(loader))
    # Forward passes this rank must add on empty batches to match the others.
    missing = du.all_reduce_max_int(iters) - iters if is_sharded(model) else 0
    live = live_console()
    for it, (images, targets) in enumerate(loader):
        if it == iters:
            break
        images = normalize(images)
        targets = targets.to(device, non_blocking=True)
        with _autocast(device, amp_dtype):
            logits = model(images)
            loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        sums.update(loss_sum, logits, targets)
        confusion.update(logits, targets)
        if live:
            bar = progress_bar(it + 1, iters)
            set_status(f"val {bar} {it + 1}/{iters}", force=it == 0)
        elif (it + 1) % print_freq == 0 and it + 1 < iters:
            logger.info("eval it %d/%d", it + 1, iters)
    if missing:  # a sharded forward is a collective: run as often as the rest
        image = loader.dataset[0][0]
        empty = normalize(image.new_empty((0, *image.shape)))
        for _ in range(missing):
            with _autocast(device, amp_dtype):
                model(empty)
    end_status(keep=False)
    stats = sums.reduce()
    return stats, confusion.reduce()


def save_training_checkpoint(cfg: CfgNode, run: TrainState) -> None:
    """Gather every rank's RNG state; rank 0 writes the checkpoint of the run.

    Every rank returns only once the checkpoint is complete (file renamed into
    place, ``last`` moved): a rank that then exits, stopped by a signal, must
    not get the job step ended (``srun --kill-on-bad-exit``) while rank 0 still
    writes.  When rank 0's save fails, every rank raises.
    """
    progress, plan = run.progress, run.plan
    step = progress.consumed // plan.global_batch
    where = f"epoch {progress.epoch + 1}, iteration {step}"
    if step == 0:
        where = f"the end of epoch {progress.epoch}"
    _check_saved_weights_finite(run, where)
    # The EMA goes with the model: into the shards, or whole into the file.
    ema = {} if run.ema is None else {"ema": run.ema.tensors()}
    if is_sharded(run.model):  # every rank writes its shards, nothing gathered
        name = cp.checkpoint_name(progress.epoch, step)
        shards = {**sharded_state(run.model, run.optimizer), **ema}
        weights = cp.save_sharded(cfg.OUT_DIR, name, shards)
    else:
        weights = {
            "model": model_state_dict(run.model),
            "optimizer": optimizer_state_dict(run.model, run.optimizer),
            **ema,
        }
    if run.ema is not None:
        weights["ema_counters"] = run.ema.counters()
    state = {
        **weights,
        "scaler": run.scaler.state_dict(),
        "epoch": progress.epoch,
        "consumed": progress.consumed,
        "best_top1": progress.best_top1,
        "best_ema_top1": progress.best_ema_top1,
        "seed": progress.seed,
        "rng": du.all_gather_object(
            cp.capture_rng_state(model_devices(run.model, run.device))
        ),
        "world_size": plan.world_size,
        "global_batch": plan.global_batch,
        "batch_per_rank": plan.per_rank,
        "accum": plan.accum,
        "lr_scale": plan.lr_scale,
        "arch": cfg.MODEL.ARCH,
        "classes": run.classes,
        "cfg": cfg.dump(),
    }
    error = None
    if du.is_main_process():
        try:
            path = cp.save_checkpoint(
                cfg.OUT_DIR, progress.epoch, state, cfg.CHECKPOINT.KEEP, step
            )
            logger.info("saved %s", path)
        except Exception as caught:  # tell the others before raising it
            error = caught
    # The barrier after the save; rank 0 joins it with its failure, if any,
    # so that no rank waits for a checkpoint that will not come.
    if du.all_reduce_max_int(int(error is not None)):
        if error is not None:
            raise error
        raise RuntimeError("rank 0 failed to save the checkpoint (see log.txt)")


def _load_training_state(
    model, optimizer, path: str, state: dict, ema: ModelEma | None
) -> bool:
    """Load the model, optimizer and EMA of training checkpoint ``path``; True
    if it held an EMA to load.

    An FSDP model reads its own shards of a sharded checkpoint; anything else
    reads whole weights (a sharded checkpoint's read whole first).
    """
    saved_ema = ema is not None and "ema_counters" in state
    if "sharded" in state and is_sharded(model):
        directory = cp.shards_of(path, state)
        load_sharded_state(model, optimizer, directory)
        if saved_ema:
            ema.load_shards(directory, state["ema_counters"])
        return saved_ema
    if "sharded" in state:
        state = cp.load_full(path)
    load = functools.partial(load_model_state, model)
    cp.load_model_weights(unwrap_model(model), state, path, load)
    load_optimizer_state(model, optimizer, state["optimizer"])
    if saved_ema:
        ema.load(state["ema"], state["ema_counters"])
    return saved_ema


def _load_weights(cfg, model, optimizer) -> str:
    """Load MODEL.WEIGHTS (and its optimizer with TRAIN.LOAD_OPT); say what, in words.

    With MODEL.FINETUNE a classifier head of another size is skipped and keeps
    its fresh initialisation; the optimizer state then is not loaded, since
    its head entries would not fit (and it belongs to another task).
    """
    path = cfg.MODEL.WEIGHTS
    state = cp.load_full(path)
    load = functools.partial(load_model_state, model)
    classes = cfg.MODEL.NUM_CLASSES if cfg.MODEL.FINETUNE else None
    skipped = cp.load_model_weights(unwrap_model(model), state, path, load, classes)
    has_optimizer = isinstance(state, dict) and "optimizer" in state
    if skipped:
        logger.info(
            "fine-tuning: %d keys of %s skipped (shapes differ), the new %d-class "
            "head keeps its fresh initialisation: %s",
            len(skipped),
            path,
            cfg.MODEL.NUM_CLASSES,
            ", ".join(skipped),
        )
        if cfg.TRAIN.LOAD_OPT and has_optimizer:
            logger.info("fine-tuning: the optimizer state of %s is not loaded", path)
        return f"weights from {path}, new {cfg.MODEL.NUM_CLASSES}-class head"
    if cfg.TRAIN.LOAD_OPT and has_optimizer:
        load_optimizer_state(model, optimizer, state["optimizer"])
        return f"weights from {path} and its optimizer"
    return f"weights from {path}"


def _agreed_resume_checkpoint(out_dir: str) -> tuple[str, dict] | None:
    """The checkpoint to resume from, chosen by rank 0 (which checks the shard
    checksums of a sharded one) and loaded by every rank."""
    found = None
    if du.is_main_process():
        found = cp.find_resume_checkpoint(out_dir, checksums=True)
    path = du.broadcast_object(None if found is None else found[0])
    if path is None or found is not None:
        return found
    return path, cp.load_file(path)


def _resume_or_load(
    cfg, model, optimizer, scaler, ema: ModelEma | None = None
) -> tuple[Progress, dict | None, str]:
    """Progress to continue from, the checkpoint resumed (None when new) and
    what the run starts from, in words."""
    if cfg.TRAIN.AUTO_RESUME:
        found = _agreed_resume_checkpoint(cfg.OUT_DIR)
        if found is not None:
            path, state = found
            restored = _load_training_state(model, optimizer, path, state, ema)
            if ema is not None and not restored:
                ema.reset()  # an EMA the checkpoint lacks starts from its weights
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            progress = Progress(
                state["epoch"], state["consumed"], state["best_top1"], state["seed"]
            )
            progress.best_ema_top1 = state.get("best_ema_top1", -1.0)
            start = (
                f"resumed from {path} (epoch {progress.epoch} done, "
                f"{progress.consumed} samples into the next)"
            )
            logger.info("%s", start)
            return progress, state, start
    if cfg.MODEL.WEIGHTS:
        start = _load_weights(cfg, model, optimizer)
        if ema is not None:
            ema.reset()
        logger.info("loaded %s", start)
        return Progress(), None, start
    pretrained = " (ImageNet-pretrained weights)" * cfg.MODEL.PRETRAINED
    return Progress(), None, "a new run" + pretrained


class StopRequest:
    """Turns SIGTERM / SIGUSR1 (Slurm's warning before preemption or the time
    limit) into a request that every rank agrees on at the next step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        self.stopping = False  # agreed: the run stops
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self) -> int:
        """The signal any rank received (0 if none): a collective call."""
        agreed = du.all_reduce_max_int(self.signum)
        self.stopping = self.stopping or bool(agreed)
        return agreed

    def restore(self) -> None:
        """Put the previous signal handlers back, unless the run stops: then
        more of these signals (srun sends SIGTERM to every task once the first
        one exits) are only recorded until the process exits 128+N."""
        if self.stopping:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _check_loader(loader: DataLoader, plan: BatchPlan) -> None:
    if len(loader) < plan.accum:
        raise ValueError(
            f"a batch of {plan.per_rank} x {plan.accum} accumulation steps is "
            f"larger than the {len(loader.sampler)} training images each of the "
            f"{plan.world_size} processes gets; lower TRAIN.BATCH_SIZE"
        )


def train_model(cfg: CfgNode) -> dict:
    """Train ``cfg`` from scratch or from its last checkpoint.

    Returns the final validation metrics, or ``{"stopped_by": signal number}``
    when SIGTERM/SIGUSR1 stopped it after saving a checkpoint.
    """
    with run_context(cfg) as (info, device):
        if info.rank == 0:
            dump_cfg(cfg)
            for path in cp.remove_stale_files(cfg.OUT_DIR):
                logger.info("removed %s, left by a save that was killed", path)
        writer = MetricsWriter(cfg.OUT_DIR, enabled=info.rank == 0)
        try:
            run, train_loader, val_loader = _build_run(cfg, info, device, writer)
            stop = StopRequest()
            try:
                return _train_epochs(cfg, run, train_loader, val_loader, stop)
            finally:
                stop.restore()
        finally:
            writer.close()


def dry_run(cfg: CfgNode) -> dict:
    """Build everything, run one training step and one evaluation batch.

    A check of a job before it is queued: every rank runs; a checkpoint to
    resume from is loaded; nothing is written.  Returns the timings (seconds)
    and the step's metrics.
    """
    cfg = cfg.clone()
    cfg.defrost()
    cfg.TRAIN.PRINT_FREQ = 1  # log the single step
    cfg.freeze()
    with run_context(cfg, log_files=False) as (info, device):
        tic = time.perf_counter()
        writer = MetricsWriter(cfg.OUT_DIR, enabled=False)
        run, train_loader, val_loader = _build_run(cfg, info, device, writer)
        built = time.perf_counter()
        train_epoch(run, train_loader, cfg, after_step=lambda: True)
        stepped = time.perf_counter()
        topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
        stats, _ = evaluate(
            run.model,
            val_loader,
            device,
            run.normalize,
            topk,
            cfg.MODEL.NUM_CLASSES,
            cfg.TEST.PRINT_FREQ,
            run.amp_dtype,
            max_iters=1,
        )
        done = time.perf_counter()
        # Nothing was reset: the peak of the whole dry run, build included, on
        # every device of every rank.
        peaks = PeakMemory(model_devices(run.model, device)).read()
        memory = max(mb for rank in du.all_gather_object(peaks) for mb in rank)
        timings = {
            "build_s": built - tic,
            "train_step_s": stepped - built,
            "eval_batch_s": done - stepped,
            "peak_mem_mb": memory,
        }
        logger.info(
            "dry run passed: built in %.1f s, one training step %.2f s, one "
            "evaluation batch %.2f s (top1 %.2f on %d images), peak memory "
            "%.0f MiB per process; nothing was written",
            timings["build_s"],
            timings["train_step_s"],
            timings["eval_batch_s"],
            stats["top1"],
            stats["samples"],
            memory,
        )
        return {**timings, **stats}


def _build_run(
    cfg: CfgNode, info: du.LaunchInfo, device: torch.device, writer: MetricsWriter
) -> tuple[TrainState, DataLoader, DataLoader]:
    """Data, model, optimizer, resume state and loaders of a training run.

    Logs the start-up report; all ranks must call it.
    """
    rank, world = info.rank, info.world_size
    seed = resolve_seed(cfg.RNG_SEED)
    seed_everything(seed + rank)
    train_set, val_set = build_dataset(cfg, True), build_dataset(cfg, False)
    model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES, cfg.MODEL.PRETRAINED)
    size = reports.model_size(model)
    if cfg.MODEL.ACT_CKPT:
        blocks = enable_activation_checkpointing(model)
        logger.info("activation checkpointing: %d blocks recompute", blocks)
    amp_dtype, use_scaler = resolve_precision(cfg.TRAIN.MIXED_PRECISION, device)
    channels_last = cfg.MODEL.CHANNELS_LAST and cfg.DIST.STRATEGY != "fsdp"
    if cfg.MODEL.CHANNELS_LAST and not channels_last:
        logger.info("channels-last: off under FSDP, which shards contiguous tensors")
    elif channels_last:
        # Convolutions give outputs in the layout of their weights, so the whole
        # network runs channels-last; the normaliser writes the input batches
        # in that layout too, which saves the first convolution a copy.
        model = model.to(memory_format=torch.channels_last)
    model = wrap_model(
        model,
        device,
        cfg.MODEL.SYNCBN,
        "dp" if cfg.DIST.STRATEGY == "dp" else "ddp",
        cfg.DIST.STRATEGY,
        cfg.DIST.FSDP_CPU_OFFLOAD,
        amp_dtype if cfg.DIST.STRATEGY == "fsdp" else None,
    )
    optimizer = optim.build_optimizer(model, cfg.OPTIM)
    if cfg.DIST.STRATEGY == "zero1":
        optimizer = shard_optimizer(optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    ema = None
    if cfg.MODEL.EMA:
        ema = ModelEma(model, cfg.MODEL.EMA_DECAY, cfg.MODEL.EMA_WARMUP,
                       cfg.MODEL.EMA_EVERY)  # fmt: skip
    # Every rank loads the same file, so the replicas stay identical.
    progress, saved, start = _resume_or_load(cfg, model, optimizer, scaler, ema)
    progress.seed = seed if saved is None else progress.seed
    plan = plan_batches(cfg, world, saved)
    train_loader = build_train_loader(
        cfg, train_set, rank, world, progress.seed, device, plan.per_rank
    )
    val_loader = build_test_loader(cfg, val_set, rank, world, device)
    _check_loader(train_loader, plan)
    if saved is not None and len(saved["rng"]) == world:
        cp.restore_rng_state(saved["rng"][rank], model_devices(model, device))
    steps_per_epoch = len(train_loader) // plan.accum
    clock = RunClock(
        cfg.OPTIM.MAX_EPOCH * steps_per_epoch,
        progress.epoch * steps_per_epoch + progress.consumed // plan.global_batch,
    )
    normalize = build_normalizer(cfg, device, channels_last)
    run = TrainState(model, optimizer, scaler, amp_dtype, device, normalize, plan,
                     progress, clock, writer, list(train_set.classes), ema)  # fmt: skip
    report = {
        "versions": reports.versions(),
        "world": reports.world_layout(info, device),
        "data": {
            "name": cfg.DATA.NAME,
            "train_images": len(train_set),
            "val_images": len(val_set),
            "class_names": run.classes,
        },
        "model": {"arch": cfg.MODEL.ARCH, "syncbn": cfg.MODEL.SYNCBN, **size},
        "batch": {
            "per_rank": plan.per_rank,
            "accum": plan.accum,
            "world_size": world,
            "global": plan.global_batch,
        },
        "lr": cfg.OPTIM.BASE_LR * plan.lr_scale,
        "lr_policy": cfg.OPTIM.LR_POLICY,
        "strategy": cfg.DIST.STRATEGY,
        "precision": "none" if amp_dtype is None else str(amp_dtype).split(".")[-1],
        "seed": f"{progress.seed}" + " (picked at random)" * (cfg.RNG_SEED is None),
        "start": start,
    }
    text = reports.format_startup(report)
    logger.info("%s", text)
    writer.write({"split": "start", **report})
    writer.text("run/start", "    " + text.replace("\n", "\n    "))
    if saved is None and writer.enabled:
        _log_training_images(writer, train_set, progress.seed)
    return run, train_loader, val_loader


def _log_training_images(writer: MetricsWriter, dataset, seed: int) -> None:
    """Log a grid of 16 augmented training images (spread over the data set),
    as the model sees them before normalisation."""
    indices = torch.linspace(0, len(dataset) - 1, min(16, len(dataset))).long()
    with torch.random.fork_rng(devices=[]):  # leave the run's RNG as it was
        torch.manual_seed(seed)
        images = torch.stack([dataset[int(i)][0] for i in indices])
    grid = torchvision.utils.make_grid(images, nrow=8)
    pixels = grid.permute(1, 2, 0).numpy()
    writer.image("train/augmented_images", pixels)


def _train_epochs(
    cfg: CfgNode,
    run: TrainState,
    train_loader: DataLoader,
    val_loader: DataLoader,
    stop: StopRequest,
) -> dict:
    """The epoch loop of :func:`train_model`: train, evaluate, save."""
    progress, period = run.progress, cfg.CHECKPOINT.PERIOD_ITERS
    stopped_by = 0

    def after_step() -> bool:
        nonlocal stopped_by
        stopped_by = stop.agreed()
        if stopped_by or (period and run.clock.done_iters % period == 0):
            save_training_checkpoint(cfg, run)
        return bool(stopped_by)

    stats: dict = {}
    memory = PeakMemory(model_devices(run.model, run.device))
    while progress.epoch < cfg.OPTIM.MAX_EPOCH:
        memory.reset()  # the training epoch's own peak, not the run's
        if train_epoch(run, train_loader, cfg, after_step):
            return _stopped(cfg, stopped_by)
        train_peak = memory.read()
        trained = progress.consumed  # over restarts, if any
        progress.epoch, progress.consumed = progress.epoch + 1, 0
        stats = _evaluate_epoch(
            cfg, run, train_loader, val_loader, trained, train_peak=train_peak
        )
        if run.ema is not None:
            with run.ema.swapped_in():
                _evaluate_epoch(
                    cfg, run, train_loader, val_loader, trained, True, train_peak
                )
        last = progress.epoch == cfg.OPTIM.MAX_EPOCH
        stopped_by = stop.agreed()
        if stopped_by or last or progress.epoch % cfg.CHECKPOINT.PERIOD == 0:
            save_training_checkpoint(cfg, run)
        if stopped_by:
            return _stopped(cfg, stopped_by)
    if not stats:
        logger.info("nothing to do: %d epochs already done", progress.epoch)
        return stats
    hparams = {key: value for key, value in flat_cfg(cfg).items() if key != "OUT_DIR"}
    final = {
        "hparam/best_top1": progress.best_top1,
        "hparam/top1": stats["top1"],
        "hparam/loss": stats["loss"],
    }
    if run.ema is not None:
        final["hparam/best_ema_top1"] = progress.best_ema_top1
    run.writer.hparams(hparams, final)
    return stats


def _stopped(cfg: CfgNode, signum: int) -> dict:
    name = signal.Signals(signum).name
    logger.info("stopped by %s after saving a checkpoint", name)
    if cfg.DIST.REQUEUE and du.is_main_process() and du.requeue_slurm_job():
        logger.info("requeued the Slurm job: it resumes from the checkpoint")
    # The first rank to exit (128+N) ends a --kill-on-bad-exit step: not
    # before rank 0 has requeued.
    du.barrier()
    return {"stopped_by": signum}


def _recompute_bn(cfg: CfgNode, run: TrainState, loader: DataLoader) -> None:
    """Precise BN over the first TRAIN.PRECISE_BN batches of the epoch just
    trained (the same batches after a resume)."""
    loader.sampler.set_epoch(run.progress.epoch - 1)
    batches = itertools.islice(loader, cfg.TRAIN.PRECISE_BN)
    images = (run.normalize(batch[0]) for batch in batches)
    with _autocast(run.device, run.amp_dtype):
        count = recompute_bn_statistics(unwrap_model(run.model), images)
    if count:  # 0: no BatchNorm layers
        world = du.get_world_size()
        logger.info("precise BN: statistics of %d batches x %d processes", count, world)


def _evaluate_epoch(
    cfg: CfgNode,
    run: TrainState,
    train_loader: DataLoader,
    val_loader: DataLoader,
    trained: int,
    ema: bool = False,
    train_peak: list[float] | None = None,
) -> dict:
    """Evaluate the model after an epoch (precise BN first, if asked), log it
    and save its best weights; its metrics.

    ``ema``: the model holds the EMA weights; ``trained``: the samples of the
    epoch; ``train_peak``: the epoch's training peak memory per device (MiB).
    """
    memory = PeakMemory(model_devices(run.model, run.device))
    memory.reset()  # the evaluation's own peak (precise BN included)
    if cfg.TRAIN.PRECISE_BN:
        _recompute_bn(cfg, run, train_loader)
    stats, confusion = evaluate(
        run.model,
        val_loader,
        run.device,
        run.normalize,
        min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES),
        cfg.MODEL.NUM_CLASSES,
        cfg.TEST.PRINT_FREQ,
        run.amp_dtype,
    )
    stats["train_samples"] = trained
    eval_peak = memory.read()
    peaks = {"train": train_peak or eval_peak, "eval": eval_peak}
    _log_eval_and_save(cfg, run, stats, confusion, ema, peaks)
    return stats


def _log_eval_and_save(
    cfg: CfgNode,
    run: TrainState,
    stats: dict,
    confusion: torch.Tensor,
    ema: bool = False,
    peaks: dict[str, list[float]] | None = None,
) -> None:
    """Log an evaluation (1-based epoch ``progress.epoch``); save best weights.

    ``ema``: of the EMA weights, which the model holds: "val_ema" records and
    scalars, best_ema.pth.  ``peaks``: this rank's peak memory (MiB) per device
    in the epoch's training (``"train"``) and in this evaluation (``"eval"``);
    None: the peak so far for both.
    """
    progress, epoch = run.progress, run.progress.epoch
    # Before anything counts as best: the model holds the weights evaluated
    # (the EMA's with ``ema``), whose scores mean nothing if they are not finite.
    kind = "EMA weights (MODEL.EMA)" if ema else "weights"
    if not all_finite(_model_tensors(run.model)):
        raise NonFiniteError(
            f"the {kind} evaluated after epoch {epoch} hold nan or inf; they were "
            "not saved and do not count as best; " + _NONFINITE_ADVICE
        )
    topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
    split = "val_ema" if ema else "val"
    best = progress.best_ema_top1 if ema else progress.best_top1
    is_best, best = stats["top1"] > best, max(best, stats["top1"])
    if ema:
        progress.best_ema_top1 = best
    else:
        progress.best_top1 = best
    if peaks is None:
        now = PeakMemory(model_devices(run.model, run.device)).read()
        peaks = {"train": now, "eval": now}
    # One value per device: per rank, or per GPU of a DataParallel (dp).
    ranks = du.all_gather_object(peaks)
    train_peak = [mb for rank in ranks for mb in rank["train"]]
    eval_peak = [mb for rank in ranks for mb in rank["eval"]]
    memory = [max(pair) for pair in zip(train_peak, eval_peak)]
    logger.info(
        "%s ep %d/%d  loss %.4f  top1 %.2f  top%d %.2f  samples %d  best %.2f  "
        "peak memory train %.0f / eval %.0f MiB",
        split,
        epoch,
        cfg.OPTIM.MAX_EPOCH,
        stats["loss"],
        stats["top1"],
        topk,
        stats["topk"],
        stats["samples"],
        best,
        max(train_peak),
        max(eval_peak),
    )
    per_class = per_class_top1(confusion)
    record = {"split": split, "epoch": epoch, "world_size": run.plan.world_size}
    record.update(stats, peak_mem_mb=memory, train_peak_mem_mb=train_peak,
                  eval_peak_mem_mb=eval_peak, per_class_top1=per_class)  # fmt: skip
    scalars = {
        f"{split}/loss": stats["loss"],
        f"{split}/top1": stats["top1"],
        f"{split}/topk": stats["topk"],
    }
    if not ema:  # the EMA's evaluation is logged in its record only
        scalars["memory/peak_mb"] = max(memory)
        scalars["memory/train_peak_mb"] = max(train_peak)
        scalars["memory/eval_peak_mb"] = max(eval_peak)
    if len(per_class) <= reports.MAX_PLOTTED_CLASSES:
        for name, top1 in zip(run.classes, per_class):
            if top1 is not None:
                scalars[f"{split}_per_class/{name}"] = top1
        image = reports.confusion_image(confusion, run.classes)
        run.writer.image(f"{split}/confusion_matrix", image, epoch)
    measured = np.array([top1 for top1 in per_class if top1 is not None])
    if measured.size:
        run.writer.histogram(f"{split}/per_class_top1", measured, epoch)
    run.writer.write(record, scalars, epoch)
    if not is_best:
        return
    whole = model_state_dict(run.model)  # a collective for FSDP
    if du.is_main_process():
        weights = {
            "model": whole,
            "epoch": epoch,
            "top1": stats["top1"],
            "arch": cfg.MODEL.ARCH,
            "classes": run.classes,
            "cfg": cfg.dump(),
        }
        name = cp.BEST_EMA_WEIGHTS if ema else cp.BEST_WEIGHTS
        cp.save_weights(os.path.join(cfg.OUT_DIR, name), weights)


def _eval_weights_path(cfg: CfgNode) -> str:
    if cfg.MODEL.WEIGHTS:
        return cfg.MODEL.WEIGHTS
    best = os.path.join(cfg.OUT_DIR, cp.BEST_WEIGHTS)
    if os.path.isfile(best):
        return best
    raise FileNotFoundError(
        "nothing to evaluate: set MODEL.WEIGHTS or train into OUT_DIR first "
        f"({best} is missing)"
    )


def test_model(cfg: CfgNode) -> dict:
    """Evaluate MODEL.WEIGHTS (or OUT_DIR/best.pth) on the validation set.

    Rank 0 also writes the confusion matrix (CSV, PNG) and the per-class
    accuracy (CSV) to OUT_DIR.  Returns the metrics, the confusion matrix,
    the class names and the paths written.
    """
    with run_context(cfg) as (info, device):
        path = _eval_weights_path(cfg)
        val_set = build_dataset(cfg, train=False)
        model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
        cp.load_model_weights(model, cp.load_file(path), path)
        model.to(device)
        loader = build_test_loader(cfg, val_set, info.rank, info.world_size, device)
        topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
        amp_dtype, _ = resolve_precision(cfg.TRAIN.MIXED_PRECISION, device)
        stats, confusion = evaluate(
            model,
            loader,
            device,
            build_normalizer(cfg, device),
            topk,
            cfg.MODEL.NUM_CLASSES,
            cfg.TEST.PRINT_FREQ,
            amp_dtype,
        )
        logger.info(
            "eval %s  loss %.4f  top1 %.2f  top%d %.2f  samples %d",
            path,
            stats["loss"],
            stats["top1"],
            topk,
            stats["topk"],
            stats["samples"],
        )
        classes = list(val_set.classes)
        table = reports.format_per_class(confusion, classes)
        logger.info("per-class top-1:\n%s", table)
        files = []
        if du.is_main_process():
            files = reports.write_per_class(cfg.OUT_DIR, confusion, classes)
            logger.info("wrote %s", ", ".join(files))
        writer = MetricsWriter(cfg.OUT_DIR, enabled=info.rank == 0)
        record = {"split": "val", "eval_only": True, "weights": path}
        record.update(world_size=info.world_size, **stats)
        record["per_class_top1"] = per_class_top1(confusion)
        writer.write(record)
        writer.close()
        return {**stats, "topk_k": topk, "weights": path, "files": files}
