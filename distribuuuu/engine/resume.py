"""Saving a run and picking it up again: training checkpoints, best weights,
auto-resume from OUT_DIR and MODEL.WEIGHTS.

The keys of what is saved are named in :mod:`distribuuuu.checkpoint.format`; the files'
atomic writes, ``last`` pointer and keep-N live in :mod:`distribuuuu.checkpoint`;
the strategy saves and loads its model and optimizer state.
"""

from __future__ import annotations

import logging
import os

from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import (
    SavedRun,
    best_weights,
    capture_rng_state,
    holds_optimizer,
)
from distribuuuu.dist import group as du
from distribuuuu.engine.numerics import check_weights_finite, module_tensors
from distribuuuu.engine.state import Progress, TrainState
from distribuuuu.models.ema import ModelEma
from distribuuuu.strategies import Strategy

logger = logging.getLogger(__name__)


def save_training_checkpoint(
    cfg: CfgNode, state: TrainState, score: float | None = None
) -> None:
    """Gather every rank's RNG state; rank 0 writes the checkpoint of the run
    (``score``: CHECKPOINT.BEST_METRIC of the evaluation just before it).

    Every rank returns only once the checkpoint is complete (file renamed into
    place, ``last`` moved): a rank that then exits, stopped by a signal, must
    not get the job step ended (``srun --kill-on-bad-exit``) while rank 0 still
    writes.  When rank 0's save fails, every rank raises.
    """
    progress, plan, strategy = state.progress, state.plan, state.strategy
    step = progress.consumed // plan.global_batch
    where = f"epoch {progress.epoch + 1}, iteration {step}"
    if step == 0:
        where = f"the end of epoch {progress.epoch}"
    ema = [] if state.ema is None else list(state.ema.tensors().values())
    plain = strategy.plain_model(state.model)
    check_weights_finite([*module_tensors(plain), *ema], where)
    name = cp.checkpoint_name(progress.epoch, step)
    weights = strategy.save_weights(state.model, state.optimizer, state.ema,
                                    cfg.OUT_DIR, name)  # fmt: skip
    rng = du.all_gather_object(capture_rng_state(strategy.devices(state.model)))
    saved = state.state_dict(weights, rng, arch=cfg.MODEL.ARCH, config_dump=cfg.dump())
    error = None
    if du.is_main_process():
        try:
            keys = cfg.CHECKPOINT
            retention = cp.Retention(
                keys.KEEP, keys.KEEP_BEST, keys.BEST_METRIC == "loss"
            )
            path = cp.save_checkpoint(
                cfg.OUT_DIR, progress.epoch, saved, retention, step, score
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


def save_best_weights(cfg: CfgNode, state: TrainState, top1: float, name: str):
    """Write the weights the model holds as ``OUT_DIR/name`` (rank 0; gathering
    them is a collective where they are spread)."""
    whole = state.strategy.model_state_dict(state.model)
    if du.is_main_process():
        epoch = state.progress.epoch
        weights = best_weights(
            whole,
            epoch=epoch,
            top1=top1,
            classes=state.classes,
            arch=cfg.MODEL.ARCH,
            config_dump=cfg.dump(),
        )
        path = os.path.join(cfg.OUT_DIR, name)
        cp.save_weights(path, weights)
        state.writer.wrote_file(path)  # what UPLOAD_BEST may upload


def load_weights(cfg: CfgNode, strategy: Strategy, model: nn.Module, optimizer) -> str:
    """Load MODEL.WEIGHTS (and its optimizer with TRAIN.LOAD_OPT); say what, in words.

    With MODEL.FINETUNE a classifier head of another size is skipped and keeps
    its fresh initialisation; the optimizer state then is not loaded, since
    its head entries would not fit (and it belongs to another task).
    """
    path = cfg.MODEL.WEIGHTS
    saved = cp.load_full(path)
    classes = cfg.MODEL.NUM_CLASSES if cfg.MODEL.FINETUNE else None
    skipped = strategy.load_model_weights(model, saved, path, classes)
    has_optimizer = holds_optimizer(saved)
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
        optimizer_state = SavedRun(path, saved).optimizer_state
        strategy.load_optimizer_state(model, optimizer, optimizer_state)
        return f"weights from {path} and its optimizer"
    return f"weights from {path}"


def agreed_resume_checkpoint(out_dir: str) -> SavedRun | None:
    """The checkpoint to resume from, chosen by rank 0 (which checks the shard
    checksums of a sharded one) and loaded by every rank."""
    found = None
    if du.is_main_process():
        found = cp.find_resume_checkpoint(out_dir, checksums=True)
    path = du.broadcast_object(None if found is None else found[0])
    if path is None:
        return None
    return SavedRun(*found) if found is not None else SavedRun(path, cp.load_file(path))


def resume_or_load(
    cfg: CfgNode,
    strategy: Strategy,
    model: nn.Module,
    optimizer,
    scaler,
    ema: ModelEma | None = None,
) -> tuple[Progress, SavedRun | None, str]:
    """Progress to continue from, the checkpoint resumed (None when new) and
    what the run starts from, in words.  Every rank loads the same file, so
    the replicas stay identical."""
    saved = agreed_resume_checkpoint(cfg.OUT_DIR) if cfg.TRAIN.AUTO_RESUME else None
    if saved is not None:
        restored = strategy.load_weights(model, optimizer, saved, ema)
        if ema is not None and not restored:
            ema.reset()  # an EMA the checkpoint lacks starts from its weights
        if saved.scaler_state:
            scaler.load_state_dict(saved.scaler_state)
        progress = Progress(**saved.progress)
        start = (
            f"resumed from {saved.path} (epoch {progress.epoch} done, "
            f"{progress.consumed} samples into the next)"
        )
        logger.info("%s", start)
        return progress, saved, start
    if cfg.MODEL.WEIGHTS:
        start = load_weights(cfg, strategy, model, optimizer)
        if ema is not None:
            ema.reset()
        logger.info("loaded %s", start)
        return Progress(), None, start
    pretrained = " (ImageNet-pretrained weights)" * cfg.MODEL.PRETRAINED
    return Progress(), None, "a new run" + pretrained
