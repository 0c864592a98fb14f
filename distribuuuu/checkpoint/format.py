"""The checkpoint format: the one place that names the keys of a training
checkpoint and of a best-weights file.

:func:`training_checkpoint` writes a training checkpoint's entries and
:class:`SavedRun` reads them back as plain values; the engine builds its run
state (``Progress``, ``BatchPlan``) from those values. Optimizer-state
regrouping and the RNG capture live here too.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.tensor import DTensor

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
# Saved under DIST.DDP.COMM_HOOK powersgd: every rank's PowerSGD state (its
# error feedback differs per rank), a list by rank.
COMM_HOOK = "comm_hook"
_TRACKER_RUN_ID = re.compile(r"[\w-]{1,128}")


# The entries of a run's progress and of its batch plan (the plan's global batch
# is saved too, as a check).
PROGRESS_KEYS = ("epoch", "consumed", "best_top1", "seed", "best_ema_top1")

# Weights files name the training loss (MODEL.LOSS) under this key; it says
# whether their logits are a softmax's (ce) or independent sigmoids' (bce, asl).
LOSS_KEY = "loss"
SAVED_LOSSES = ("ce", "bce", "asl")
PLAN_KEYS = ("batch_per_rank", "accum", "world_size", "lr_scale")


def training_checkpoint(
    weights: dict,
    *,
    progress: dict,
    plan: dict,
    rng: list,
    scaler: dict,
    run: dict,
) -> dict:
    """A training checkpoint's entries.

    Args:
        weights: the strategy's model, optimizer and EMA entries.
        progress: the run's progress (``PROGRESS_KEYS``).
        plan: its batch plan (``PLAN_KEYS``).
        rng: every rank's RNG state.
        scaler: the GradScaler's state.
        run: ``arch``, ``classes``, ``cfg`` (its dump), ``tracker_runs`` and,
            with an EMA, ``ema_counters``.
    """
    state = dict(weights)
    if run.get("ema_counters") is not None:
        state[EMA_COUNTERS] = run["ema_counters"]
    state.update({key: progress[key] for key in PROGRESS_KEYS})
    state.update({key: plan[key] for key in PLAN_KEYS})
    per_rank, accum, world = plan["batch_per_rank"], plan["accum"], plan["world_size"]
    state["global_batch"] = per_rank * accum * world
    state.update(scaler=scaler, rng=rng)
    state.update(arch=run["arch"], classes=run["classes"], cfg=run["cfg"])
    state[TRACKER_RUNS] = run["tracker_runs"]
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
    def progress(self) -> dict:
        """The run's progress (``PROGRESS_KEYS``; older files lack the EMA's)."""
        progress = {key: self.state[key] for key in PROGRESS_KEYS[:-1]}
        return {**progress, "best_ema_top1": self.state.get("best_ema_top1", -1.0)}

    @property
    def plan(self) -> dict:
        """The batch plan (``PLAN_KEYS``), checked against its global batch."""
        plan = {key: self.state[key] for key in PLAN_KEYS}
        per_rank, accum, world = (
            plan["batch_per_rank"],
            plan["accum"],
            plan["world_size"],
        )
        if per_rank * accum * world != self.state["global_batch"]:
            raise ValueError(
                f"inconsistent batch plan: global batch {self.state['global_batch']} "
                f"is not {per_rank} x {accum} x {world}"
            )
        return plan

    @property
    def scaler_state(self) -> dict | None:
        """The GradScaler's state (empty or None when it was off)."""
        return self.state.get("scaler")

    def rng_of(self, rank: int, world_size: int) -> dict | None:
        """Rank ``rank``'s RNG state, if the checkpoint was saved by
        ``world_size`` processes (on another world size, none fits)."""
        states = self.state["rng"]
        return states[rank] if len(states) == world_size else None

    def restore_rng(
        self, rank: int, world_size: int, devices: Sequence[torch.device]
    ) -> None:
        """Put back rank ``rank``'s RNG state on ``devices``, if it has one."""
        rng = self.rng_of(rank, world_size)
        if rng is not None:
            restore_rng_state(rng, devices)

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

    def comm_hook_of(self, rank: int, world_size: int) -> tuple[dict, bool] | None:
        """Rank ``rank``'s PowerSGD state, and whether the file was saved by
        ``world_size`` processes (on another world size rank 0's state is the
        nearest, without its error feedback); None where the file has none."""
        states = self.state.get(COMM_HOOK)
        if not isinstance(states, list) or not states:
            return None
        same = len(states) == world_size
        return states[rank if same else 0], same

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


def sharded_entries(folder: str, manifest: dict | None) -> dict:
    """The entries of a checkpoint whose model part is in DCP folder ``folder``
    (a plain name beside it), with the ``manifest`` of its files (None while
    they are written in the background)."""
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


def best_weights(
    model: dict,
    *,
    epoch: int,
    score: tuple[str, float],
    classes: list[str],
    arch: str,
    config_dump: str,
    loss: str = "ce",
) -> dict:
    """The contents of ``best.pth``: weights with what inference needs
    (``config_dump``: the run's config as yaml text; ``loss``: MODEL.LOSS,
    which says how its logits become probabilities, under LOSS_KEY) and
    the ``score`` (metric, value) that made them best: ``"top1"`` or
    ``"map"``."""
    metric, value = score
    return {
        MODEL: model,
        "epoch": epoch,
        metric: value,
        "arch": arch,
        "classes": classes,
        "cfg": config_dump,
        LOSS_KEY: loss,
    }


def saved_loss(ckpt: dict) -> str:
    """MODEL.LOSS of the run that wrote ``ckpt``: files from before the key
    was recorded were all trained with softmax cross-entropy."""
    value = ckpt.get(LOSS_KEY, "ce")
    return value if value in SAVED_LOSSES else "ce"


def averaged_weights(model: dict, newest: dict, sources: list[str]) -> dict:
    """The contents of an averaged-weights file: ``model`` with the newest
    source checkpoint's architecture, classes, config and epoch, and the
    names of the ``sources`` averaged (no top-1: nothing evaluated it)."""
    kept = {
        key: newest[key]
        for key in ("epoch", "arch", "classes", "cfg", LOSS_KEY)
        if key in newest
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
    # The legacy tuple (numpy types get_state as that tuple or a dict).
    np_state = cast(tuple, np.random.get_state())
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


# A tensor-parallel torchvision ViT keeps each attention's q, k and v apart;
# its checkpoints hold them fused, under torchvision's names.
def fuse_qkv(state: dict, prefix: str | None = None) -> dict:
    """``state`` with the q, k, v entries of each split attention (under
    ``prefix``, or every ``self_attention.`` one) fused into torchvision's
    ``in_proj_weight`` and ``in_proj_bias``, in place; plain tensors only."""
    if prefix is not None:
        prefixes = [prefix]
    else:
        split = "self_attention.q.weight"
        prefixes = [key[: -len("q.weight")] for key in state if key.endswith(split)]
    for start in prefixes:
        for kind in ("weight", "bias"):
            names = [f"{start}{n}.{kind}" for n in "qkv"]
            parts = [state.get(n) for n in names]
            if not all(_plain(p) for p in parts):
                continue
            state[f"{start}in_proj_{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


def _plain(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
