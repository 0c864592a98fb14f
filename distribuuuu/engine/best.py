"""The step after each evaluation: the best score so far and its weights.

Evaluation (:mod:`distribuuuu.engine.evaluation`) only measures; the epoch
loop then hands what it measured to :func:`keep_best`, which refuses
non-finite weights, counts the best top-1 (mAP for label sets), logs the
evaluation and writes the weights evaluated as ``best.pth`` (``best_ema.pth``
for the EMA's) when they score best so far.
"""

from __future__ import annotations

import os

import torch

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import best_weights
from distribuuuu.dist import group as du
from distribuuuu.engine.numerics import NONFINITE_ADVICE, all_finite, module_tensors
from distribuuuu.engine.resume import SaveSpec
from distribuuuu.engine.run_log import LogSpec, log_evaluation
from distribuuuu.engine.state import TrainState
from distribuuuu.errors import NonFiniteError
from distribuuuu.reporting.meters import PeakMemory
from distribuuuu.reporting.multilabel import headline_metric


def log_hparams(state: TrainState, params: dict, stats: dict) -> None:
    """The run's config (flat ``params``) beside its final scores, for
    tensorboard's HParams: the headline score (top1, or map for label sets),
    its best and the loss."""
    metric = headline_metric(stats)
    hparams = {key: value for key, value in params.items() if key != "OUT_DIR"}
    final = {
        f"hparam/best_{metric}": state.progress.best_top1,
        f"hparam/{metric}": stats[metric],
        "hparam/loss": stats["loss"],
    }
    if state.ema is not None:
        final[f"hparam/best_ema_{metric}"] = state.progress.best_ema_top1
    state.writer.hparams(hparams, final)


def keep_best(
    log: LogSpec,
    save: SaveSpec,
    state: TrainState,
    stats: dict,
    confusion: torch.Tensor,
    *,
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
    # best_top1 holds the best headline score: top-1, or mAP for label sets.
    metric = headline_metric(stats)
    best = progress.best_ema_top1 if ema else progress.best_top1
    is_best, best = stats[metric] > best, max(best, stats[metric])
    if ema:
        progress.best_ema_top1 = best
    else:
        progress.best_top1 = best
    if peaks is None:
        now = PeakMemory(state.strategy.devices(state.model)).read()
        peaks = {"train": now, "eval": now}
    split = "val_ema" if ema else "val"
    log_evaluation(log, state, stats, confusion, split=split, best=best, peaks=peaks)
    if is_best:
        name = cp.BEST_EMA_WEIGHTS if ema else cp.BEST_WEIGHTS
        save_best_weights(save, state, (metric, stats[metric]), name)


def save_best_weights(
    spec: SaveSpec, state: TrainState, score: tuple[str, float], name: str
):
    """Write the weights the model holds as ``OUT_DIR/name`` (rank 0; gathering
    them is a collective where they are spread) with their ``score``
    (metric, value)."""
    whole = state.strategy.model_state_dict(state.model)
    if du.is_main_process():
        weights = best_weights(
            whole,
            epoch=state.progress.epoch,
            score=score,
            classes=state.classes,
            arch=spec.arch,
            config_dump=spec.config_dump,
            loss=spec.loss,
        )
        path = os.path.join(spec.out_dir, name)
        cp.save_weights(path, weights)
        state.writer.wrote_file(path)  # what UPLOAD_BEST may upload
