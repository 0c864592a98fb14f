"""Saving a run and picking it up again: training checkpoints, auto-resume
from OUT_DIR and MODEL.WEIGHTS.

The keys of what is saved are named in :mod:`distribuuuu.checkpoint.format`; the files'
atomic writes, ``last`` pointer and keep-N live in :mod:`distribuuuu.checkpoint`;
the strategy saves and loads its model and optimizer state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import (
    SavedRun,
    capture_rng_state,
    holds_optimizer,
)
from distribuuuu.dist import group as du
from distribuuuu.engine.numerics import check_weights_finite, module_tensors
from distribuuuu.engine.state import Progress, TrainState
from distribuuuu.models.ema import ModelEma
from distribuuuu.strategies import Strategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveSpec:
    """Where a run saves (OUT_DIR), what every file carries besides the
    weights, and which checkpoints it keeps (CHECKPOINT.KEEP, KEEP_BEST)."""

    out_dir: str
    arch: str  # MODEL.ARCH
    config_dump: str  # the run's config as yaml text
    retention: cp.Retention = cp.Retention()
    loss: str = "ce"  # MODEL.LOSS, recorded in the best weights


@dataclass(frozen=True)
class ResumeSpec:
    """What a run starts from: its own last checkpoint in ``out_dir``
    (TRAIN.AUTO_RESUME), else MODEL.WEIGHTS, else fresh weights."""

    out_dir: str
    auto_resume: bool = True
    weights: str = ""  # MODEL.WEIGHTS; empty: none
    finetune: bool = False  # MODEL.FINETUNE: skip a head of another size
    num_classes: int = 0  # MODEL.NUM_CLASSES
    load_optimizer: bool = True  # TRAIN.LOAD_OPT
    pretrained: bool = False  # MODEL.PRETRAINED, said in the start-up report


def save_training_checkpoint(
    spec: SaveSpec,
    state: TrainState,
    writer: cp.CheckpointWriter,
    score: float | None = None,
) -> None:
    """Gather every rank's RNG state; ``writer`` writes the checkpoint of the
    run (``score``: CHECKPOINT.BEST_METRIC of the evaluation just before it),
    at once or in the background (see :class:`cp.CheckpointWriter`)."""
    started = time.perf_counter()
    progress, plan, strategy = state.progress, state.plan, state.strategy
    step = progress.consumed // plan.global_batch
    where = f"epoch {progress.epoch + 1}, iteration {step}"
    if step == 0:
        where = f"the end of epoch {progress.epoch}"
    ema = [] if state.ema is None else list(state.ema.tensors().values())
    plain = strategy.plain_model(state.model)
    check_weights_finite([*module_tensors(plain), *ema], where)
    name = cp.checkpoint_name(progress.epoch, step)
    weights = strategy.save_weights(
        state.model, state.optimizer, state.ema, writer, name
    )
    rng = du.all_gather_object(capture_rng_state(strategy.devices(state.model)))
    saved = state.state_dict(weights, rng, arch=spec.arch, config_dump=spec.config_dump)
    place = (progress.epoch, step)
    writer.save(place, saved, spec.retention, score, started)


def load_weights(
    spec: ResumeSpec, strategy: Strategy, model: nn.Module, optimizer
) -> str:
    """Load MODEL.WEIGHTS (and its optimizer with TRAIN.LOAD_OPT); say what, in words.

    With MODEL.FINETUNE a classifier head of another size is skipped and keeps
    its fresh initialisation; the optimizer state then is not loaded, since
    its head entries would not fit (and it belongs to another task).
    """
    path = spec.weights
    saved = cp.load_full(path)
    classes = spec.num_classes if spec.finetune else None
    skipped = strategy.load_model_weights(model, saved, path, classes)
    has_optimizer = holds_optimizer(saved)
    if skipped:
        logger.info(
            "fine-tuning: %d keys of %s skipped (shapes differ), the new %d-class "
            "head keeps its fresh initialisation: %s",
            len(skipped),
            path,
            spec.num_classes,
            ", ".join(skipped),
        )
        if spec.load_optimizer and has_optimizer:
            logger.info("fine-tuning: the optimizer state of %s is not loaded", path)
        return f"weights from {path}, new {spec.num_classes}-class head"
    if spec.load_optimizer and has_optimizer:
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
    spec: ResumeSpec,
    strategy: Strategy,
    model: nn.Module,
    optimizer,
    *,
    scaler,
    ema: ModelEma | None = None,
) -> tuple[Progress, SavedRun | None, str]:
    """Progress to continue from, the checkpoint resumed (None when new) and
    what the run starts from, in words.  Every rank loads the same file, so
    the replicas stay identical."""
    saved = agreed_resume_checkpoint(spec.out_dir) if spec.auto_resume else None
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
    if spec.weights:
        start = load_weights(spec, strategy, model, optimizer)
        if ema is not None:
            ema.reset()
        logger.info("loaded %s", start)
        return Progress(), None, start
    pretrained = " (ImageNet-pretrained weights)" * spec.pretrained
    return Progress(), None, "a new run" + pretrained
