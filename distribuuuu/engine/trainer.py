"""Orchestration of a training run: :func:`train_model` and :func:`dry_run`.

How a config flows: :func:`~distribuuuu.engine.session.run_context` joins the process
group and picks the device; :func:`build_train_state` builds data, model,
strategy, optimizer and resume state; the epoch loop trains
(:mod:`distribuuuu.engine.loop`), evaluates
(:mod:`distribuuuu.engine.evaluation`) and saves (:mod:`distribuuuu.engine.resume`).
"""

from __future__ import annotations

import logging
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import restore_rng_state
from distribuuuu.config import dump_cfg, flat_cfg
from distribuuuu.data import (
    build_dataset,
    build_normalizer,
    build_test_loader,
    build_train_loader,
    describe_decoder,
)
from distribuuuu.dist import group as du
from distribuuuu.dist.slurm import requeue_slurm_job
from distribuuuu.dist.watchdog import Watchdog
from distribuuuu.engine.evaluation import (
    EvalSpec,
    evaluate,
    evaluate_epoch,
    strategy_eval,
)
from distribuuuu.engine.loop import StopRequest, train_epoch
from distribuuuu.engine.resume import resume_or_load, save_training_checkpoint
from distribuuuu.engine.run_log import log_training_images
from distribuuuu.engine.session import resolve_seed, run_context, seed_everything
from distribuuuu.engine.specs import tracker_spec
from distribuuuu.engine.state import BatchPlan, RunClock, TrainState, plan_batches
from distribuuuu.models import build_configured, build_model, zero_init_residual
from distribuuuu.models.ema import ModelEma
from distribuuuu.models.recompute import enable_activation_checkpointing
from distribuuuu.reporting import reports
from distribuuuu.reporting.meters import PeakMemory
from distribuuuu.reporting.remote_trackers import build_trackers
from distribuuuu.reporting.trackers import FAILED, FINISHED, KILLED
from distribuuuu.reporting.writer import MetricsWriter
from distribuuuu.strategies import Strategy, build_strategy, strategy_class
from distribuuuu.strategies.precision import resolve_auto_precision, resolve_precision

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
        if info.rank == 0:
            dump_cfg(cfg)
            strategy_class(cfg).write_config(cfg, info.world_size)
            for path in cp.remove_stale_files(cfg.OUT_DIR):
                logger.info("removed %s, left by a save that was killed", path)
        trackers = build_trackers(tracker_spec(cfg)) if info.rank == 0 else []
        writer = MetricsWriter(cfg.OUT_DIR, info.rank == 0, trackers)
        status = FAILED
        try:
            state, train_loader, val_loader = build_train_state(
                cfg, info, device, writer
            )
            train_loader = watchdog.watch(train_loader, "train")
            val_loader = watchdog.watch(val_loader, "eval")
            stop = StopRequest(cfg.DIST.STOP_CHECK_STEPS)
            try:
                result = train_epochs(cfg, state, train_loader, val_loader, stop)
                status = KILLED if "stopped_by" in result else FINISHED
                return result
            except KeyboardInterrupt:  # to be resumed, as a signal's stop
                status = KILLED
                raise
            finally:
                stop.restore()
        finally:
            writer.close(status)


def dry_run(cfg: CfgNode) -> dict:
    """Build everything, run one training step and one evaluation batch.

    A check of a job before it is queued: every rank runs; a checkpoint to
    resume from is loaded; nothing is written.  Returns the timings (seconds)
    and the step's metrics.
    """
    cfg = cfg.clone()
    cfg.defrost()
    cfg.TRAIN.PRINT_FREQ = 1  # log the single step
    cfg.TRAIN.PROFILE_STEPS = 0  # nothing is written
    cfg.freeze()
    with (
        run_context(cfg, log_files=False) as (info, device),
        Watchdog(cfg.DATA.TIMEOUT, info.rank) as watchdog,
    ):
        tic = time.perf_counter()
        writer = MetricsWriter(cfg.OUT_DIR, enabled=False)
        state, train_loader, val_loader = build_train_state(cfg, info, device, writer)
        train_loader = watchdog.watch(train_loader, "train")
        val_loader = watchdog.watch(val_loader, "eval")
        built = time.perf_counter()
        train_epoch(state, train_loader, cfg, after_step=lambda: True)
        stepped = time.perf_counter()
        strategy, model = state.strategy, state.model
        spec = EvalSpec.of(cfg, device, state.normalize, state.amp_dtype,
                           max_iters=1, **strategy_eval(strategy, model))  # fmt: skip
        stats, _ = evaluate(strategy.eval_model(model), val_loader, spec)
        done = time.perf_counter()
        # Nothing was reset: the peak of the whole dry run, build included, on
        # every device of every rank.
        peaks = PeakMemory(strategy.devices(model)).read()
        memory = max(mb for rank in du.all_gather_object(peaks) for mb in rank)
        timings = {
            "build_s": built - tic,
            "train_step_s": stepped - built,
            "eval_batch_s": done - stepped,
            "peak_mem_mb": memory,
        }
        logger.info(
            "dry run passed: built in %.1f s, one training step %.2f s, one "
            "evaluation batch %.2f s (top1 %.2f on %d images), peak memory "
            "%.0f MiB per process; nothing was written",
            timings["build_s"],
            timings["train_step_s"],
            timings["eval_batch_s"],
            stats["top1"],
            stats["samples"],
            memory,
        )
        return {**timings, **stats}


def prepare_model(
    cfg: CfgNode, strategy: Strategy, model: nn.Module
) -> tuple[nn.Module, bool]:
    """``model`` made ready by ``strategy`` (activation checkpointing and
    channels-last first, where asked); and whether it runs channels-last."""
    if cfg.MODEL.ACT_CKPT:
        blocks = enable_activation_checkpointing(model)
        if blocks:
            logger.info("activation checkpointing: %d blocks recompute", blocks)
    channels_last = cfg.MODEL.CHANNELS_LAST and strategy.supports_channels_last
    if cfg.MODEL.CHANNELS_LAST and not channels_last:
        logger.info(
            "channels-last: off under %s, which shards contiguous tensors",
            strategy.name.upper(),
        )
    elif channels_last:
        # Convolutions give outputs in the layout of their weights, so the whole
        # network runs channels-last; the normaliser writes the input batches
        # in that layout too, which saves the first convolution a copy.
        model = model.to(memory_format=torch.channels_last)
    model = strategy.prepare_model(model)
    if cfg.MODEL.COMPILE:
        compile_in_place(strategy.plain_model(model), cfg.MODEL.COMPILE_MODE)
    return model, channels_last


def compile_in_place(model: nn.Module, mode: str) -> None:
    """``torch.compile`` the forward of ``model`` in place (``nn.Module.compile``):
    the module and its state_dict keys stay as they are, so checkpoints carry
    no compiler prefix, and the wrapper around it (DDP) calls the compiled
    forward in training as evaluation does.  Compilation happens at the first
    forward; a graph that fails to compile runs eagerly, with torch's warning
    (``torch._dynamo.config.suppress_errors``)."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    model.compile(mode=None if mode == "default" else mode)
    logger.info(
        "MODEL.COMPILE: torch.compile (mode %s) at the first forward; what fails "
        "to compile runs eagerly",
        mode,
    )


def build_train_state(
    cfg: CfgNode, info: du.LaunchInfo, device: torch.device, writer: MetricsWriter
) -> tuple[TrainState, DataLoader, DataLoader]:
    """Data, model, strategy, optimizer, resume state and loaders of a
    training run.  Logs the start-up report; all ranks must call it."""
    rank, world = info.rank, info.world_size
    seed = resolve_seed(cfg.RNG_SEED)
    seed_everything(seed + rank)
    train_set, val_set = build_dataset(cfg, True), build_dataset(cfg, False)
    model = build_configured(cfg.MODEL)
    if cfg.MODEL.ZERO_INIT_RESIDUAL:
        blocks = zero_init_residual(model)
        logger.info("residual branches zero-initialised in %d blocks", blocks)
    size = reports.model_size(model)
    resolve_auto_precision(cfg, device)  # for callers outside run_context (benchmark)
    amp_dtype, use_scaler = resolve_precision(cfg.TRAIN.MIXED_PRECISION, device)
    strategy = build_strategy(cfg, device, amp_dtype)
    model, channels_last = prepare_model(cfg, strategy, model)
    optimizer = strategy.build_optimizer(model)
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    ema = None
    if cfg.MODEL.EMA:
        ema = ModelEma(model, cfg.MODEL.EMA_DECAY, cfg.MODEL.EMA_WARMUP,
                       cfg.MODEL.EMA_EVERY)  # fmt: skip
    progress, saved, start = resume_or_load(cfg, strategy, model, optimizer,
                                            scaler, ema)  # fmt: skip
    progress.seed = seed if saved is None else progress.seed
    writer.start({} if saved is None else saved.tracker_runs)
    # The data is read per data-parallel replica (the processes of a pipeline
    # share their batches).
    replica, replicas = strategy.data_parallel()
    saved_plan = None if saved is None else BatchPlan.of(saved.plan)
    plan = plan_batches(cfg, replicas, saved_plan)
    train_loader = build_train_loader(
        cfg, train_set, replica, replicas, progress.seed, device, plan.per_rank
    )
    val_loader = build_test_loader(cfg, val_set, replica, replicas, device)
    check_loader(train_loader, plan)
    rng = None if saved is None else saved.rng_of(rank, world)
    if rng is not None:
        restore_rng_state(rng, strategy.devices(model))
    steps_per_epoch = len(train_loader) // plan.accum
    clock = RunClock(
        cfg.OPTIM.MAX_EPOCH * steps_per_epoch,
        progress.epoch * steps_per_epoch + progress.consumed // plan.global_batch,
    )
    normalize = build_normalizer(cfg, device, channels_last)
    teacher = build_teacher(cfg, device)
    state = TrainState(strategy, model, optimizer, scaler, amp_dtype, device,
                       normalize, plan, progress, clock, writer,
                       list(train_set.classes), ema, teacher)  # fmt: skip
    sizes = {"train_images": len(train_set), "val_images": len(val_set)}
    report_start(cfg, info, state, size, sizes, start)
    if saved is None and writer.enabled:
        log_training_images(writer, train_set, progress.seed)
    return state, train_loader, val_loader


def build_teacher(cfg: CfgNode, device: torch.device) -> nn.Module | None:
    """TRAIN.DISTILL's teacher on ``device``, in eval mode and frozen (each
    process holds a whole copy; it is never wrapped, sharded or saved)."""
    distill = cfg.TRAIN.DISTILL
    if not distill.ARCH:
        return None
    teacher = build_model(distill.ARCH, cfg.MODEL.NUM_CLASSES)
    cp.load_model_weights(teacher, cp.load_full(distill.WEIGHTS), distill.WEIGHTS)
    teacher.requires_grad_(False)
    logger.info(
        "distillation: teacher %s from %s, %s, alpha %g, tau %g",
        distill.ARCH, distill.WEIGHTS, distill.TYPE, distill.ALPHA, distill.TAU,
    )  # fmt: skip
    return teacher.to(device).eval()


def report_start(cfg, info, state: TrainState, size, sizes, start: str) -> None:
    """Log, record and show in tensorboard what the run is about to do."""
    plan, progress = state.plan, state.progress
    report = {
        "versions": reports.versions(),
        "world": reports.world_layout(info, state.device),
        "data": {
            "name": cfg.DATA.NAME,
            **sizes,
            "class_names": state.classes,
            "decoder": describe_decoder(cfg),
        },
        "model": {"arch": cfg.MODEL.ARCH, "syncbn": cfg.MODEL.SYNCBN, **size},
        "batch": {
            "per_rank": plan.per_rank,
            "accum": plan.accum,
            "world_size": plan.world_size,
            "global": plan.global_batch,
        },
        "memory": fullest(state.strategy.memory_mb(state.model)),
        "lr": cfg.OPTIM.BASE_LR * plan.lr_scale,
        "lr_policy": cfg.OPTIM.LR_POLICY,
        "strategy": state.strategy.describe(state.model),
        "precision": "none"
        if state.amp_dtype is None
        else str(state.amp_dtype).split(".")[-1],
        "seed": f"{progress.seed}" + " (picked at random)" * (cfg.RNG_SEED is None),
        "start": start,
    }
    text = reports.format_startup(report)
    logger.info("%s", text)
    state.writer.write({"split": "start", **report})
    state.writer.text("run/start", "    " + text.replace("\n", "\n    "))


def fullest(memory: dict) -> dict:
    """Each figure of ``memory`` (MiB on this process) at its largest over the
    processes; a collective."""
    every = du.all_gather_object(memory)
    return {key: max(part[key] for part in every) for key in memory}


def check_loader(loader: DataLoader, plan) -> None:
    """Refuse a step larger than the training images each process gets."""
    if len(loader) < plan.accum:
        raise ValueError(
            f"a batch of {plan.per_rank} x {plan.accum} accumulation steps is "
            f"larger than the {len(loader.sampler)} training images each of the "
            f"{plan.world_size} processes gets; lower TRAIN.BATCH_SIZE"
        )


def train_epochs(
    cfg: CfgNode,
    state: TrainState,
    train_loader: DataLoader,
    val_loader: DataLoader,
    stop: StopRequest,
) -> dict:
    """The epoch loop of :func:`train_model`: train, evaluate, save."""
    progress, period = state.progress, cfg.CHECKPOINT.PERIOD_ITERS
    stopped_by = 0

    def after_step() -> bool:
        nonlocal stopped_by
        stopped_by = stop.agreed(state.clock.done_iters)
        if stopped_by or (period and state.clock.done_iters % period == 0):
            save_training_checkpoint(cfg, state)
        return bool(stopped_by)

    stats: dict = {}
    memory = PeakMemory(state.strategy.devices(state.model))
    while progress.epoch < cfg.OPTIM.MAX_EPOCH:
        memory.reset()  # the training epoch's own peak, not the run's
        if train_epoch(state, train_loader, cfg, after_step):
            return stopped(cfg, stopped_by)
        train_peak = memory.read()
        trained = progress.consumed  # over restarts, if any
        progress.epoch, progress.consumed = progress.epoch + 1, 0
        loaders = (train_loader, val_loader)
        stats = evaluate_epoch(cfg, state, *loaders, trained, train_peak=train_peak)
        if state.ema is not None:
            with state.ema.swapped_in():
                evaluate_epoch(cfg, state, *loaders, trained, True, train_peak)
        last = progress.epoch == cfg.OPTIM.MAX_EPOCH
        stopped_by = stop.agreed()
        if stopped_by or last or progress.epoch % cfg.CHECKPOINT.PERIOD == 0:
            save_training_checkpoint(cfg, state, stats[cfg.CHECKPOINT.BEST_METRIC])
        if stopped_by:
            return stopped(cfg, stopped_by)
    if not stats:
        logger.info("nothing to do: %d epochs already done", progress.epoch)
        return stats
    log_hparams(cfg, state, stats)
    return stats


def log_hparams(cfg: CfgNode, state: TrainState, stats: dict) -> None:
    """The run's config beside its final scores, for tensorboard's HParams."""
    hparams = {key: value for key, value in flat_cfg(cfg).items() if key != "OUT_DIR"}
    final = {
        "hparam/best_top1": state.progress.best_top1,
        "hparam/top1": stats["top1"],
        "hparam/loss": stats["loss"],
    }
    if state.ema is not None:
        final["hparam/best_ema_top1"] = state.progress.best_ema_top1
    state.writer.hparams(hparams, final)


def stopped(cfg: CfgNode, signum: int) -> dict:
    """End a run that a signal stopped after saving (requeue it if asked)."""
    name = signal.Signals(signum).name
    logger.info("stopped by %s after saving a checkpoint", name)
    if cfg.DIST.REQUEUE and du.is_main_process() and requeue_slurm_job():
        logger.info("requeued the Slurm job: it resumes from the checkpoint")
    # The first rank to exit (128+N) ends a --kill-on-bad-exit step: not
    # before rank 0 has requeued.
    du.barrier()
    return {"stopped_by": signum}
