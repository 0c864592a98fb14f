"""The state of a training run, and the layout of the files that save it.

``Progress`` (where the run stands), ``BatchPlan`` (its batch geometry),
``RunClock`` (for the ETA) and ``TrainState`` (everything a run works on).
This module is the one place that names the keys of a training checkpoint
and of a best-weights file: :meth:`TrainState.state_dict` writes them,
:class:`SavedRun` reads them, and nothing else spells them out.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import optim
from distribuuuu.meters import DataBoundWatch

if TYPE_CHECKING:  # imported for the annotations only
    from distribuuuu.ema import ModelEma
    from distribuuuu.logger import MetricsWriter
    from distribuuuu.strategies import Strategy

logger = logging.getLogger(__name__)

# Keys of a checkpoint file's model part.  A training checkpoint holds MODEL and
# OPTIMIZER (and EMA), or, saved sharded, SHARDS and SHARD_FILES: the name of
# its DCP folder beside it and the size and SHA-256 of each file in it.
MODEL, OPTIMIZER, EMA, EMA_COUNTERS = "model", "optimizer", "ema", "ema_counters"
SHARDS, SHARD_FILES = "sharded", "sharded_files"
# Saved under DIST.STRATEGY deepspeed: the name of DeepSpeed's folder beside the
# file (its files in SHARD_FILES) and the [ZeRO stage, world size] that wrote it;
# MODEL holds the whole weights as well.
DEEPSPEED, DEEPSPEED_LAYOUT = "deepspeed", "deepspeed_layout"
# The experiment trackers' run ids ({"mlflow": run id, "wandb": id}), which a
# resumed run continues; what a run id read back may look like.
TRACKER_RUNS = "tracker_runs"
_TRACKER_RUN_ID = re.compile(r"[\w-]{1,128}")


@dataclass
class Progress:
    """Where the run stands; what a checkpoint must carry to continue exactly."""

    epoch: int = 0  # whole epochs done
    consumed: int = 0  # positions of this epoch's global sample order trained on
    best_top1: float = -1.0
    seed: int = 0
    best_ema_top1: float = -1.0  # of the weights' moving average (MODEL.EMA)

    def state_dict(self) -> dict:
        """The checkpoint entries of the progress."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, saved: dict) -> Progress:
        """The progress saved by :meth:`state_dict` (older files lack the EMA's)."""
        progress = cls(
            saved["epoch"], saved["consumed"], saved["best_top1"], saved["seed"]
        )
        progress.best_ema_top1 = saved.get("best_ema_top1", -1.0)
        return progress


@dataclass(frozen=True)
class BatchPlan:
    """Batch geometry of this run (it may differ from cfg after a resume)."""

    per_rank: int  # micro-batch per process
    accum: int  # micro-batches per optimizer step
    world_size: int
    lr_scale: float = 1.0  # multiplies the scheduled learning rate

    @property
    def global_batch(self) -> int:
        return self.per_rank * self.accum * self.world_size

    def state_dict(self) -> dict:
        """The checkpoint entries of the plan."""
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "batch_per_rank": self.per_rank,
            "accum": self.accum,
            "lr_scale": self.lr_scale,
        }

    @classmethod
    def from_state(cls, saved: dict) -> BatchPlan:
        """The plan saved by :meth:`state_dict`."""
        plan = cls(
            saved["batch_per_rank"],
            saved["accum"],
            saved["world_size"],
            saved["lr_scale"],
        )
        if plan.global_batch != saved["global_batch"]:
            raise ValueError(
                f"inconsistent batch plan: global batch {saved['global_batch']} is "
                f"not {plan.per_rank} x {plan.accum} x {plan.world_size}"
            )
        return plan


def plan_batches(cfg: CfgNode, world_size: int, saved: BatchPlan | None) -> BatchPlan:
    """The batch plan, continuing a checkpoint's (``saved``) when resuming.

    On another world size the global batch is kept (per-process batch
    recomputed) unless ``TRAIN.RESUME_BATCH per_rank``, which keeps the
    per-process batch and scales the learning rate with the global batch.
    A fresh run starts from the linear scaling rule of
    ``OPTIM.REFERENCE_BATCH`` (1 when it is off).
    """
    accum = cfg.TRAIN.ACCUM_STEPS
    if saved is None:
        per_rank = cfg.TRAIN.BATCH_SIZE
        scale = optim.reference_lr_scale(cfg.OPTIM, per_rank * accum * world_size)
        return BatchPlan(per_rank, accum, world_size, scale)
    old_global, lr_scale = saved.global_batch, saved.lr_scale
    per_rank = saved.per_rank * saved.accum // accum
    if saved.world_size == world_size:
        return BatchPlan(per_rank, accum, world_size, lr_scale)
    if cfg.TRAIN.RESUME_BATCH == "per_rank":
        new_global = per_rank * accum * world_size
        plan = BatchPlan(
            per_rank, accum, world_size, lr_scale * new_global / old_global
        )
    else:
        per_rank, rest = divmod(old_global, world_size * accum)
        if rest or per_rank < 1:
            raise ValueError(
                f"cannot keep the global batch {old_global} of the checkpoint on "
                f"{world_size} processes x TRAIN.ACCUM_STEPS {accum}: it does not "
                "divide; change the number of processes or set "
                "TRAIN.RESUME_BATCH per_rank"
            )
        plan = BatchPlan(per_rank, accum, world_size, lr_scale)
    logger.info(
        "resuming on %d processes instead of %d: batch %d per process, global "
        "batch %d, LR x %.4g",
        world_size,
        saved.world_size,
        plan.per_rank,
        plan.global_batch,
        plan.lr_scale,
    )
    return plan


class RunClock:
    """Iterations done and time spent since (re)start, for the whole-run ETA."""

    def __init__(self, total_iters: int, done_iters: int):
        self.total_iters, self.done_iters = total_iters, done_iters
        self.start_iters, self.start = done_iters, time.perf_counter()

    def step(self) -> None:
        self.done_iters += 1

    def eta(self) -> float:
        done_now = self.done_iters - self.start_iters
        per_iter = (time.perf_counter() - self.start) / max(done_now, 1)
        return per_iter * (self.total_iters - self.done_iters)


@dataclass
class TrainState:
    """What a training run works on, built once by ``trainer.build_train_state``."""

    strategy: Strategy  # how the model is spread; owns the step and its state
    model: nn.Module  # prepared by ``strategy`` (wrapped or sharded, on device)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None  # autocast dtype; None = full precision
    device: torch.device
    normalize: nn.Module  # uint8 batches -> the model's input on ``device``
    plan: BatchPlan
    progress: Progress
    clock: RunClock
    writer: MetricsWriter
    classes: list[str]  # class names in label order, saved with the weights
    ema: ModelEma | None = None  # moving average of the weights (MODEL.EMA)
    teacher: nn.Module | None = None  # TRAIN.DISTILL's, in eval mode; never saved
    data_watch: DataBoundWatch = field(default_factory=DataBoundWatch)

    def state_dict(self, weights: dict, rng: list, cfg: CfgNode) -> dict:
        """The training checkpoint: ``weights`` (the strategy's model,
        optimizer and EMA entries), every rank's ``rng`` state, and the rest
        of the run's state."""
        state = dict(weights)
        if self.ema is not None:
            state[EMA_COUNTERS] = self.ema.counters()
        state.update(self.progress.state_dict(), **self.plan.state_dict())
        state.update(scaler=self.scaler.state_dict(), rng=rng)
        state.update(arch=cfg.MODEL.ARCH, classes=self.classes, cfg=cfg.dump())
        state[TRACKER_RUNS] = self.writer.run_ids()
        return state


class SavedRun:
    """A training checkpoint as loaded, read through its keys.

    Args:
        path: the checkpoint file (a sharded one names its DCP folder beside it).
        state: the loaded file.
    """

    def __init__(self, path: str, state: dict):
        self.path, self.state = path, state

    @property
    def progress(self) -> Progress:
        return Progress.from_state(self.state)

    @property
    def plan(self) -> BatchPlan:
        return BatchPlan.from_state(self.state)

    @property
    def scaler_state(self) -> dict | None:
        """The GradScaler's state (empty or None when it was off)."""
        return self.state.get("scaler")

    def rng_of(self, rank: int, world_size: int) -> dict | None:
        """Rank ``rank``'s RNG state, if the checkpoint was saved by
        ``world_size`` processes (on another world size, none fits)."""
        states = self.state["rng"]
        return states[rank] if len(states) == world_size else None

    @property
    def is_sharded(self) -> bool:
        return is_sharded_checkpoint(self.state)

    @property
    def tracker_runs(self) -> dict[str, str]:
        """The experiment trackers' run ids to continue (tracker -> id); an
        entry of another shape, or none (older files), gives none."""
        saved = self.state.get(TRACKER_RUNS)
        if not isinstance(saved, dict):
            return {}
        return {
            name: run_id
            for name, run_id in saved.items()
            if isinstance(name, str)
            and isinstance(run_id, str)
            and _TRACKER_RUN_ID.fullmatch(run_id)
        }

    @property
    def holds_optimizer(self) -> bool:
        """Whether the file itself holds the optimizer state (a DeepSpeed
        checkpoint keeps it in DeepSpeed's files)."""
        return holds_optimizer(self.state)

    @property
    def deepspeed_layout(self) -> tuple[int, int] | None:
        """(ZeRO stage, world size) of a DeepSpeed checkpoint; None for others."""
        layout = self.state.get(DEEPSPEED_LAYOUT)
        return None if layout is None else tuple(layout)

    @property
    def optimizer_state(self) -> dict:
        """The optimizer state with its groups as lists (as torch keeps them)."""
        return grouped_by_list(self.state[OPTIMIZER])

    @property
    def has_ema(self) -> bool:
        return EMA_COUNTERS in self.state

    @property
    def ema_tensors(self) -> dict:
        return self.state[EMA]

    @property
    def ema_counters(self) -> dict:
        return self.state[EMA_COUNTERS]


# The key of an optimizer state's hyper-parameters by parameter name: where the
# ranks hold different parameters (pipeline stages), the list of groups that
# torch keeps differs between ranks and cannot be one sharded entry.
GROUPS_BY_NAME = "param_groups_by_name"


def grouped_by_name(state: dict) -> dict:
    """An optimizer state keyed by parameter name with its groups spread out:
    ``{name: hyper-parameters}`` instead of the list of groups."""
    by_name = {}
    for group in state["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        by_name.update({name: dict(hyper) for name in group["params"]})
    return {"state": state["state"], GROUPS_BY_NAME: by_name}


def grouped_by_list(state: dict) -> dict:
    """The inverse of :func:`grouped_by_name` (a state in torch's form as is):
    parameters with equal hyper-parameters form one group, in order."""
    if GROUPS_BY_NAME not in state:
        return state
    groups: list[dict] = []
    for name, hyper in state[GROUPS_BY_NAME].items():
        same = [g for g in groups if {**g, "params": None} == {**hyper, "params": None}]
        if same:
            same[0]["params"].append(name)
        else:
            groups.append({**hyper, "params": [name]})
    return {"state": state["state"], "param_groups": groups}


def is_sharded_checkpoint(state: Any) -> bool:
    """Whether a loaded checkpoint keeps its model in a DCP folder."""
    return isinstance(state, dict) and SHARDS in state


def sharded_entries(folder: str, manifest: dict) -> dict:
    """The entries of a checkpoint whose model part is in DCP folder ``folder``
    (a plain name beside it), with the ``manifest`` of its files."""
    return {SHARDS: folder, SHARD_FILES: manifest}


def deepspeed_entries(folder: str, manifest: dict, stage: int, world: int) -> dict:
    """The entries of a checkpoint whose DeepSpeed files are in ``folder``."""
    return {DEEPSPEED: folder, SHARD_FILES: manifest, DEEPSPEED_LAYOUT: [stage, world]}


def deepspeed_folder_name(state: dict) -> Any:
    """The DeepSpeed folder a checkpoint names (unchecked: any value)."""
    return state.get(DEEPSPEED)


def shards_folder(state: dict) -> Any:
    """The DCP folder a sharded checkpoint names (unchecked: any value)."""
    return state.get(SHARDS)


def shard_manifest_of(state: dict) -> Any:
    """The manifest of a sharded checkpoint's files (None in older ones)."""
    return state.get(SHARD_FILES)


def is_training_checkpoint(state: Any) -> bool:
    """Whether a loaded file is a whole training checkpoint (the model in it
    or in its shards)."""
    return (
        isinstance(state, dict)
        and "epoch" in state
        and (MODEL in state or SHARDS in state)
    )


def holds_optimizer(state: Any) -> bool:
    """Whether a loaded file carries an optimizer state (training checkpoints)."""
    return isinstance(state, dict) and OPTIMIZER in state


def model_weights(state: Any) -> Any:
    """The model part of a loaded checkpoint or weights file (itself for a plain
    state_dict), not checked."""
    return state.get(MODEL, state) if isinstance(state, dict) else state


def best_weights(model: dict, epoch: int, top1: float, classes, cfg) -> dict:
    """The contents of ``best.pth``: weights with what inference needs."""
    return {
        MODEL: model,
        "epoch": epoch,
        "top1": top1,
        "arch": cfg.MODEL.ARCH,
        "classes": classes,
        "cfg": cfg.dump(),
    }


def averaged_weights(model: dict, newest: dict, sources: list[str]) -> dict:
    """The contents of an averaged-weights file: ``model`` with the newest
    source checkpoint's architecture, classes, config and epoch, and the
    names of the ``sources`` averaged (no top-1: nothing evaluated it)."""
    kept = {
        key: newest[key] for key in ("epoch", "arch", "classes", "cfg") if key in newest
    }
    return {MODEL: model, **kept, "averaged_from": sources}


def capture_rng_state(devices: Sequence[torch.device] = ()) -> dict:
    """The RNG states of Python, NumPy and torch of this process: the CPU's and
    those of its CUDA ``devices``, in their order (``"cuda_devices"``).

    Only the process's own GPUs (one, or every GPU of a DataParallel): a
    resume may see other GPUs, or another number of them (8 per process at
    save time, 1 under ``srun --gpus-per-task=1`` at resume), whose
    generators are not its.
    """
    version, numbers, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(numbers), gauss],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state(),
    }
    gpus = [device for device in devices if device.type == "cuda"]
    if gpus:
        state["cuda_devices"] = [torch.cuda.get_rng_state(gpu) for gpu in gpus]
    return state


def restore_rng_state(state: dict, devices: Sequence[torch.device] = ()) -> None:
    """Restore states captured by :func:`capture_rng_state`; the CUDA
    ``devices`` get the saved GPU states in order (those without one keep
    theirs).

    Older checkpoints hold the states of every GPU the process saw
    (``"cuda"``, a list by device index): each device gets the entry of its
    index, if there is one.
    """
    version, numbers, gauss = state["python"]
    random.setstate((version, tuple(numbers), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    gpus = [device for device in devices if device.type == "cuda"]
    saved = state.get("cuda_devices")
    if saved is None:  # the older layout
        every = state.get("cuda") or []
        pairs = [(gpu, every[gpu.index]) for gpu in gpus if gpu.index < len(every)]
    else:
        pairs = list(zip(gpus, saved))
    for gpu, gpu_state in pairs:
        torch.cuda.set_rng_state(gpu_state, gpu)
