"""Exact evaluation: every validation sample counted once over all ranks.

:func:`evaluate` runs a model over a loader; :func:`evaluate_epoch` is the
evaluation after each training epoch (precise BN first, the peak memory).
Evaluation measures and writes nothing: the engine logs what it measured and
keeps the best weights afterwards (:mod:`distribuuuu.engine.best`).
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.data import empty_batch
from distribuuuu.data.spec import Loader
from distribuuuu.dist import group as du
from distribuuuu.engine.sigmoid_losses import SigmoidLoss, score_loss_sum
from distribuuuu.engine.state import TrainState
from distribuuuu.engine.tta import tta_logits
from distribuuuu.logger import end_status, live_console, set_status
from distribuuuu.models.syncbn import recompute_bn_statistics
from distribuuuu.reporting.meters import (
    ConfusionMatrix,
    MetricSums,
    PeakMemory,
    progress_bar,
)
from distribuuuu.reporting.multilabel import LabelScores
from distribuuuu.strategies.precision import autocast

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
    loss: SigmoidLoss | None = None  # MODEL.LOSS bce / asl; None: ce
    multi_label: bool = False  # label sets: mAP and F1 instead of top-k
    threshold: float = 0.5  # TEST.THRESHOLD: a class is predicted at or above


class LabelCounts:
    """Single-label evaluation's sums: loss, top-1 / top-k hits, samples and
    the confusion matrix (reduced over all ranks when read)."""

    def __init__(self, spec: EvalSpec):
        self.sums = MetricSums(spec.device, spec.topk)
        self.confusion = ConfusionMatrix(spec.device, spec.num_classes)

    def update(self, loss_sum, logits: torch.Tensor, targets: torch.Tensor):
        """Add a batch (``loss_sum``: its summed loss)."""
        self.sums.update(loss_sum, logits, targets)
        self.confusion.update(logits, targets)

    def reduce(self) -> tuple[dict, torch.Tensor]:
        """Metrics and confusion matrix over all ranks (a collective)."""
        return self.sums.reduce(), self.confusion.reduce()


class MultiLabelCounts:
    """Multi-label evaluation: :class:`LabelScores` of the sigmoid
    probabilities; no confusion matrix (an empty one stands for it)."""

    def __init__(self, spec: EvalSpec):
        self.scores = LabelScores(spec.device, spec.num_classes, spec.threshold)

    def update(self, loss_sum, logits: torch.Tensor, targets: torch.Tensor):
        """Add a batch (``loss_sum``: its summed loss)."""
        self.scores.update(loss_sum, torch.sigmoid(logits.float()), targets)

    def reduce(self) -> tuple[dict, torch.Tensor]:
        """Metrics over all ranks (a collective) and an empty matrix."""
        return self.scores.reduce(), torch.zeros(0, 0, dtype=torch.int64)


def strategy_eval(strategy, model: nn.Module) -> dict:
    """The EvalSpec fields that ``strategy`` decides for its ``model``."""
    return {
        "collective": strategy.forward_is_collective(model),
        "counted": strategy.holds_outputs(model),
    }


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Loader, spec: EvalSpec
) -> tuple[dict, torch.Tensor]:
    """Exact evaluation of ``model`` (as the strategy gives it to evaluate):
    every sample once, sums reduced over all processes.

    Returns loss (mean), top1 and topk (percent) and the number of samples,
    and the confusion matrix (on the CPU); for multi-label data loss, map,
    f1_micro, f1_macro, per_class_ap (percent) and samples, and an empty
    matrix.  The loss is the run's plain loss (MODEL.LOSS, unsmoothed).
    """
    model.eval()
    device, normalize = spec.device, spec.normalize
    counts = MultiLabelCounts(spec) if spec.multi_label else LabelCounts(spec)
    sigmoid = spec.loss is not None
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
            logits = tta_logits(model, images, spec.tta, spec.crop, sigmoid)
            if spec.counted:
                loss_sum = score_loss_sum(logits, targets, spec.loss)
        if spec.counted:
            counts.update(loss_sum, logits, targets)
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
    return counts.reduce()


def recompute_bn(state: TrainState, loader: Loader, batches: int) -> None:
    """Precise BN over the first ``batches`` batches (TRAIN.PRECISE_BN) of the
    epoch just trained (the same batches after a resume)."""
    loader.sampler.set_epoch(state.progress.epoch - 1)
    images = (state.normalize(batch[0]) for batch in itertools.islice(loader, batches))
    with autocast(state.device, state.amp_dtype):
        plain = state.strategy.plain_model(state.model)
        count = recompute_bn_statistics(plain, images)
    if count:  # 0: no BatchNorm layers
        world = du.get_world_size()
        logger.info("precise BN: statistics of %d batches x %d processes", count, world)


def evaluate_epoch(
    spec: EvalSpec,
    state: TrainState,
    train_loader: Loader,
    val_loader: Loader,
    *,
    precise_bn: int = 0,
    train_peak: list[float] | None = None,
) -> tuple[dict, torch.Tensor, dict[str, list[float]]]:
    """Evaluate the model after an epoch (precise BN over ``precise_bn``
    batches of ``train_loader`` first, if asked): its metrics, confusion
    matrix and this rank's peak memory per device (MiB) in the epoch's
    training (``"train"``: ``train_peak``, else the evaluation's) and in the
    evaluation (``"eval"``)."""
    strategy = state.strategy
    memory = PeakMemory(strategy.devices(state.model))
    memory.reset()  # the evaluation's own peak (precise BN included)
    if precise_bn:
        recompute_bn(state, train_loader, precise_bn)
    stats, confusion = evaluate(strategy.eval_model(state.model), val_loader, spec)
    eval_peak = memory.read()
    return stats, confusion, {"train": train_peak or eval_peak, "eval": eval_peak}


def weights_to_evaluate(weights: str, out_dir: str) -> str:
    """``weights`` (MODEL.WEIGHTS), else the run's best weights in ``out_dir``."""
    if weights:
        return weights
    best = os.path.join(out_dir, cp.BEST_WEIGHTS)
    if os.path.isfile(best):
        return best
    raise FileNotFoundError(
        "nothing to evaluate: set MODEL.WEIGHTS or train into OUT_DIR first "
        f"({best} is missing)"
    )
