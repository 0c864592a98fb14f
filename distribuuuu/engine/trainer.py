"""Orchestration of a training run: :func:`train_model` and :func:`dry_run`.

How a config flows: :func:`~distribuuuu.engine.session.run_context` joins the process
group and picks the device; :func:`build_train_state` builds data, model,
strategy, optimizer and resume state; the epoch loop trains
(:mod:`distribuuuu.engine.loop`), evaluates
(:mod:`distribuuuu.engine.evaluation`) and saves (:mod:`distribuuuu.engine.resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import SavedRun
from distribuuuu.config import dump_cfg, merge_resolved
from distribuuuu.data import (
    ImageDataset,
    build_dataset,
    build_normalizer,
    build_test_loader,
    build_train_loader,
)
from distribuuuu.data.labels import labels_only
from distribuuuu.data.spec import Loader
from distribuuuu.dist import group as du
from distribuuuu.dist.watchdog import Watchdog
from distribuuuu.engine import specs
from distribuuuu.engine.best import keep_best, log_hparams
from distribuuuu.engine.evaluation import evaluate, evaluate_epoch, weights_to_evaluate
from distribuuuu.engine.loop import StopRequest, end_stopped_run, train_epoch
from distribuuuu.engine.micro_batch import MicroBatchFit, split_keys
from distribuuuu.engine.resume import resume_or_load, save_training_checkpoint
from distribuuuu.engine.run_log import (
    log_checkpoint_evaluation,
    log_training_images,
    watch_slow_ranks,
)
from distribuuuu.engine.session import resolve_seed, run_context, seed_everything
from distribuuuu.engine.startup import report_start
from distribuuuu.engine.state import BatchPlan, RunClock, TrainState, plan_batches
from distribuuuu.models import build_configured, build_model, zero_init_residual
from distribuuuu.models.ema import ModelEma
from distribuuuu.plan import auto
from distribuuuu.plan.flops import FlopMeter
from distribuuuu.reporting import reports
from distribuuuu.reporting.meters import PeakMemory
from distribuuuu.reporting.multilabel import headline_metric
from distribuuuu.reporting.remote_trackers import build_trackers
from distribuuuu.reporting.trackers import FAILED, FINISHED, KILLED
from distribuuuu.reporting.writer import MetricsWriter
from distribuuuu.strategies import Strategy, build_strategy, strategy_class
from distribuuuu.strategies.chain import prepare_model, runs_channels_last
from distribuuuu.strategies.precision import resolve_precision

logger = logging.getLogger(__name__)


def train_model(cfg: CfgNode) -> dict:
    """Train ``cfg`` from scratch or from its last checkpoint.

    Returns the final validation metrics, or ``{"stopped_by": signal number}``
    when SIGTERM/SIGUSR1 stopped it after saving a checkpoint.
    """
    with (
        run_context(cfg) as (info, device),
        Watchdog(cfg.DATA.TIMEOUT, info.rank) as watchdog,
    ):
        planned = auto.resolve(cfg, info, device)  # None: not DIST.STRATEGY auto
        check = auto.PlanCheck(planned, device) if planned else None
        if info.rank == 0:
            write_run_config(cfg, device, info.world_size)
            for path in cp.remove_stale_files(cfg.OUT_DIR):
                logger.info("removed %s, left by a save that was killed", path)
        precision = specs.run_precision(cfg, device)
        trackers = []
        if info.rank == 0:
            trackers = build_trackers(specs.tracker_spec(cfg, precision))
        writer = MetricsWriter(cfg.OUT_DIR, info.rank == 0, trackers)
        status = FAILED
        try:
            state, train_loader, val_loader = build_train_state(
                cfg, info, device, writer, check
            )
            if info.rank == 0 and cfg.TRAIN.MICRO_BATCH == "auto":  # its split
                writer.wrote_file(write_run_config(cfg, device, info.world_size))
            train_loader = watchdog.watch(train_loader, "train")
            val_loader = watchdog.watch(val_loader, "eval")
            stop = StopRequest(cfg.DIST.STOP_CHECK_STEPS)
            try:
                loaders = (train_loader, val_loader)
                with cp.CheckpointWriter(cfg.OUT_DIR, cfg.CHECKPOINT.ASYNC) as saver:
                    result = train_epochs(cfg, state, loaders, stop, saver, check)
                if check:
                    check.finish()
                status = KILLED if "stopped_by" in result else FINISHED
                return result
            except KeyboardInterrupt:  # to be resumed, as a signal's stop
                status = KILLED
                raise
            finally:
                stop.restore(failed=status == FAILED)
        finally:
            if check:
                check.close()
            writer.close(status)


def dry_run(cfg: CfgNode) -> dict:
    """Build everything, run one training step (DIST.STRATEGY auto: the five
    its check needs) and one evaluation batch.

    A check of a job before it is queued: every rank runs; a checkpoint to
    resume from is loaded; nothing is written.  Returns the timings (seconds)
    and the step's metrics.
    """
    with (
        run_context(cfg, log_files=False) as (info, device),
        Watchdog(cfg.DATA.TIMEOUT, info.rank) as watchdog,
    ):
        tic = time.perf_counter()
        planned = auto.resolve(cfg, info, device, record=False)
        check = auto.PlanCheck(planned, device) if planned else None
        writer = MetricsWriter(cfg.OUT_DIR, enabled=False)
        state, train_loader, val_loader = build_train_state(
            cfg, info, device, writer, check, write_index=False
        )
        train_loader = watchdog.watch(train_loader, "train")
        val_loader = watchdog.watch(val_loader, "eval")
        built = time.perf_counter()
        steps = dry_steps(cfg, state, train_loader, check)
        stepped = time.perf_counter()
        strategy, model = state.strategy, state.model
        spec = specs.run_eval_spec(cfg, state, max_iters=1)
        stats, _ = evaluate(strategy.eval_model(model), val_loader, spec)
        done = time.perf_counter()
        # Nothing was reset: the peak of the whole dry run, build included, on
        # every device of every rank.
        peaks = PeakMemory(strategy.devices(model)).read()
        memory = max(mb for rank in du.all_gather_object(peaks) for mb in rank)
        timings = {
            "build_s": built - tic,
            "train_step_s": (stepped - built) / steps,
            "eval_batch_s": done - stepped,
            "peak_mem_mb": memory,
        }
        logger.info(
            "dry run passed: built in %.1f s, a training step %.2f s, one "
            "evaluation batch %.2f s (%s %.2f on %d images), peak memory "
            "%.0f MiB per process; nothing was written",
            timings["build_s"],
            timings["train_step_s"],
            timings["eval_batch_s"],
            headline_metric(stats),
            stats[headline_metric(stats)],
            stats["samples"],
            memory,
        )
        return {**timings, **stats}


def dry_steps(
    cfg: CfgNode, state: TrainState, loader: Loader, check: auto.PlanCheck | None
) -> int:
    """The dry run's training: one step, or under DIST.STRATEGY auto the
    steps its ``check`` needs.  Each is logged (without the TFLOP/s, whose
    FLOP count would add to its time); nothing is written (no profile).
    Returns how many steps ran."""
    state.flops = None
    each = dataclasses.replace(specs.loop_spec(cfg), print_freq=1, profile=None)
    try:
        train_epoch(state, loader, each, check.after_step if check else lambda: True)
        if check:
            check.finish()
    finally:
        if check:
            check.close()
    return check.steps if check else 1


def write_run_config(cfg: CfgNode, device: torch.device, world_size: int) -> str:
    """Rank 0's record of the run beside its outputs: config.yaml (with the
    precision ``auto`` resolved to) and the strategy's own config files; the
    path of config.yaml."""
    precision = specs.run_precision(cfg, device)
    path = dump_cfg(cfg, text=specs.config_dump(cfg, precision))
    spec = specs.strategy_spec(cfg, device, precision=precision)
    strategy_class(spec.name).write_config(spec, world_size, cfg.OUT_DIR)
    return path


def build_train_state(
    cfg: CfgNode,
    info: du.LaunchInfo,
    device: torch.device,
    writer: MetricsWriter,
    check: auto.PlanCheck | None = None,
    write_index: bool = True,
) -> tuple[TrainState, Loader, Loader]:
    """Data, model, strategy, optimizer, resume state and loaders of a
    training run.  Logs the start-up report; all ranks must call it.
    ``check``: DIST.STRATEGY auto's, started before the model is prepared;
    ``write_index``: False where nothing may be written (a dry run)."""
    seed = resolve_seed(cfg.RNG_SEED)
    seed_everything(seed + info.rank)
    data = dataclasses.replace(specs.data_spec(cfg), write_index=write_index)
    train_set = build_dataset(data, train=True)
    val_set = build_dataset(data, train=False)
    model, strategy, size = build_prepared(cfg, device, check)
    amp_dtype, use_scaler = resolve_precision(strategy.spec.precision, device)
    channels_last = runs_channels_last(strategy)
    optimizer = strategy.build_optimizer(model)
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    ema = build_ema(cfg, model)
    progress, saved, start = resume_or_load(
        specs.resume_spec(cfg), strategy, model, optimizer, scaler=scaler, ema=ema
    )
    progress.seed = seed if saved is None else progress.seed
    writer.start({} if saved is None else saved.tracker_runs)
    replica, replicas = strategy.data_parallel()
    plan = run_batch_plan(cfg, replicas, saved, (strategy, model, optimizer))
    sets, images = (train_set, val_set), strategy.reads_images(model)
    train_loader, val_loader = build_loaders(
        cfg, sets, plan, replica, seed=progress.seed, device=device, images=images
    )
    if saved is not None:
        saved.restore_rng(info.rank, info.world_size, strategy.devices(model))
    state = TrainState(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        amp_dtype=amp_dtype,
        device=device,
        normalize=build_normalizer(data, device, channels_last),
        plan=plan,
        progress=progress,
        clock=RunClock.at(progress, plan, len(train_loader), cfg.OPTIM.MAX_EPOCH),
        writer=writer,
        classes=list(train_set.classes),
        ema=ema,
        teacher=build_teacher(cfg, device),
        flops=flop_meter(cfg, strategy.devices(model), amp_dtype, check),
    )
    sizes = {"train_images": len(train_set), "val_images": len(val_set)}
    planned = check.planned if check else None
    report_start(cfg, info, state, size=size, sizes=sizes, start=start, planned=planned)
    if saved is None and writer.enabled:
        log_training_images(writer, train_set, progress.seed)
    return state, train_loader, val_loader


def build_prepared(
    cfg: CfgNode, device: torch.device, check: auto.PlanCheck | None
) -> tuple[nn.Module, Strategy, dict]:
    """The model, prepared by the run's strategy (``check`` started just
    before), the strategy, and the model's size (:func:`reports.model_size`)."""
    model = build_configured(specs.model_spec(cfg))
    if cfg.MODEL.ZERO_INIT_RESIDUAL:
        blocks = zero_init_residual(model)
        logger.info("residual branches zero-initialised in %d blocks", blocks)
    size = reports.model_size(model)
    precision = specs.run_precision(cfg, device)
    amp_dtype, _ = resolve_precision(precision, device)
    strategy = build_strategy(
        specs.strategy_spec(cfg, device, precision=precision, amp_dtype=amp_dtype)
    )
    if check:
        check.start(model)
    return prepare_model(strategy, model), strategy, size


def flop_meter(
    cfg: CfgNode,
    devices: list[torch.device],
    amp_dtype: torch.dtype | None,
    check: auto.PlanCheck | None,
) -> FlopMeter:
    """The TFLOP/s and MFU of the run's windows (on a CPU, against the peak
    that DIST.STRATEGY auto calibrated; none without it)."""
    peak = check.planned.peak_flops if check else None
    ramp = specs.size_ramp(cfg)
    return FlopMeter(
        specs.model_spec(cfg),
        cfg.TRAIN.IM_SIZE,
        devices,
        amp_dtype,
        peak,
        crop_of=ramp.size if ramp else None,
    )


def run_batch_plan(
    cfg: CfgNode, replicas: int, saved: SavedRun | None, trained: tuple = ()
) -> BatchPlan:
    """The batch plan on ``replicas`` data-parallel replicas (the processes of
    a pipeline share their batches), continuing ``saved``'s when resuming;
    TRAIN.MICRO_BATCH auto's on the ``trained`` strategy, model and optimizer
    (every rank), written into the config."""
    saved_plan = None if saved is None else BatchPlan.of(saved.plan)
    asked, resume_batch = specs.batch_spec(cfg, replicas), cfg.TRAIN.RESUME_BATCH
    spec = specs.micro_batch_spec(cfg)
    if spec is None:
        return plan_batches(asked, saved_plan, resume_batch=resume_batch)
    plan = MicroBatchFit(spec, *trained).plan(asked, saved_plan, resume_batch)
    merge_resolved(cfg, split_keys(plan))
    return plan


def build_ema(cfg: CfgNode, model: nn.Module) -> ModelEma | None:
    """MODEL.EMA's moving average of the prepared ``model``; None when off."""
    if not cfg.MODEL.EMA:
        return None
    model_cfg = cfg.MODEL
    return ModelEma(
        model, model_cfg.EMA_DECAY, model_cfg.EMA_WARMUP, model_cfg.EMA_EVERY
    )


def build_teacher(cfg: CfgNode, device: torch.device) -> nn.Module | None:
    """TRAIN.DISTILL's teacher on ``device``, in eval mode and frozen (each
    process holds a whole copy; it is never wrapped, sharded or saved)."""
    distill = cfg.TRAIN.DISTILL
    if not distill.ARCH:
        return None
    teacher = build_model(distill.ARCH, cfg.MODEL.NUM_CLASSES)
    cp.load_model_weights(teacher, cp.load_full(distill.WEIGHTS), distill.WEIGHTS)
    teacher.requires_grad_(requires_grad=False)
    logger.info(
        "distillation: teacher %s from %s, %s, alpha %g, tau %g",
        distill.ARCH,
        distill.WEIGHTS,
        distill.TYPE,
        distill.ALPHA,
        distill.TAU,
    )
    return teacher.to(device).eval()


def build_loaders(
    cfg: CfgNode,
    datasets: tuple[ImageDataset, ImageDataset],
    plan: BatchPlan,
    replica: int,
    seed: int,
    device: torch.device,
    images: bool = True,
) -> tuple[Loader, Loader]:
    """The training and validation loaders of the data-parallel ``replica``
    (of ``plan.world_size``); the training loader checked against ``plan``."""
    loaders = specs.loader_spec(cfg)
    train_set, val_set = datasets
    train_loader: Loader = build_train_loader(
        loaders,
        train_set,
        rank=replica,
        world_size=plan.world_size,
        seed=seed,
        device=device,
        batch_size=plan.per_rank,
    )
    plan.check_fits(len(train_loader), len(train_loader.sampler))
    if not images:  # a process that never reads them: a pipeline's later stage
        train_loader = labels_only(train_loader, train_set, cfg.TRAIN.IM_SIZE)
    val_loader = build_test_loader(loaders, val_set, replica, plan.world_size, device)
    return train_loader, val_loader


def train_epochs(
    cfg: CfgNode,
    state: TrainState,
    loaders: tuple[Loader, Loader],
    stop: StopRequest,
    saver: cp.CheckpointWriter,
    check: auto.PlanCheck | None = None,
) -> dict:
    """The epoch loop of :func:`train_model`: train, evaluate, keep the best, save
    with ``saver``.  ``check``: DIST.STRATEGY auto's, told of every step."""
    progress, period = state.progress, cfg.CHECKPOINT.PERIOD_ITERS
    precision = state.strategy.spec.precision
    loop, save = specs.loop_spec(cfg), specs.save_spec(cfg, precision)
    stopped_by = 0

    def after_step() -> bool:
        nonlocal stopped_by
        if check:
            check.after_step()
        stopped_by = stop.agreed(state.clock.done_iters, state.slow_ranks)
        watch_slow_ranks(loop.log, state)
        if stopped_by or (period and state.clock.done_iters % period == 0):
            save_training_checkpoint(save, state, saver)
        return bool(stopped_by)

    stats: dict = {}
    memory = PeakMemory(state.strategy.devices(state.model))
    while progress.epoch < cfg.OPTIM.MAX_EPOCH:
        memory.reset()  # the training epoch's own peak, not the run's
        if train_epoch(state, loaders[0], loop, after_step):
            saver.finish()
            return end_stopped_run(stopped_by, requeue=cfg.DIST.REQUEUE)
        # Samples trained in the epoch (over restarts, if any) and its peak.
        epoch: dict[str, Any] = {
            "trained": progress.consumed,
            "train_peak": memory.read(),
        }
        progress.epoch, progress.consumed = progress.epoch + 1, 0
        stats = evaluate_and_keep_best(cfg, state, loaders, **epoch)
        if state.ema is not None:
            with state.ema.swapped_in():
                evaluate_and_keep_best(cfg, state, loaders, ema=True, **epoch)
        last = progress.epoch == cfg.OPTIM.MAX_EPOCH
        stopped_by = stop.agreed(times=state.slow_ranks)
        watch_slow_ranks(loop.log, state)
        if stopped_by or last or progress.epoch % cfg.CHECKPOINT.PERIOD == 0:
            score = stats[cfg.CHECKPOINT.BEST_METRIC]
            save_training_checkpoint(save, state, saver, score)
        if stopped_by:
            saver.finish()
            return end_stopped_run(stopped_by, requeue=cfg.DIST.REQUEUE)
    if not stats:
        logger.info("nothing to do: %d epochs already done", progress.epoch)
        return stats
    log_hparams(state, specs.run_params(cfg, state.strategy.spec.precision), stats)
    return stats


def evaluate_and_keep_best(
    cfg: CfgNode,
    state: TrainState,
    loaders: tuple[Loader, Loader],
    *,
    trained: int,
    train_peak: list[float],
    ema: bool = False,
) -> dict:
    """Evaluate the weights the model holds after an epoch (the EMA's with
    ``ema``), then log the evaluation and keep the best weights; its metrics.

    ``loaders``: the training loader (for precise BN) and the validation one;
    ``trained``: the epoch's samples; ``train_peak``: its training peak memory
    per device (MiB).
    """
    stats, confusion, peaks = evaluate_epoch(
        specs.run_eval_spec(cfg, state),
        state,
        *loaders,
        precise_bn=cfg.TRAIN.PRECISE_BN,
        train_peak=train_peak,
    )
    stats["train_samples"] = trained
    precision = state.strategy.spec.precision
    log, save = specs.log_spec(cfg), specs.save_spec(cfg, precision)
    keep_best(log, save, state, stats, confusion, ema=ema, peaks=peaks)
    return stats


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
        path = weights_to_evaluate(cfg.MODEL.WEIGHTS, cfg.OUT_DIR)
        data = dataclasses.replace(specs.data_spec(cfg), write_index=True)
        val_set = build_dataset(data, train=False)
        model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
        cp.load_model_weights(model, cp.load_file(path), path)
        model.to(device)
        loaders = specs.loader_spec(cfg)
        loader = build_test_loader(loaders, val_set, info.rank, info.world_size, device)
        loader = watchdog.watch(loader, "eval")
        amp_dtype, _ = resolve_precision(specs.run_precision(cfg, device), device)
        spec = specs.eval_spec(cfg, device, build_normalizer(data, device), amp_dtype)
        stats, confusion = evaluate(model, loader, spec)
        files = log_checkpoint_evaluation(
            cfg.OUT_DIR,
            path,
            stats,
            confusion,
            classes=list(val_set.classes),
            topk=spec.topk,
            world_size=info.world_size,
        )
        return {**stats, "topk_k": spec.topk, "weights": path, "files": files}
