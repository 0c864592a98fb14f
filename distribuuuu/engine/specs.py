"""The spec builders: the one place that reads the config tree to fill the
small frozen specs that the packages below the engine take.

Each spec is defined beside the code that consumes it; each builder here is
``<thing>_spec(cfg, ...)`` and reads only the keys its spec names.  The
sections below belong to different parts of the package: add a builder to the
section of its consumer, or a new section at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import yaml
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.config import flat_cfg
from distribuuuu.config.keys import get_key
from distribuuuu.config.validation import (
    is_multi_label,
    largest_train_size,
    progressive_end_epoch,
)
from distribuuuu.data import eval_sizes
from distribuuuu.data.spec import DataSpec, LoaderSpec, SizeRamp, TransformSpec
from distribuuuu.data.transforms import CROP_MODES
from distribuuuu.engine.evaluation import EvalSpec, strategy_eval
from distribuuuu.engine.loop import LoopSpec
from distribuuuu.engine.losses import Distillation, LossSpec
from distribuuuu.engine.micro_batch import MicroBatchSpec
from distribuuuu.engine.profiling import ProfileSpec
from distribuuuu.engine.resume import ResumeSpec, SaveSpec
from distribuuuu.engine.run_log import LogSpec
from distribuuuu.engine.sigmoid_losses import SIGMOID_LOSSES, SigmoidLoss
from distribuuuu.engine.state import BatchPlan, TrainState
from distribuuuu.inference.read import eval_data_spec
from distribuuuu.models.spec import ModelSpec
from distribuuuu.optim import build as optim
from distribuuuu.optim.spec import OptimizerSpec, ScheduleSpec
from distribuuuu.reporting.remote_trackers import MlflowSpec, TrackerSpec, WandbSpec
from distribuuuu.strategies import spec as features
from distribuuuu.strategies.chain import takes_fp16
from distribuuuu.strategies.precision import resolve_auto_precision
from distribuuuu.strategies.spec import (
    CommHookSpec,
    DeepSpeedSpec,
    PipelineSpec,
    StrategySpec,
)

# --------------------------------------------------------------------------- #
# reporting: the experiment trackers
# --------------------------------------------------------------------------- #


def tracker_spec(cfg: CfgNode, precision: str | None = None) -> TrackerSpec:
    """What the trackers need: OUT_DIR, LOG.* and the config as flat params
    (with TRAIN.MIXED_PRECISION the ``precision`` the run resolved)."""
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
        params=run_params(cfg, precision),
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
    """How to evaluate (TRAIN.TOPK, MODEL.NUM_CLASSES, MODEL.LOSS,
    TEST.PRINT_FREQ, TEST.TTA, TEST.THRESHOLD; label sets or not); ``more``:
    further fields of :class:`EvalSpec`."""
    classes = cfg.MODEL.NUM_CLASSES
    return EvalSpec(
        device,
        normalize,
        topk=min(cfg.TRAIN.TOPK, classes),
        num_classes=classes,
        print_freq=cfg.TEST.PRINT_FREQ,
        amp_dtype=amp_dtype,
        tta=cfg.TEST.TTA,
        crop=eval_sizes(transform_spec(cfg))[1],
        loss=sigmoid_loss(cfg),
        multi_label=is_multi_label(cfg),
        threshold=cfg.TEST.THRESHOLD,
        **more,
    )


def sigmoid_loss(cfg: CfgNode) -> SigmoidLoss | None:
    """MODEL.LOSS bce / asl with MODEL.ASL_*; None for ce."""
    model = cfg.MODEL
    if model.LOSS not in SIGMOID_LOSSES:
        return None
    return SigmoidLoss(
        model.LOSS, model.ASL_GAMMA_NEG, model.ASL_GAMMA_POS, model.ASL_CLIP
    )


def loss_spec(cfg: CfgNode) -> LossSpec:
    """The training loss: MODEL.LOSS (and BCE_THRESHOLD, ASL_*),
    TRAIN.LABEL_SMOOTHING, Mixup / CutMix, TRAIN.DISTILL."""
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
        sigmoid=sigmoid_loss(cfg),
        threshold=cfg.MODEL.BCE_THRESHOLD,
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
        grad_spike=cfg.LOG.GRAD_SPIKE,
        straggler_ratio=cfg.LOG.STRAGGLER_RATIO,
        ramp=size_ramp(cfg),
    )


def loop_spec(cfg: CfgNode) -> LoopSpec:
    """What the training loop reads: OPTIM's schedule, the loss, the log
    lines, TRAIN.PRINT_FREQ, TRAIN.PROFILE_STEPS and TRAIN.MICRO_BATCH."""
    profile = None
    if cfg.TRAIN.PROFILE_STEPS > 0:
        profile = ProfileSpec(steps=cfg.TRAIN.PROFILE_STEPS, out_dir=cfg.OUT_DIR)
    return LoopSpec(
        schedule=schedule_spec(cfg),
        loss=loss_spec(cfg),
        log=log_spec(cfg),
        print_freq=cfg.TRAIN.PRINT_FREQ,
        profile=profile,
        micro_batch_dir=cfg.OUT_DIR if cfg.TRAIN.MICRO_BATCH == "auto" else "",
    )


def micro_batch_spec(cfg: CfgNode) -> MicroBatchSpec | None:
    """What TRAIN.MICRO_BATCH auto reads (the largest training crop,
    MODEL.NUM_CLASSES, OUT_DIR); None when it is off."""
    if cfg.TRAIN.MICRO_BATCH != "auto":
        return None
    size = largest_train_size(cfg)
    return MicroBatchSpec(size, cfg.MODEL.NUM_CLASSES, cfg.OUT_DIR)


def save_spec(cfg: CfgNode, precision: str | None = None) -> SaveSpec:
    """Where the run saves, what its files carry (MODEL.ARCH, the config as
    yaml, with the ``precision`` the run resolved) and which checkpoints it
    keeps (CHECKPOINT.KEEP, KEEP_BEST)."""
    keys = cfg.CHECKPOINT
    retention = cp.Retention(
        keep=keys.KEEP, best=keys.KEEP_BEST, lower_is_better=keys.BEST_METRIC == "loss"
    )
    return SaveSpec(
        out_dir=cfg.OUT_DIR,
        arch=cfg.MODEL.ARCH,
        config_dump=config_dump(cfg, precision),
        retention=retention,
        loss=cfg.MODEL.LOSS,
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
    scale = optim.reference_lr_scale(schedule_spec(cfg), per_rank * accum * world_size)
    return BatchPlan(per_rank, accum, world_size, scale)


def run_eval_spec(cfg: CfgNode, state: TrainState, **more) -> EvalSpec:
    """How a training run evaluates its model: :func:`eval_spec` on the run's
    device, normaliser and precision, with what its strategy decides."""
    decided = strategy_eval(state.strategy, state.model)
    return eval_spec(
        cfg, state.device, state.normalize, state.amp_dtype, **decided, **more
    )


# --------------------------------------------------------------------------- #
# data, models, optim: the data set and its loaders, the model, the optimizer
# and its learning-rate schedule
# --------------------------------------------------------------------------- #


def size_ramp(cfg: CfgNode) -> SizeRamp | None:
    """TRAIN.PROGRESSIVE's crop of each epoch (END_SIZE and END_EPOCH
    resolved); None when it is off."""
    ramp = cfg.TRAIN.PROGRESSIVE
    if not ramp.START_SIZE:
        return None
    return SizeRamp(
        start_size=ramp.START_SIZE,
        end_size=largest_train_size(cfg),
        start_epoch=ramp.START_EPOCH,
        end_epoch=progressive_end_epoch(cfg),
        multiple=ramp.MULTIPLE,
    )


def train_sizes(cfg: CfgNode) -> int:
    """How many training crops the run takes (TRAIN.PROGRESSIVE; else 1)."""
    ramp = size_ramp(cfg)
    return 1 if ramp is None else len(set(ramp.sizes(cfg.OPTIM.MAX_EPOCH)))


def transform_spec(cfg: CfgNode) -> TransformSpec:
    """The transforms' sizes, flips, interpolations and augmentations
    (TRAIN.IM_SIZE, TRAIN.HFLIP, TEST.IM_SIZE, TEST.CROP_*, TEST.TTA's crops,
    DATA.AUTO_AUGMENT, DATA.RANDOM_ERASING, ...)."""
    train, test, data = cfg.TRAIN, cfg.TEST, cfg.DATA
    return TransformSpec(
        im_size=largest_train_size(cfg),
        hflip=train.HFLIP,
        train_interpolation=train.INTERPOLATION,
        test_interpolation=test.INTERPOLATION,
        test_im_size=test.IM_SIZE,
        test_crop_size=test.CROP_SIZE,
        test_crop_pct=test.CROP_PCT,
        device_crops=test.TTA in CROP_MODES,
        auto_augment=data.AUTO_AUGMENT,
        randaug_n=data.RANDAUG_N,
        randaug_m=data.RANDAUG_M,
        randaug_mstd=data.RANDAUG_MSTD,
        randaug_inc=data.RANDAUG_INC,
        random_erasing=data.RANDOM_ERASING,
        ramp=size_ramp(cfg),
    )


def data_spec(cfg: CfgNode) -> DataSpec:
    """The data set (DATA.NAME resolved), where its splits lie, how its
    images are read and turned into tensors, and MODEL.NUM_CLASSES: the
    evaluation side that inference reads too, with training's added."""
    return dataclasses.replace(
        eval_data_spec(cfg),
        transform=transform_spec(cfg),
        train_dataset=cfg.TRAIN.DATASET,
        train_split=cfg.TRAIN.SPLIT,
        index_cache=index_cache_folder(cfg),
        train_labels_file=cfg.TRAIN.LABELS_FILE,
        test_labels_file=cfg.TEST.LABELS_FILE,
    )


def index_cache_folder(cfg: CfgNode) -> str:
    """DATA.INDEX_CACHE resolved: the folder of the splits' index files
    (OUT_DIR/data_index for ""), or "" for none."""
    value = cfg.DATA.INDEX_CACHE
    if value == "none":
        return ""
    return value or os.path.join(cfg.OUT_DIR, "data_index")


def loader_spec(cfg: CfgNode) -> LoaderSpec:
    """How the loaders serve the samples (TRAIN.WORKERS, TRAIN.PIN_MEMORY,
    DATA.DECODER, DATA.SHUFFLE_BUFFER, DATA.REPEATED_AUG, TEST.BATCH_SIZE,
    DATA.SAMPLER, DATA.REPEAT_THRESHOLD)."""
    return LoaderSpec(
        workers=cfg.TRAIN.WORKERS,
        pin_memory=cfg.TRAIN.PIN_MEMORY,
        decoder=cfg.DATA.DECODER,
        shuffle_buffer=cfg.DATA.SHUFFLE_BUFFER,
        repeated_aug=cfg.DATA.REPEATED_AUG,
        test_batch_size=cfg.TEST.BATCH_SIZE,
        sampler=cfg.DATA.SAMPLER,
        repeat_threshold=cfg.DATA.REPEAT_THRESHOLD,
        ramp=size_ramp(cfg),
    )


def model_spec(cfg: CfgNode) -> ModelSpec:
    """The model of the MODEL section: architecture, head, pretrained
    weights, dropout, drop path and BatchNorm settings."""
    model = cfg.MODEL
    return ModelSpec(
        arch=model.ARCH,
        num_classes=model.NUM_CLASSES,
        pretrained=model.PRETRAINED,
        dropout=model.DROPOUT,
        drop_path=model.DROP_PATH,
        bn_momentum=model.BN_MOMENTUM,
        bn_eps=model.BN_EPS,
    )


def optimizer_spec(cfg: CfgNode) -> OptimizerSpec:
    """OPTIM's optimizer, its hyper-parameters and its parameter groups."""
    keys = cfg.OPTIM
    return OptimizerSpec(
        name=keys.OPTIMIZER,
        base_lr=keys.BASE_LR,
        weight_decay=keys.WEIGHT_DECAY,
        momentum=keys.MOMENTUM,
        dampening=keys.DAMPENING,
        nesterov=keys.NESTEROV,
        betas=tuple(keys.BETAS),
        eps=keys.EPS,
        rmsprop_alpha=keys.RMSPROP_ALPHA,
        lars_eta=keys.LARS_ETA,
        no_decay_norm_bias=keys.NO_DECAY_NORM_BIAS,
        layer_decay=keys.LAYER_DECAY,
    )


def schedule_spec(cfg: CfgNode) -> ScheduleSpec:
    """OPTIM's learning-rate schedule: policy, warmup, LR_STEP and the
    linear scaling rule's REFERENCE_BATCH."""
    keys = cfg.OPTIM
    return ScheduleSpec(
        policy=keys.LR_POLICY,
        step=keys.LR_STEP,
        base_lr=keys.BASE_LR,
        min_lr=keys.MIN_LR,
        max_epoch=keys.MAX_EPOCH,
        steps=tuple(keys.STEPS),
        lr_mult=keys.LR_MULT,
        lr_gamma=keys.LR_GAMMA,
        onecycle_pct_start=keys.ONECYCLE_PCT_START,
        onecycle_div_factor=keys.ONECYCLE_DIV_FACTOR,
        warmup_epochs=keys.WARMUP_EPOCHS,
        warmup_factor=keys.WARMUP_FACTOR,
        reference_batch=keys.REFERENCE_BATCH,
    )


# --------------------------------------------------------------------------- #
# strategies: the strategy's spec, the run's precision and its saved config
# --------------------------------------------------------------------------- #


# DIST.STRATEGY auto (distribuuuu.plan.auto) resolves to a strategy once the
# process group is joined.  Before that it is checked as ddp: the same global
# batch, one device per process, nothing refused (the planner respects what
# each strategy refuses).
AUTO_STRATEGY, BEFORE_THE_PLAN = "auto", "ddp"


def strategy_spec(
    cfg: CfgNode,
    device: torch.device | None = None,
    *,
    precision: str | None = None,
    amp_dtype: torch.dtype | None = None,
) -> StrategySpec:
    """What the strategies read (DIST, MODEL.SYNCBN / ACT_CKPT / CHANNELS_LAST
    / COMPILE, TRAIN's batch, OPTIM) for a process on ``device`` (None
    before it has one); ``precision``: TRAIN.MIXED_PRECISION as the run
    resolved it (default: the config's), ``amp_dtype`` its autocast dtype."""
    dist, model, pipe = cfg.DIST, cfg.MODEL, cfg.DIST.PIPELINE
    optimizer = optimizer_spec(cfg)
    return StrategySpec(
        name=BEFORE_THE_PLAN if dist.STRATEGY == AUTO_STRATEGY else dist.STRATEGY,
        device=device,
        precision=precision or cfg.TRAIN.MIXED_PRECISION,
        amp_dtype=amp_dtype,
        tensor_parallel=dist.TENSOR_PARALLEL,
        sequence_parallel=dist.SEQUENCE_PARALLEL,
        fsdp_cpu_offload=dist.FSDP_CPU_OFFLOAD,
        hsdp_shard_size=dist.HSDP.SHARD_SIZE,
        syncbn=model.SYNCBN,
        arch=model.ARCH,
        image_size=largest_train_size(cfg),
        batch_size=cfg.TRAIN.BATCH_SIZE,
        accum_steps=cfg.TRAIN.ACCUM_STEPS,
        clip_grad_norm=cfg.OPTIM.CLIP_GRAD_NORM,
        activation_checkpointing=model.ACT_CKPT,
        channels_last=model.CHANNELS_LAST,
        compile_model=model.COMPILE,
        compile_mode=model.COMPILE_MODE,
        train_sizes=train_sizes(cfg),
        pipeline=PipelineSpec(
            stages=pipe.STAGES,
            micro_batches=pipe.MICROBATCHES or 2 * pipe.STAGES,
            schedule=pipe.SCHEDULE,
            virtual_stages=pipe.VIRTUAL_STAGES,
            split=tuple(pipe.SPLIT),
        ),
        deepspeed=deepspeed_spec(cfg),
        comm_hook=CommHookSpec(
            dist.DDP.COMM_HOOK, dist.DDP.POWERSGD_RANK, dist.DDP.POWERSGD_START_ITER
        ),
        build_optimizer=functools.partial(optim.build_optimizer, spec=optimizer),
        param_groups=functools.partial(optim.build_param_groups, spec=optimizer),
        optimizer_state_tensors=optim.state_tensors(optimizer),
    )


def deepspeed_spec(cfg: CfgNode) -> DeepSpeedSpec:
    """DIST.DEEPSPEED: the ZeRO stage, the offloads and a user's json."""
    ds = cfg.DIST.DEEPSPEED
    return DeepSpeedSpec(
        zero_stage=ds.ZERO_STAGE,
        offload_optimizer=ds.OFFLOAD_OPTIMIZER,
        offload_params=ds.OFFLOAD_PARAMS,
        nvme_path=ds.NVME_PATH,
        config=ds.CONFIG,
    )


def run_precision(cfg: CfgNode, device: torch.device) -> str:
    """TRAIN.MIXED_PRECISION as a run on ``device`` uses it: ``auto``
    resolved for the device and for what the run's strategy takes."""
    fp16 = takes_fp16(strategy_spec(cfg))
    return resolve_auto_precision(cfg.TRAIN.MIXED_PRECISION, device, fp16)


def config_dump(cfg: CfgNode, precision: str | None = None) -> str:
    """The run's config as yaml text (config.yaml, the checkpoints' dump):
    ``cfg.dump()`` with TRAIN.MIXED_PRECISION the ``precision`` it resolved
    (None: as the config says)."""
    text = cfg.dump()
    if precision in (None, cfg.TRAIN.MIXED_PRECISION):
        return text
    tree = yaml.safe_load(text)
    tree["TRAIN"]["MIXED_PRECISION"] = precision
    return yaml.safe_dump(tree)


def run_params(cfg: CfgNode, precision: str | None = None) -> dict:
    """The config as flat ``KEY: value`` params (for the trackers), with
    TRAIN.MIXED_PRECISION the ``precision`` the run resolved (None: as the
    config says)."""
    params = flat_cfg(cfg)
    if precision is not None:
        params["TRAIN.MIXED_PRECISION"] = precision
    return params


def turned_on(cfg: CfgNode) -> dict:
    """Feature -> (key, value) of the features the run turns on."""
    return {
        feature: (key, get_key(cfg, key))
        for feature, (key, is_on) in features.SWITCHES.items()
        if is_on(get_key(cfg, key))
    }
