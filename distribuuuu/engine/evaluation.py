"""Exact evaluation: every validation sample counted once over all ranks.

:func:`evaluate` runs a model over a loader; :func:`evaluate_epoch` is the
evaluation after each training epoch (precise BN, logging, best weights);
:func:`evaluate_checkpoint` is ``--eval-only``.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.data import (
    build_dataset,
    build_normalizer,
    build_test_loader,
    empty_batch,
    eval_sizes,
)
from distribuuuu.dist import group as du
from distribuuuu.dist.watchdog import Watchdog
from distribuuuu.engine.numerics import (
    NONFINITE_ADVICE,
    NonFiniteError,
    all_finite,
    module_tensors,
)
from distribuuuu.engine.resume import save_best_weights
from distribuuuu.engine.run_log import log_evaluation
from distribuuuu.engine.session import run_context
from distribuuuu.engine.state import TrainState
from distribuuuu.engine.tta import tta_logits
from distribuuuu.logger import end_status, live_console, set_status
from distribuuuu.models import build_model
from distribuuuu.models.syncbn import recompute_bn_statistics
from distribuuuu.reporting import reports
from distribuuuu.reporting.meters import (
    ConfusionMatrix,
    MetricSums,
    PeakMemory,
    per_class_top1,
    progress_bar,
)
from distribuuuu.reporting.writer import MetricsWriter
from distribuuuu.strategies.precision import autocast, resolve_precision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSpec:
    """How to evaluate: where, in what precision, and what to count."""

    device: torch.device
    normalize: nn.Module  # the loader's uint8 batches -> the model's input
    topk: int  # k of the top-k accuracy
    num_classes: int  # the confusion matrix's size
    print_freq: int = 10  # log every this many batches (no live console)
    amp_dtype: torch.dtype | None = None  # autocast dtype; None = full precision
    max_iters: int | None = None  # stop early (a check, not an evaluation)
    collective: bool = False  # every forward is a collective (sharded weights)
    counted: bool = True  # this process's forward passes return logits to count
    tta: str = "none"  # TEST.TTA: the views whose logits are averaged
    crop: int = 0  # the crop of TEST.TTA five_crop / ten_crop

    @classmethod
    def of(cls, cfg: CfgNode, device, normalize, amp_dtype=None, **more) -> EvalSpec:
        """The spec of ``cfg`` (TRAIN.TOPK, MODEL.NUM_CLASSES, TEST.PRINT_FREQ,
        TEST.TTA)."""
        classes = cfg.MODEL.NUM_CLASSES
        topk = min(cfg.TRAIN.TOPK, classes)
        tta = {"tta": cfg.TEST.TTA, "crop": eval_sizes(cfg)[1]}
        return cls(device, normalize, topk, classes, cfg.TEST.PRINT_FREQ,
                   amp_dtype, **tta, **more)  # fmt: skip


def strategy_eval(strategy, model: nn.Module) -> dict:
    """The EvalSpec fields that ``strategy`` decides for its ``model``."""
    return {
        "collective": strategy.forward_is_collective(model),
        "counted": strategy.holds_outputs(model),
    }


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, spec: EvalSpec
) -> tuple[dict, torch.Tensor]:
    """Exact evaluation of ``model`` (as the strategy gives it to evaluate):
    every sample once, sums reduced over all processes.

    Returns loss (mean), top1 and topk (percent) and the number of samples,
    and the confusion matrix (on the CPU).
    """
    model.eval()
    device, normalize = spec.device, spec.normalize
    sums = MetricSums(device, spec.topk)
    confusion = ConfusionMatrix(device, spec.num_classes)
    iters = min(len(loader), spec.max_iters or len(loader))
    # Forward passes this rank must add on empty batches to match the others.
    missing = du.all_reduce_max_int(iters) - iters if spec.collective else 0
    live = live_console()
    for it, (images, targets) in enumerate(loader):
        if it == iters:
            break
        images = normalize(images)
        targets = targets.to(device, non_blocking=True)
        with autocast(device, spec.amp_dtype):
            logits = tta_logits(model, images, spec.tta, spec.crop)
            if spec.counted:
                loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        if spec.counted:
            sums.update(loss_sum, logits, targets)
            confusion.update(logits, targets)
        if live:
            bar = progress_bar(it + 1, iters)
            set_status(f"val {bar} {it + 1}/{iters}", force=it == 0)
        elif (it + 1) % spec.print_freq == 0 and it + 1 < iters:
            logger.info("eval it %d/%d", it + 1, iters)
    if missing:  # a sharded forward is a collective: run as often as the rest
        empty = normalize(empty_batch(loader.dataset[0][0]))
        for _ in range(missing):
            with autocast(device, spec.amp_dtype):
                model(empty)
    end_status(keep=False)
    return sums.reduce(), confusion.reduce()


def recompute_bn(cfg: CfgNode, state: TrainState, loader: DataLoader) -> None:
    """Precise BN over the first TRAIN.PRECISE_BN batches of the epoch just
    trained (the same batches after a resume)."""
    loader.sampler.set_epoch(state.progress.epoch - 1)
    batches = itertools.islice(loader, cfg.TRAIN.PRECISE_BN)
    images = (state.normalize(batch[0]) for batch in batches)
    with autocast(state.device, state.amp_dtype):
        plain = state.strategy.plain_model(state.model)
        count = recompute_bn_statistics(plain, images)
    if count:  # 0: no BatchNorm layers
        world = du.get_world_size()
        logger.info("precise BN: statistics of %d batches x %d processes", count, world)


def evaluate_epoch(
    cfg: CfgNode,
    state: TrainState,
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
    strategy = state.strategy
    memory = PeakMemory(strategy.devices(state.model))
    memory.reset()  # the evaluation's own peak (precise BN included)
    if cfg.TRAIN.PRECISE_BN:
        recompute_bn(cfg, state, train_loader)
    spec = EvalSpec.of(cfg, state.device, state.normalize, state.amp_dtype,
                       **strategy_eval(strategy, state.model))  # fmt: skip
    stats, confusion = evaluate(strategy.eval_model(state.model), val_loader, spec)
    stats["train_samples"] = trained
    eval_peak = memory.read()
    peaks = {"train": train_peak or eval_peak, "eval": eval_peak}
    keep_best(cfg, state, stats, confusion, ema, peaks)
    return stats


def keep_best(
    cfg: CfgNode,
    state: TrainState,
    stats: dict,
    confusion: torch.Tensor,
    ema: bool = False,
    peaks: dict[str, list[float]] | None = None,
) -> None:
    """Log an evaluation after epoch ``progress.epoch`` and save the weights
    evaluated when they score best so far.

    ``ema``: of the EMA weights, which the model holds: "val_ema" records,
    best_ema.pth.  ``peaks``: this rank's peak memory (MiB) per device in the
    epoch's training (``"train"``) and in this evaluation (``"eval"``); None:
    the peak so far for both.
    """
    progress, epoch = state.progress, state.progress.epoch
    # Before anything counts as best: the model holds the weights evaluated
    # (the EMA's with ``ema``), whose scores mean nothing if they are not finite.
    kind = "EMA weights (MODEL.EMA)" if ema else "weights"
    plain = state.strategy.plain_model(state.model)
    if not all_finite(module_tensors(plain)):
        raise NonFiniteError(
            f"the {kind} evaluated after epoch {epoch} hold nan or inf; they were "
            "not saved and do not count as best; " + NONFINITE_ADVICE
        )
    best = progress.best_ema_top1 if ema else progress.best_top1
    is_best, best = stats["top1"] > best, max(best, stats["top1"])
    if ema:
        progress.best_ema_top1 = best
    else:
        progress.best_top1 = best
    if peaks is None:
        now = PeakMemory(state.strategy.devices(state.model)).read()
        peaks = {"train": now, "eval": now}
    split = "val_ema" if ema else "val"
    log_evaluation(cfg, state, stats, confusion, split, best, peaks)
    if is_best:
        name = cp.BEST_EMA_WEIGHTS if ema else cp.BEST_WEIGHTS
        save_best_weights(cfg, state, stats["top1"], name)


def weights_to_evaluate(cfg: CfgNode) -> str:
    """MODEL.WEIGHTS, else the run's best weights in OUT_DIR."""
    if cfg.MODEL.WEIGHTS:
        return cfg.MODEL.WEIGHTS
    best = os.path.join(cfg.OUT_DIR, cp.BEST_WEIGHTS)
    if os.path.isfile(best):
        return best
    raise FileNotFoundError(
        "nothing to evaluate: set MODEL.WEIGHTS or train into OUT_DIR first "
        f"({best} is missing)"
    )


def evaluate_checkpoint(cfg: CfgNode) -> dict:
    """Evaluate MODEL.WEIGHTS (or OUT_DIR/best.pth) on the validation set.

    Rank 0 also writes the confusion matrix (CSV, PNG) and the per-class
    accuracy (CSV) to OUT_DIR.  Returns the metrics, the confusion matrix,
    the class names and the paths written.
    """
    with (
        run_context(cfg) as (info, device),
        Watchdog(cfg.DATA.TIMEOUT, info.rank) as watchdog,
    ):
        path = weights_to_evaluate(cfg)
        val_set = build_dataset(cfg, train=False)
        model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
        cp.load_model_weights(model, cp.load_file(path), path)
        model.to(device)
        loader = build_test_loader(cfg, val_set, info.rank, info.world_size, device)
        loader = watchdog.watch(loader, "eval")
        amp_dtype, _ = resolve_precision(cfg.TRAIN.MIXED_PRECISION, device)
        spec = EvalSpec.of(cfg, device, build_normalizer(cfg, device), amp_dtype)
        stats, confusion = evaluate(model, loader, spec)
        logger.info(
            "eval %s  loss %.4f  top1 %.2f  top%d %.2f  samples %d",
            path, stats["loss"], stats["top1"], spec.topk, stats["topk"],
            stats["samples"],
        )  # fmt: skip
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
        return {**stats, "topk_k": spec.topk, "weights": path, "files": files}
