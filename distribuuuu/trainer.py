"""The training loop: ``train_model``, ``test_model``, ``train_epoch``, ``evaluate``."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu import distributed as du
from distribuuuu import optim
from distribuuuu.config import dump_cfg
from distribuuuu.data import build_dataset, build_test_loader, build_train_loader
from distribuuuu.logger import MetricsWriter, setup_logging
from distribuuuu.meters import MetricSums, format_eta
from distribuuuu.models import build_model
from distribuuuu.parallel import broadcast_buffers, unwrap_model, wrap_model

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
def run_context(cfg: CfgNode) -> Iterator[tuple[du.LaunchInfo, torch.device]]:
    """Join the process group, set up logging and cuDNN; leave the group at exit."""
    if cfg.CUDNN.DETERMINISTIC:
        # cuBLAS needs this before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    info, device = du.setup_distributed(
        cfg.DIST.BACKEND, cfg.DEVICE, cfg.DIST.INIT_TIMEOUT
    )
    try:
        setup_logging(cfg.OUT_DIR, info.rank)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.CUDNN.BENCHMARK
            torch.backends.cudnn.deterministic = cfg.CUDNN.DETERMINISTIC
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


def _optimizer_step(model, optimizer, scaler, clip_grad_norm: float) -> None:
    if clip_grad_norm > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class Progress:
    """Where the run stands; what a checkpoint must carry to continue exactly."""

    epoch: int = 0  # whole epochs done
    consumed: int = 0  # positions of this epoch's global sample order trained on
    best_top1: float = -1.0
    seed: int = 0


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
    plan: BatchPlan
    progress: Progress
    clock: RunClock
    writer: MetricsWriter


def plan_batches(cfg: CfgNode, world_size: int, saved: dict | None) -> BatchPlan:
    """The batch plan, continuing a checkpoint's when resuming.

    On another world size the global batch is kept (per-process batch
    recomputed) unless ``TRAIN.RESUME_BATCH per_rank``, which keeps the
    per-process batch and scales the learning rate with the global batch.
    """
    accum = cfg.TRAIN.ACCUM_STEPS
    if saved is None:
        return BatchPlan(cfg.TRAIN.BATCH_SIZE, accum, world_size)
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

    Each optimizer step takes ``plan.accum`` micro-batches of ``plan.per_rank``
    per process; DDP synchronizes gradients on the last one only.  The
    learning rate is set before every step.  Micro-batches that cannot fill a
    whole step at the end of the epoch are skipped.  ``progress.consumed``
    advances with every step, so a checkpoint taken in ``after_step`` resumes
    at the next unseen batch.
    """
    model, device, progress, plan = run.model, run.device, run.progress, run.plan
    model.train()
    loader.sampler.set_epoch(progress.epoch, progress.consumed)
    first = progress.consumed // plan.global_batch
    steps = len(loader) // plan.accum
    total = first + steps
    meter = MetricSums(device, min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES))
    batches = iter(loader)
    data_time, window_start = 0.0, time.perf_counter()
    for step in range(first, total):
        lr = optim.lr_at(cfg.OPTIM, progress.epoch + step / total) * plan.lr_scale
        optim.set_lr(run.optimizer, lr)
        for micro in range(plan.accum):
            tic = time.perf_counter()
            images, targets = next(batches)
            data_time += time.perf_counter() - tic
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            last = micro == plan.accum - 1
            sync = last or not isinstance(model, DistributedDataParallel)
            with contextlib.nullcontext() if sync else model.no_sync():
                with _autocast(device, run.amp_dtype):
                    logits = model(images)
                    loss = F.cross_entropy(logits, targets)
                run.scaler.scale(loss / plan.accum).backward()
            meter.update(loss.detach() * targets.numel(), logits.detach(), targets)
        _optimizer_step(model, run.optimizer, run.scaler, cfg.OPTIM.CLIP_GRAD_NORM)
        progress.consumed += plan.global_batch
        run.clock.step()
        if (step + 1) % cfg.TRAIN.PRINT_FREQ == 0 or step + 1 == total:
            window_steps = (step - first) % cfg.TRAIN.PRINT_FREQ + 1
            elapsed = time.perf_counter() - window_start
            _log_train(cfg, meter, progress.epoch, step, total, lr, elapsed,
                       data_time / window_steps, run.clock, run.writer)  # fmt: skip
            meter.reset()
            data_time, window_start = 0.0, time.perf_counter()
        if after_step():
            return True
    return False


def _log_train(cfg, meter, epoch, step, steps, lr, elapsed, data_time, clock, writer):
    """Reduce the window's metrics over all ranks; log them (rank 0 writes)."""
    stats = meter.reduce()
    img_per_s = stats["samples"] / elapsed
    logger.info(
        "train ep %d/%d it %d/%d  loss %.4f  top1 %.2f  top%d %.2f  lr %.5f  "
        "img/s %.0f  data %.1fms  eta %s",
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
        1000 * data_time,
        format_eta(clock.eta()),
    )
    record = {
        "split": "train",
        "epoch": epoch + 1,
        "iter": step + 1,
        "lr": lr,
        "img_per_s": img_per_s,
        **stats,
    }
    scalars = {
        "train/loss": stats["loss"],
        "train/top1": stats["top1"],
        "train/lr": lr,
        "train/img_per_s": img_per_s,
    }
    writer.write(record, scalars, epoch * steps + step + 1)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    topk: int,
    print_freq: int,
    amp_dtype: torch.dtype | None = None,
) -> dict:
    """Exact evaluation: every sample once, sums reduced over all processes.

    Returns loss (mean), top1 and topk (percent) and the number of samples.
    """
    broadcast_buffers(model)
    model = unwrap_model(model)  # ranks may run different numbers of batches
    model.eval()
    sums = MetricSums(device, topk)
    iters = len(loader)
    for it, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with _autocast(device, amp_dtype):
            logits = model(images)
            loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        sums.update(loss_sum, logits, targets)
        if (it + 1) % print_freq == 0 and it + 1 < iters:
            logger.info("eval it %d/%d", it + 1, iters)
    return sums.reduce()


def save_training_checkpoint(cfg: CfgNode, run: TrainState) -> None:
    """Gather every rank's RNG state; rank 0 writes the checkpoint of the run."""
    progress, plan = run.progress, run.plan
    state = {
        "model": unwrap_model(run.model).state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "epoch": progress.epoch,
        "consumed": progress.consumed,
        "best_top1": progress.best_top1,
        "seed": progress.seed,
        "rng": du.all_gather_object(cp.capture_rng_state()),
        "world_size": plan.world_size,
        "global_batch": plan.global_batch,
        "batch_per_rank": plan.per_rank,
        "accum": plan.accum,
        "lr_scale": plan.lr_scale,
        "arch": cfg.MODEL.ARCH,
        "cfg": cfg.dump(),
    }
    if du.is_main_process():
        step = progress.consumed // plan.global_batch
        path = cp.save_checkpoint(
            cfg.OUT_DIR, progress.epoch, state, cfg.CHECKPOINT.KEEP, step
        )
        logger.info("saved %s", path)


def _resume_or_load(cfg, model, optimizer, scaler) -> tuple[Progress, dict | None]:
    """Progress to continue from and the checkpoint resumed (None when new)."""
    if cfg.TRAIN.AUTO_RESUME:
        found = cp.find_resume_checkpoint(cfg.OUT_DIR)
        if found is not None:
            path, state = found
            cp.load_model_weights(unwrap_model(model), state, path)
            optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            progress = Progress(
                state["epoch"], state["consumed"], state["best_top1"], state["seed"]
            )
            logger.info(
                "resumed from %s (epoch %d done, %d samples into the next)",
                path,
                progress.epoch,
                progress.consumed,
            )
            return progress, state
    if cfg.MODEL.WEIGHTS:
        state = cp.load_file(cfg.MODEL.WEIGHTS)
        cp.load_model_weights(unwrap_model(model), state, cfg.MODEL.WEIGHTS)
        if cfg.TRAIN.LOAD_OPT and isinstance(state, dict) and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        logger.info("loaded weights from %s", cfg.MODEL.WEIGHTS)
    return Progress(), None


class StopRequest:
    """Turns SIGTERM / SIGUSR1 (Slurm's warning before preemption or the time
    limit) into a request that every rank agrees on at the next step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self) -> int:
        """The signal any rank received (0 if none): a collective call."""
        return du.all_reduce_max_int(self.signum)

    def restore(self) -> None:
        """Put the previous signal handlers back."""
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
        rank, world = info.rank, info.world_size
        if rank == 0:
            dump_cfg(cfg)
        seed = resolve_seed(cfg.RNG_SEED)
        seed_everything(seed + rank)
        train_set, val_set = build_dataset(cfg, True), build_dataset(cfg, False)
        logger.info(
            "data %s: train images %d, val images %d, classes %d",
            cfg.DATA.NAME,
            len(train_set),
            len(val_set),
            len(train_set.classes),
        )
        model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES, cfg.MODEL.PRETRAINED)
        model = wrap_model(model, device, cfg.MODEL.SYNCBN, cfg.DIST.MODE)
        optimizer = optim.build_optimizer(model, cfg.OPTIM)
        amp_dtype, use_scaler = resolve_precision(cfg.TRAIN.MIXED_PRECISION, device)
        scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
        # Every rank loads the same file, so the replicas stay identical.
        progress, saved = _resume_or_load(cfg, model, optimizer, scaler)
        progress.seed = seed if saved is None else progress.seed
        logger.info(
            "seed %d%s", progress.seed, " (picked at random)" * (cfg.RNG_SEED is None)
        )
        plan = plan_batches(cfg, world, saved)
        logger.info(
            "model %s; %d process(es) x batch %d x %d accumulation step(s) "
            "= global batch %d",
            cfg.MODEL.ARCH,
            world,
            plan.per_rank,
            plan.accum,
            plan.global_batch,
        )
        train_loader = build_train_loader(
            cfg, train_set, rank, world, progress.seed, device, plan.per_rank
        )
        val_loader = build_test_loader(cfg, val_set, rank, world, device)
        _check_loader(train_loader, plan)
        if saved is not None and len(saved["rng"]) == world:
            cp.restore_rng_state(saved["rng"][rank])
        steps_per_epoch = len(train_loader) // plan.accum
        clock = RunClock(
            cfg.OPTIM.MAX_EPOCH * steps_per_epoch,
            progress.epoch * steps_per_epoch + progress.consumed // plan.global_batch,
        )
        writer = MetricsWriter(cfg.OUT_DIR, enabled=rank == 0)
        run = TrainState(model, optimizer, scaler, amp_dtype, device, plan, progress,
                         clock, writer)  # fmt: skip
        stop = StopRequest()
        try:
            return _train_epochs(cfg, run, train_loader, val_loader, stop)
        finally:
            stop.restore()
            writer.close()


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

    topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
    stats: dict = {}
    while progress.epoch < cfg.OPTIM.MAX_EPOCH:
        if train_epoch(run, train_loader, cfg, after_step):
            return _stopped(cfg, stopped_by)
        stats = evaluate(run.model, val_loader, run.device, topk,
                         cfg.TEST.PRINT_FREQ, run.amp_dtype)  # fmt: skip
        stats["train_samples"] = progress.consumed  # over restarts, if any
        progress.epoch, progress.consumed = progress.epoch + 1, 0
        _log_eval_and_save(cfg, run.model, stats, progress, run.plan.world_size,
                           run.writer)  # fmt: skip
        last = progress.epoch == cfg.OPTIM.MAX_EPOCH
        stopped_by = stop.agreed()
        if stopped_by or last or progress.epoch % cfg.CHECKPOINT.PERIOD == 0:
            save_training_checkpoint(cfg, run)
        if stopped_by:
            return _stopped(cfg, stopped_by)
    if not stats:
        logger.info("nothing to do: %d epochs already done", progress.epoch)
    return stats


def _stopped(cfg: CfgNode, signum: int) -> dict:
    name = signal.Signals(signum).name
    logger.info("stopped by %s after saving a checkpoint", name)
    if cfg.DIST.REQUEUE and du.is_main_process() and du.requeue_slurm_job():
        logger.info("requeued the Slurm job: it resumes from the checkpoint")
    return {"stopped_by": signum}


def _log_eval_and_save(cfg, model, stats, progress, world, writer) -> None:
    """Log an evaluation (1-based epoch ``progress.epoch``); save best weights."""
    topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
    is_best = stats["top1"] > progress.best_top1
    progress.best_top1 = max(progress.best_top1, stats["top1"])
    epoch = progress.epoch
    logger.info(
        "val ep %d/%d  loss %.4f  top1 %.2f  top%d %.2f  samples %d  best %.2f",
        epoch,
        cfg.OPTIM.MAX_EPOCH,
        stats["loss"],
        stats["top1"],
        topk,
        stats["topk"],
        stats["samples"],
        progress.best_top1,
    )
    record = {"split": "val", "epoch": epoch, "world_size": world, **stats}
    scalars = {
        "val/loss": stats["loss"],
        "val/top1": stats["top1"],
        "val/topk": stats["topk"],
    }
    writer.write(record, scalars, epoch)
    if is_best and du.is_main_process():
        weights = {
            "model": unwrap_model(model).state_dict(),
            "epoch": epoch,
            "top1": stats["top1"],
            "arch": cfg.MODEL.ARCH,
            "cfg": cfg.dump(),
        }
        cp.save_weights(os.path.join(cfg.OUT_DIR, cp.BEST_WEIGHTS), weights)


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
    """Evaluate MODEL.WEIGHTS (or OUT_DIR/best.pth) on the validation set."""
    with run_context(cfg) as (info, device):
        path = _eval_weights_path(cfg)
        val_set = build_dataset(cfg, train=False)
        model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
        cp.load_model_weights(model, cp.load_file(path), path)
        model.to(device)
        loader = build_test_loader(cfg, val_set, info.rank, info.world_size, device)
        topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
        amp_dtype, _ = resolve_precision(cfg.TRAIN.MIXED_PRECISION, device)
        stats = evaluate(model, loader, device, topk, cfg.TEST.PRINT_FREQ, amp_dtype)
        logger.info(
            "eval %s  loss %.4f  top1 %.2f  top%d %.2f  samples %d",
            path,
            stats["loss"],
            stats["top1"],
            topk,
            stats["topk"],
            stats["samples"],
        )
        writer = MetricsWriter(cfg.OUT_DIR, enabled=info.rank == 0)
        writer.write(
            {
                "split": "val",
                "eval_only": True,
                "weights": path,
                "world_size": info.world_size,
                **stats,
            }
        )
        writer.close()
        return {**stats, "topk_k": topk, "weights": path}
