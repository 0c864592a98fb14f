"""What a run reports while it trains and evaluates: the log lines, the live
status line, the ``metrics.jsonl`` records and the tensorboard scalars, images
and histograms (rank 0 writes; the numbers are reduced over all ranks)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torchvision

from distribuuuu.data import stack_images
from distribuuuu.data.spec import SizeRamp
from distribuuuu.dist import group as du
from distribuuuu.engine.label_set_log import (
    eval_scalars,
    is_label_set_evaluation,
    log_label_set_checkpoint,
    log_per_class_ap,
    metrics_text,
)
from distribuuuu.engine.numerics import all_finite, module_tensors, nonfinite_loss
from distribuuuu.engine.state import TrainState
from distribuuuu.logger import STATUS_LINE, set_status
from distribuuuu.plan.flops import FLOP_KEYS, format_rate
from distribuuuu.reporting import reports
from distribuuuu.reporting.meters import (
    MetricSums,
    format_eta,
    per_class_top1,
    progress_bar,
)
from distribuuuu.reporting.stragglers import COMPUTE, DATA
from distribuuuu.reporting.writer import MetricsWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogSpec:
    """What the run's log lines show and watch besides the numbers measured."""

    max_epoch: int  # OPTIM.MAX_EPOCH
    topk: int  # k of the top-k accuracy
    single_process_img_per_s: float = 0.0  # TRAIN.SINGLE_PROCESS_IMG_PER_S
    data_bound_share: float = 0.0  # TRAIN.DATA_BOUND_SHARE; 0: no warning
    workers: int = 0  # TRAIN.WORKERS, named in the data-bound warning
    decoder: str = ""  # DATA.DECODER, named in the data-bound warning
    grad_spike: float = 0.0  # LOG.GRAD_SPIKE; 0: no warning
    straggler_ratio: float = 0.0  # LOG.STRAGGLER_RATIO; 0: no slow-rank warning
    ramp: SizeRamp | None = None  # TRAIN.PROGRESSIVE: each epoch's crop; None: off


class TrainStatus:
    """The live progress line of a training epoch (interactive terminals only).

    Loss and top-1 are those of the last ``TRAIN.PRINT_FREQ`` window over all
    ranks (updated at print steps); the rest is known on the host every step,
    so the bar costs no device synchronization.
    """

    def __init__(self, spec: LogSpec, state: TrainState, first: int, total: int):
        self.spec, self.state, self.first, self.total = spec, state, first, total
        self.start = time.perf_counter()
        self.window: dict = {}

    def show(self, step: int, lr: float) -> None:
        """Redraw the line after optimizer step ``step`` (0-based)."""
        done = step + 1
        elapsed = time.perf_counter() - self.start
        img_per_s = (done - self.first) * self.state.plan.global_batch / elapsed
        metrics = "loss -  top1 -"
        if self.window:
            metrics = f"loss {self.window['loss']:.4f}  top1 {self.window['top1']:.2f}"
        eta = format_eta(self.state.clock.eta())
        set_status(
            f"ep {self.state.progress.epoch + 1}/{self.spec.max_epoch} "
            f"{progress_bar(done, self.total)} {done}/{self.total}  {metrics}  "
            f"lr {lr:.5f}  {img_per_s:.0f} img/s  eta {eta}",
            force=done == self.total,
        )


def log_crop_size(spec: LogSpec, epoch: int) -> None:
    """Log the training crop of ``epoch`` (from 0) under TRAIN.PROGRESSIVE."""
    if spec.ramp is not None:
        size = spec.ramp.size(epoch)
        logger.info(
            "train ep %d/%d: crop %d px (TRAIN.PROGRESSIVE)",
            epoch + 1,
            spec.max_epoch,
            size,
        )


def crop_record(spec: LogSpec, epoch: int) -> dict:
    """The training crop of ``epoch`` (from 0) for the metrics file, under
    TRAIN.PROGRESSIVE: ``{"im_size": pixels}``; nothing otherwise."""
    return {} if spec.ramp is None else {"im_size": spec.ramp.size(epoch)}


def log_train_window(
    spec: LogSpec,
    state: TrainState,
    meter: MetricSums,
    *,
    step: int,
    steps: int,
    lr: float,
    elapsed: float,
    data_time: float,
    window_steps: int,
) -> dict:
    """Reduce a print window's metrics over all ranks, log them (rank 0 writes)
    and return them; stop a run whose loss is no longer finite.

    Args:
        step: the window's last optimizer step (0-based) of the epoch's ``steps``.
        lr: the learning rate of that step.
        elapsed: the window's seconds.
        data_time: its seconds spent waiting for the loader.
        window_steps: its optimizer steps.
    """
    epoch = state.progress.epoch
    data_time /= window_steps  # per step
    stats = meter.reduce()
    if state.grad_norm is not None:  # the window's last step's
        stats["grad_norm"] = float(state.grad_norm)
        watch_grad_norm(spec, state, stats["grad_norm"], step)
    speed = throughput(spec, state.plan.world_size, stats["samples"], elapsed)
    speed.update(window_flops(state, window_steps, elapsed))
    step_time = elapsed * state.plan.global_batch / max(stats["samples"], 1)
    watch_data_time(spec, state, data_time, step_time)
    logger.info(
        "train ep %d/%d it %d/%d  loss %.4f  top1 %.2f  top%d %.2f  lr %.5f  "
        "img/s %.0f%s%s  data %.1fms%s  eta %s",
        epoch + 1,
        spec.max_epoch,
        step + 1,
        steps,
        stats["loss"],
        stats["top1"],
        meter.topk,
        stats["topk"],
        lr,
        speed["img_per_s"],
        format_scaling(speed),
        format_rate(speed),
        1000 * data_time,
        f"  grad norm {stats['grad_norm']:.3g}" if "grad_norm" in stats else "",
        format_eta(state.clock.eta()),
        extra={STATUS_LINE: True},
    )
    record = {"split": "train", "epoch": epoch + 1, "iter": step + 1, "lr": lr}
    record.update(speed, data_ms=1000 * data_time, **stats, **crop_record(spec, epoch))
    scalars = train_scalars(stats, speed, lr, data_ms=1000 * data_time)
    state.writer.write(record, scalars, epoch * steps + step + 1)
    if not math.isfinite(stats["loss"]):
        stop_on_nonfinite_loss(state, stats, step)
    return stats


def train_scalars(stats: dict, speed: dict, lr: float, data_ms: float) -> dict:
    """The tensorboard scalars of a training window: its metrics, learning
    rate, throughput (TFLOP/s and MFU where known) and data wait."""
    return {
        "train/loss": stats["loss"],
        "train/top1": stats["top1"],
        "train/lr": lr,
        "train/img_per_s": speed["img_per_s"],
        "train/img_per_s_per_rank": speed["img_per_s_per_rank"],
        "train/data_ms": data_ms,
        **({"train/grad_norm": stats["grad_norm"]} if "grad_norm" in stats else {}),
        **{f"train/{key}": speed[key] for key in FLOP_KEYS if key in speed},
    }


def window_flops(state: TrainState, window_steps: int, elapsed: float) -> dict:
    """The TFLOP/s per device of a window of ``window_steps`` optimizer steps
    (at the epoch's crop), and its MFU where the device's peak is known ({}
    without a FLOP count)."""
    if state.flops is None:
        return {}
    images = window_steps * state.plan.global_batch
    return state.flops.of_window(images, elapsed, state.progress.epoch)


def stop_on_nonfinite_loss(state: TrainState, stats: dict, step: int) -> None:
    """The window's loss is not finite (after 0-based ``step``): raise
    NonFiniteError, unless a GradScaler skipped those steps and the weights
    are finite (see :func:`distribuuuu.engine.numerics.nonfinite_loss`)."""
    plain = state.strategy.plain_model(state.model)
    window = max(stats["samples"] // state.plan.global_batch, 1)
    epoch = state.progress.epoch + 1
    nonfinite_loss(
        stats["loss"],
        scaled=state.scaler.is_enabled(),
        weights_finite=lambda: all_finite(module_tensors(plain)),
        epoch=epoch,
        step=step + 1,
        window=window,
    )


def throughput(spec: LogSpec, world_size: int, samples: int, elapsed: float) -> dict:
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
    alone = spec.single_process_img_per_s
    if world_size > 1 and alone > 0:
        speed["scaling_efficiency"] = img_per_s / (world_size * alone)
    return speed


def format_scaling(speed: dict) -> str:
    """`` (N/rank, eff. E%)`` for the log line; empty for one process."""
    if speed["world_size"] == 1:
        return ""
    text = f" ({speed['img_per_s_per_rank']:.0f}/rank"
    if "scaling_efficiency" in speed:
        text += f", scaling eff. {100 * speed['scaling_efficiency']:.0f}%"
    return text + ")"


def watch_data_time(spec: LogSpec, state: TrainState, data_s: float, step_s: float):
    """Rank 0 warns once when the steps wait for data (TRAIN.DATA_BOUND_SHARE)."""
    share = spec.data_bound_share
    if state.data_watch.update(data_s, step_s, share) and du.is_main_process():
        logger.warning(
            "data-bound: waiting for data took %.0f%% of the step time (more than "
            "TRAIN.DATA_BOUND_SHARE %.2f) in %d logged windows in a row; feed the "
            "model faster: raise TRAIN.WORKERS (now %d; about one per CPU core "
            "per process), keep DATA.DECODER fused (now %s), or store the "
            "images pre-resized (shorter side about 1.15 x TRAIN.IM_SIZE)",
            100 * data_s / max(step_s, 1e-9),
            share,
            state.data_watch.windows,
            spec.workers,
            spec.decoder,
        )


def watch_grad_norm(spec: LogSpec, state: TrainState, norm: float, step: int):
    """Rank 0 warns once when the gradient norm spikes (LOG.GRAD_SPIKE)."""
    median = state.spike_watch.update(norm, spec.grad_spike)
    if median is not None and du.is_main_process():
        logger.warning(
            "gradient norm spike: %.4g at epoch %d step %d, %.0fx the median %.4g "
            "of the norms logged before it (LOG.GRAD_SPIKE %g): the run may be "
            "diverging; lower the learning rate, set OPTIM.CLIP_GRAD_NORM, or "
            "warm up longer (OPTIM.WARMUP_EPOCHS)",
            norm,
            state.progress.epoch + 1,
            step + 1,
            norm / max(median, 1e-30),
            median,
            spec.grad_spike,
        )


def watch_slow_ranks(spec: LogSpec, state: TrainState) -> None:
    """Rank 0 warns, once per rank and cause, when the timings the last stop
    check carried show a rank slower than the median (LOG.STRAGGLER_RATIO)."""
    rows = state.slow_ranks.rows
    found = state.slow_ranks.update(spec.straggler_ratio)
    if found is None or rows is None or not du.is_main_process():
        return
    logger.warning(
        "slow rank: rank %d of %d takes %.1f ms per step, %.2f x the median "
        "rank's %.1f ms (LOG.STRAGGLER_RATIO %g), not counting its waits for "
        "the others: its %s is slow (%.1f ms per step, the median rank %.1f "
        "ms); every rank waits for it in the gradient sync; %s",
        found.rank,
        len(rows),
        1000 * found.step,
        found.step / max(found.median_step, 1e-9),
        1000 * found.median_step,
        spec.straggler_ratio,
        "wait for data" if found.cause == DATA else "compute",
        1000 * found.part,
        1000 * found.median_part,
        SLOW_RANK_ADVICE[found.cause],
    )


# What to look at on a rank that holds the others back, by cause.
SLOW_RANK_ADVICE = {
    DATA: "feed it faster (its node's TRAIN.WORKERS, CPU load, disk or network)",
    COMPUTE: "look at its device (clocks, temperature, other processes on it)",
}


def gather_peaks(peaks: dict[str, list[float]]) -> tuple[list, list, list]:
    """Every rank's peak memory (MiB) per device: training, evaluation, and the
    larger of the two (one value per rank, or per GPU of a DataParallel)."""
    ranks = du.all_gather_object(peaks)
    train_peak = [mb for rank in ranks for mb in rank["train"]]
    eval_peak = [mb for rank in ranks for mb in rank["eval"]]
    return train_peak, eval_peak, [max(p) for p in zip(train_peak, eval_peak)]


def log_evaluation(
    spec: LogSpec,
    state: TrainState,
    stats: dict,
    confusion: torch.Tensor,
    *,
    split: str,
    best: float,
    peaks: dict[str, list[float]],
) -> None:
    """Log the evaluation after epoch ``progress.epoch`` (1-based): a line, a
    record, scalars, the confusion matrix and per-class histogram (for label
    sets mAP, F1 and the AP of each class instead).

    ``split``: "val", or "val_ema" for the EMA's weights (no memory scalars);
    ``best``: the best top-1 so far; ``peaks``: this rank's peak memory (MiB)
    per device in the epoch's training (``"train"``) and evaluation (``"eval"``).
    """
    epoch = state.progress.epoch
    train_peak, eval_peak, memory = gather_peaks(peaks)
    logger.info(
        "%s ep %d/%d  loss %.4f  %s  samples %d  best %.2f  "
        "peak memory train %.0f / eval %.0f MiB",
        split,
        epoch,
        spec.max_epoch,
        stats["loss"],
        metrics_text(stats, spec.topk),
        stats["samples"],
        best,
        max(train_peak),
        max(eval_peak),
    )
    record = {"split": split, "epoch": epoch, "world_size": state.plan.world_size}
    record.update(
        stats,
        peak_mem_mb=memory,
        train_peak_mem_mb=train_peak,
        eval_peak_mem_mb=eval_peak,
    )
    scalars = eval_scalars(stats, split)
    if split == "val":  # the EMA's evaluation is logged in its record only
        scalars["memory/peak_mb"] = max(memory)
        scalars["memory/train_peak_mb"] = max(train_peak)
        scalars["memory/eval_peak_mb"] = max(eval_peak)
    if is_label_set_evaluation(stats):
        log_per_class_ap(state, stats, split, scalars)
    else:
        record["per_class_top1"] = per_class = per_class_top1(confusion)
        log_per_class(state, confusion, per_class, split, scalars)
    state.writer.write(record, scalars, epoch)


def log_per_class(
    state: TrainState,
    confusion: torch.Tensor,
    per_class: list[float | None],
    split: str,
    scalars: dict,
) -> None:
    """Per-class top-1 of an evaluation: a histogram, and with few enough
    classes a scalar per class (added to ``scalars``) and the confusion matrix."""
    epoch = state.progress.epoch
    if len(per_class) <= reports.MAX_PLOTTED_CLASSES:
        for name, top1 in zip(state.classes, per_class):
            if top1 is not None:
                scalars[f"{split}_per_class/{name}"] = top1
        image = reports.confusion_image(confusion, state.classes)
        state.writer.image(f"{split}/confusion_matrix", image, epoch)
    measured = np.array([top1 for top1 in per_class if top1 is not None])
    if measured.size:
        state.writer.histogram(f"{split}/per_class_top1", measured, epoch)


def log_checkpoint_evaluation(
    out_dir: str,
    weights: str,
    stats: dict,
    confusion: torch.Tensor,
    *,
    classes: list[str],
    topk: int,
    world_size: int,
) -> list[str]:
    """Report ``--eval-only``'s evaluation of ``weights``: a log line, the
    per-class top-1 (rank 0 writes it and the confusion matrix to
    ``out_dir``) and a metrics.jsonl record; the paths written.  Label sets:
    :func:`log_label_set_checkpoint`."""
    if is_label_set_evaluation(stats):
        return log_label_set_checkpoint(out_dir, weights, stats, classes, world_size)
    logger.info(
        "eval %s  loss %.4f  top1 %.2f  top%d %.2f  samples %d",
        weights,
        stats["loss"],
        stats["top1"],
        topk,
        stats["topk"],
        stats["samples"],
    )
    table = reports.format_per_class(confusion, classes)
    logger.info("per-class top-1:\n%s", table)
    files = []
    if du.is_main_process():
        files = reports.write_per_class(out_dir, confusion, classes)
        logger.info("wrote %s", ", ".join(files))
    writer = MetricsWriter(out_dir, enabled=du.is_main_process())
    record = {"split": "val", "eval_only": True, "weights": weights}
    record.update(world_size=world_size, **stats)
    record["per_class_top1"] = per_class_top1(confusion)
    writer.write(record)
    writer.close()
    return files


def log_training_images(writer: MetricsWriter, dataset, seed: int) -> None:
    """Log a grid of 16 augmented training images (spread over the data set),
    as the model sees them before normalisation."""
    indices = torch.linspace(0, len(dataset) - 1, min(16, len(dataset))).long()
    with torch.random.fork_rng(devices=[]):  # leave the run's RNG as it was
        torch.manual_seed(seed)
        images = stack_images([dataset[int(i)][0] for i in indices])
    grid = torchvision.utils.make_grid(images, nrow=8)
    pixels = grid.permute(1, 2, 0).numpy()
    writer.image("train/augmented_images", pixels)
