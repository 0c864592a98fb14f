"""What multi-label evaluations report: mAP and F1 on the log line, the AP of
each class in the records, tensorboard and ``--eval-only``'s CSV.

Single-label evaluations keep :mod:`distribuuuu.engine.run_log`'s top-k and
confusion matrix; these helpers are what differs for label sets.
"""

from __future__ import annotations

import csv
import logging
import os

import numpy as np

from distribuuuu.dist import group as du
from distribuuuu.engine.state import TrainState
from distribuuuu.reporting import reports
from distribuuuu.reporting.multilabel import MAP
from distribuuuu.reporting.writer import MetricsWriter

logger = logging.getLogger(__name__)

PER_CLASS_AP_CSV = "per_class_ap.csv"


def is_label_set_evaluation(stats: dict) -> bool:
    """Whether ``stats`` are a multi-label evaluation's (mAP, F1)."""
    return MAP in stats


def metrics_text(stats: dict, topk: int) -> str:
    """The metrics of an evaluation's log line: top-1 and top-k, or mAP and
    the micro and macro F1."""
    if is_label_set_evaluation(stats):
        return (
            f"map {stats[MAP]:.2f}  f1 micro {stats['f1_micro']:.2f}  "
            f"macro {stats['f1_macro']:.2f}"
        )
    return f"top1 {stats['top1']:.2f}  top{topk} {stats['topk']:.2f}"


def eval_scalars(stats: dict, split: str) -> dict:
    """The tensorboard scalars of an evaluation's metrics."""
    keys: tuple[str, ...] = ("loss", "top1", "topk")
    if is_label_set_evaluation(stats):
        keys = ("loss", MAP, "f1_micro", "f1_macro")
    return {f"{split}/{key}": stats[key] for key in keys}


def log_per_class_ap(state: TrainState, stats: dict, split: str, scalars: dict):
    """The AP of each class: a histogram, and with few enough classes a
    scalar per class (``{split}_per_class_ap/<name>``, added to ``scalars``)."""
    per_class = stats["per_class_ap"]
    if len(per_class) <= reports.MAX_PLOTTED_CLASSES:
        for name, value in zip(state.classes, per_class):
            scalars[f"{split}_per_class_ap/{name}"] = value
    if per_class:
        histogram = np.array(per_class)
        state.writer.histogram(f"{split}/per_class_ap", histogram, state.progress.epoch)


def log_label_set_checkpoint(
    out_dir: str, weights: str, stats: dict, classes: list[str], world_size: int
) -> list[str]:
    """Report ``--eval-only``'s multi-label evaluation of ``weights``: a log
    line, the AP of each class (rank 0 writes it as a CSV to ``out_dir``) and
    a metrics.jsonl record; the paths written."""
    logger.info(
        "eval %s  loss %.4f  %s  samples %d",
        weights,
        stats["loss"],
        metrics_text(stats, 0),
        stats["samples"],
    )
    rows = list(zip(classes, stats["per_class_ap"]))
    table = "\n".join(f"{name:<16}  {value:6.2f}" for name, value in rows)
    logger.info("per-class AP:\n%s", table)
    files = []
    if du.is_main_process():
        path = os.path.join(out_dir, PER_CLASS_AP_CSV)
        with open(path, "w", newline="", encoding="utf-8") as f:
            table_writer = csv.writer(f)
            table_writer.writerow(["class", "ap"])
            table_writer.writerows(rows)
        files.append(path)
        logger.info("wrote %s", path)
    writer = MetricsWriter(out_dir, enabled=du.is_main_process())
    record = {"split": "val", "eval_only": True, "weights": weights}
    record.update(world_size=world_size, **stats)
    writer.write(record)
    writer.close()
    return files
