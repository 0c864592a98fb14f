"""The training loop: ``train_model``, ``test_model``, ``train_epoch``, ``evaluate``."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterator

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


def train_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    amp_dtype: torch.dtype | None,
    cfg: CfgNode,
    device: torch.device,
    epoch: int,
    clock: RunClock,
    writer: MetricsWriter,
) -> None:
    """Train one epoch (0-based ``epoch``).

    Each optimizer step takes ``TRAIN.ACCUM_STEPS`` micro-batches of
    ``TRAIN.BATCH_SIZE`` per process; DDP synchronizes gradients on the last
    one only.  The learning rate is set before every step.  Micro-batches that
    cannot fill a whole step at the end of the epoch are skipped.
    """
    model.train()
    loader.sampler.set_epoch(epoch)
    accum = cfg.TRAIN.ACCUM_STEPS
    steps = len(loader) // accum
    meter = MetricSums(device, min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES))
    batches = iter(loader)
    data_time, window_start = 0.0, time.perf_counter()
    for step in range(steps):
        lr = optim.lr_at(cfg.OPTIM, epoch + step / steps)
        optim.set_lr(optimizer, lr)
        for micro in range(accum):
            tic = time.perf_counter()
            images, targets = next(batches)
            data_time += time.perf_counter() - tic
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            sync = micro == accum - 1 or not isinstance(model, DistributedDataParallel)
            with contextlib.nullcontext() if sync else model.no_sync():
                with _autocast(device, amp_dtype):
                    logits = model(images)
                    loss = F.cross_entropy(logits, targets)
                scaler.scale(loss / accum).backward()
            meter.update(loss.detach() * targets.numel(), logits.detach(), targets)
        _optimizer_step(model, optimizer, scaler, cfg.OPTIM.CLIP_GRAD_NORM)
        clock.step()
        if (step + 1) % cfg.TRAIN.PRINT_FREQ == 0 or step + 1 == steps:
            window_steps = step % cfg.TRAIN.PRINT_FREQ + 1
            elapsed = time.perf_counter() - window_start
            _log_train(
                cfg,
                meter,
                epoch,
                step,
                steps,
                lr,
                elapsed,
                data_time / window_steps,
                clock,
                writer,
            )
            meter.reset()
            data_time, window_start = 0.0, time.perf_counter()


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


def _checkpoint_state(cfg, model, optimizer, scaler, epoch, best_top1, seed) -> dict:
    return {
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "best_top1": best_top1,
        "seed": seed,
        "rng": du.all_gather_object(cp.capture_rng_state()),
        "world_size": du.get_world_size(),
        "global_batch": cfg.TRAIN.BATCH_SIZE * du.get_world_size(),
        "arch": cfg.MODEL.ARCH,
        "cfg": cfg.dump(),
    }


def _resume_or_load(
    cfg, model, optimizer, scaler
) -> tuple[int, float, int | None, list | None]:
    """Start epoch, best top-1, seed and per-rank RNG states to continue from."""
    if cfg.TRAIN.AUTO_RESUME:
        found = cp.find_resume_checkpoint(cfg.OUT_DIR)
        if found is not None:
            path, state = found
            cp.load_model_weights(unwrap_model(model), state, path)
            optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            logger.info("resumed from %s (epoch %d done)", path, state["epoch"])
            return state["epoch"], state["best_top1"], state["seed"], state["rng"]
    if cfg.MODEL.WEIGHTS:
        state = cp.load_file(cfg.MODEL.WEIGHTS)
        cp.load_model_weights(unwrap_model(model), state, cfg.MODEL.WEIGHTS)
        if cfg.TRAIN.LOAD_OPT and isinstance(state, dict) and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        logger.info("loaded weights from %s", cfg.MODEL.WEIGHTS)
    return 0, -1.0, None, None


def _check_loader(loader: DataLoader, cfg: CfgNode, world_size: int) -> None:
    if len(loader) == 0:
        raise ValueError(
            f"TRAIN.BATCH_SIZE {cfg.TRAIN.BATCH_SIZE} is larger than the "
            f"{len(loader.sampler)} training images each of the {world_size} "
            "processes gets; lower it"
        )


def train_model(cfg: CfgNode) -> dict:
    """Train ``cfg`` from scratch or from its last checkpoint; return final metrics."""
    with run_context(cfg) as (info, device):
        rank, world = info.rank, info.world_size
        if rank == 0:
            dump_cfg(cfg)
        accum = cfg.TRAIN.ACCUM_STEPS
        logger.info(
            "data %s, model %s, %d process(es) x batch %d x %d accumulation "
            "step(s) = global batch %d",
            cfg.DATA.NAME,
            cfg.MODEL.ARCH,
            world,
            cfg.TRAIN.BATCH_SIZE,
            accum,
            world * cfg.TRAIN.BATCH_SIZE * accum,
        )
        seed = resolve_seed(cfg.RNG_SEED)
        seed_everything(seed + rank)
        train_set, val_set = (
            build_dataset(cfg, train=True),
            build_dataset(cfg, train=False),
        )
        logger.info(
            "train images %d, val images %d, classes %d",
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
        start_epoch, best_top1, saved_seed, rng = _resume_or_load(
            cfg, model, optimizer, scaler
        )
        seed = seed if saved_seed is None else saved_seed
        logger.info("seed %d%s", seed, " (picked at random)" * (cfg.RNG_SEED is None))
        train_loader = build_train_loader(cfg, train_set, rank, world, seed, device)
        val_loader = build_test_loader(cfg, val_set, rank, world, device)
        _check_loader(train_loader, cfg, world)
        if rng is not None and len(rng) == world:
            cp.restore_rng_state(rng[rank])
        elif rng is not None:
            seed_everything(seed + rank + 1_000 * start_epoch)
        writer = MetricsWriter(cfg.OUT_DIR, enabled=rank == 0)
        topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
        iters = len(train_loader) // accum
        clock = RunClock(cfg.OPTIM.MAX_EPOCH * iters, start_epoch * iters)
        stats = {}
        try:
            for epoch in range(start_epoch, cfg.OPTIM.MAX_EPOCH):
                train_epoch(
                    model, train_loader, optimizer, scaler, amp_dtype, cfg, device,
                    epoch, clock, writer,
                )  # fmt: skip
                stats = evaluate(
                    model, val_loader, device, topk, cfg.TEST.PRINT_FREQ, amp_dtype
                )
                best_top1 = _after_epoch(
                    cfg,
                    model,
                    optimizer,
                    scaler,
                    epoch,
                    stats,
                    best_top1,
                    seed,
                    world,
                    writer,
                )
        finally:
            writer.close()
        if not stats:
            logger.info("nothing to do: %d epochs already done", start_epoch)
        return stats


def _after_epoch(
    cfg, model, optimizer, scaler, epoch, stats, best_top1, seed, world, writer
):
    """Log the evaluation, save best and periodic checkpoints; return best top-1."""
    topk = min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES)
    is_best = stats["top1"] > best_top1
    best_top1 = max(best_top1, stats["top1"])
    logger.info(
        "val ep %d/%d  loss %.4f  top1 %.2f  top%d %.2f  samples %d  best %.2f",
        epoch + 1,
        cfg.OPTIM.MAX_EPOCH,
        stats["loss"],
        stats["top1"],
        topk,
        stats["topk"],
        stats["samples"],
        best_top1,
    )
    record = {"split": "val", "epoch": epoch + 1, "world_size": world, **stats}
    scalars = {
        "val/loss": stats["loss"],
        "val/top1": stats["top1"],
        "val/topk": stats["topk"],
    }
    writer.write(record, scalars, epoch + 1)
    last = epoch + 1 == cfg.OPTIM.MAX_EPOCH
    if (epoch + 1) % cfg.CHECKPOINT.PERIOD == 0 or last:
        state = _checkpoint_state(
            cfg, model, optimizer, scaler, epoch + 1, best_top1, seed
        )
        if du.is_main_process():
            path = cp.save_checkpoint(
                cfg.OUT_DIR, epoch + 1, state, cfg.CHECKPOINT.KEEP
            )
            logger.info("saved %s", path)
    if is_best and du.is_main_process():
        cp.save_weights(
            os.path.join(cfg.OUT_DIR, cp.BEST_WEIGHTS),
            {
                "model": unwrap_model(model).state_dict(),
                "epoch": epoch + 1,
                "top1": stats["top1"],
                "arch": cfg.MODEL.ARCH,
                "cfg": cfg.dump(),
            },
        )
    return best_top1


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
