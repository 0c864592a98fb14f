"""The spec builders: the one place that reads the config tree to fill the
small frozen specs that the packages below the engine take.

Each spec is defined beside the code that consumes it; each builder here is
``<thing>_spec(cfg, ...)`` and reads only the keys its spec names.  The
sections below belong to different parts of the package: add a builder to the
section of its consumer, or a new section at the end.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.config import flat_cfg
from distribuuuu.data import eval_sizes
from distribuuuu.engine.evaluation import EvalSpec
from distribuuuu.engine.loop import LoopSpec
from distribuuuu.engine.losses import Distillation, LossSpec
from distribuuuu.engine.profiling import ProfileSpec
from distribuuuu.engine.resume import ResumeSpec, SaveSpec
from distribuuuu.engine.run_log import LogSpec
from distribuuuu.engine.state import BatchPlan
from distribuuuu.optim import build as optim
from distribuuuu.reporting.remote_trackers import MlflowSpec, TrackerSpec, WandbSpec

# --------------------------------------------------------------------------- #
# reporting: the experiment trackers
# --------------------------------------------------------------------------- #


def tracker_spec(cfg: CfgNode) -> TrackerSpec:
    """What the trackers need: OUT_DIR, LOG.* and the config as flat params."""
    log = cfg.LOG
    mlflow = MlflowSpec(
        tracking_uri=log.MLFLOW.TRACKING_URI,
        experiment=log.MLFLOW.EXPERIMENT,
        run_name=log.MLFLOW.RUN_NAME,
        upload_best=log.MLFLOW.UPLOAD_BEST,
    )
    wandb = WandbSpec(
        project=log.WANDB.PROJECT,
        entity=log.WANDB.ENTITY,
        mode=log.WANDB.MODE,
        run_name=log.WANDB.RUN_NAME,
        upload_best=log.WANDB.UPLOAD_BEST,
    )
    return TrackerSpec(
        out_dir=cfg.OUT_DIR,
        trackers=tuple(log.TRACKERS),
        params=flat_cfg(cfg),
        config_file=cfg.CFG_DEST,
        close_timeout=log.CLOSE_TIMEOUT,
        mlflow=mlflow,
        wandb=wandb,
    )


# --------------------------------------------------------------------------- #
# engine: the training loop, its loss, log lines and profiler; evaluation
# --------------------------------------------------------------------------- #


def eval_spec(
    cfg: CfgNode,
    device: torch.device,
    normalize: nn.Module,
    amp_dtype: torch.dtype | None = None,
    **more,
) -> EvalSpec:
    """How to evaluate (TRAIN.TOPK, MODEL.NUM_CLASSES, TEST.PRINT_FREQ,
    TEST.TTA); ``more``: further fields of :class:`EvalSpec`."""
    classes = cfg.MODEL.NUM_CLASSES
    return EvalSpec(
        device,
        normalize,
        topk=min(cfg.TRAIN.TOPK, classes),
        num_classes=classes,
        print_freq=cfg.TEST.PRINT_FREQ,
        amp_dtype=amp_dtype,
        tta=cfg.TEST.TTA,
        crop=eval_sizes(cfg)[1],
        **more,
    )


def loss_spec(cfg: CfgNode) -> LossSpec:
    """The training loss: TRAIN.LABEL_SMOOTHING, Mixup / CutMix, TRAIN.DISTILL."""
    train, distill = cfg.TRAIN, cfg.TRAIN.DISTILL
    distillation = None
    if distill.ARCH:
        distillation = Distillation(distill.TYPE, distill.TAU, distill.ALPHA)
    return LossSpec(
        cfg.MODEL.NUM_CLASSES,
        label_smoothing=train.LABEL_SMOOTHING,
        mixup_alpha=train.MIXUP_ALPHA,
        cutmix_alpha=train.CUTMIX_ALPHA,
        mix_prob=train.MIX_PROB,
        switch_prob=train.MIX_SWITCH_PROB,
        distillation=distillation,
    )


def log_spec(cfg: CfgNode) -> LogSpec:
    """What the log lines show and watch (OPTIM.MAX_EPOCH, TRAIN.TOPK, ...)."""
    return LogSpec(
        max_epoch=cfg.OPTIM.MAX_EPOCH,
        topk=min(cfg.TRAIN.TOPK, cfg.MODEL.NUM_CLASSES),
        single_process_img_per_s=cfg.TRAIN.SINGLE_PROCESS_IMG_PER_S,
        data_bound_share=cfg.TRAIN.DATA_BOUND_SHARE,
        workers=cfg.TRAIN.WORKERS,
        decoder=cfg.DATA.DECODER,
    )


def scheduled_lr(optim_cfg: CfgNode, epoch: int, fraction: float) -> float:
    """OPTIM's learning rate for a step ``fraction`` of the way into ``epoch``."""
    return optim.lr_at(optim_cfg, optim.lr_epoch(optim_cfg, epoch, fraction))


def loop_spec(cfg: CfgNode) -> LoopSpec:
    """What the training loop reads: OPTIM's schedule, the loss, the log
    lines, TRAIN.PRINT_FREQ and TRAIN.PROFILE_STEPS."""
    profile = None
    if cfg.TRAIN.PROFILE_STEPS > 0:
        profile = ProfileSpec(steps=cfg.TRAIN.PROFILE_STEPS, out_dir=cfg.OUT_DIR)
    return LoopSpec(
        lr_at=functools.partial(scheduled_lr, cfg.OPTIM),
        loss=loss_spec(cfg),
        log=log_spec(cfg),
        print_freq=cfg.TRAIN.PRINT_FREQ,
        profile=profile,
    )


def save_spec(cfg: CfgNode) -> SaveSpec:
    """Where the run saves, what its files carry (MODEL.ARCH, the config as
    yaml) and which checkpoints it keeps (CHECKPOINT.KEEP, KEEP_BEST)."""
    keys = cfg.CHECKPOINT
    retention = cp.Retention(
        keep=keys.KEEP, best=keys.KEEP_BEST, lower_is_better=keys.BEST_METRIC == "loss"
    )
    return SaveSpec(
        out_dir=cfg.OUT_DIR,
        arch=cfg.MODEL.ARCH,
        config_dump=cfg.dump(),
        retention=retention,
    )


def resume_spec(cfg: CfgNode) -> ResumeSpec:
    """What the run starts from: TRAIN.AUTO_RESUME in OUT_DIR, MODEL.WEIGHTS
    (MODEL.FINETUNE, TRAIN.LOAD_OPT), or MODEL.PRETRAINED's weights."""
    return ResumeSpec(
        out_dir=cfg.OUT_DIR,
        auto_resume=cfg.TRAIN.AUTO_RESUME,
        weights=cfg.MODEL.WEIGHTS,
        finetune=cfg.MODEL.FINETUNE,
        num_classes=cfg.MODEL.NUM_CLASSES,
        load_optimizer=cfg.TRAIN.LOAD_OPT,
        pretrained=cfg.MODEL.PRETRAINED,
    )


def batch_spec(cfg: CfgNode, world_size: int) -> BatchPlan:
    """The batch plan of a fresh run on ``world_size`` data-parallel replicas:
    TRAIN.BATCH_SIZE, TRAIN.ACCUM_STEPS and OPTIM.REFERENCE_BATCH's LR scale."""
    per_rank, accum = cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS
    scale = optim.reference_lr_scale(cfg.OPTIM, per_rank * accum * world_size)
    return BatchPlan(per_rank, accum, world_size, scale)
