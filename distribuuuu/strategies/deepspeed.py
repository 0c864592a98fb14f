"""``DIST.STRATEGY deepspeed``: DeepSpeed's engine (ZeRO stage 1, 2 or 3, with
optimizer and parameter offload) under our data, models, schedule, evaluation
and checkpoint layout.

Our optimizer builder makes the optimizer (every ``OPTIM.OPTIMIZER``, with our
parameter groups) and our schedule sets its learning rate each step;
``deepspeed.initialize`` wraps both, and the engine runs backward, the
accumulation boundaries, clipping and the step.  The engine's config comes from
our keys (:mod:`distribuuuu.strategies.deepspeed_config`) and is written beside
``config.yaml``.  Mixed precision is torch's autocast over fp32 weights, as
under the other strategies (DeepSpeed's ``torch_autocast`` section), so the
module's parameters, its BatchNorm buffers and an EMA of them stay fp32.

The engine makes the GPU of LOCAL_RANK current: :func:`join_group` sets it to
the index of the device chosen for this process, and the current device is
checked once the engine is built.

A checkpoint is DeepSpeed's own (``engine.save_checkpoint``: every rank writes
its partition) in a ``.ds`` folder beside the checkpoint file, which also holds
the consolidated fp32 weights (and the EMA): the ``.ds`` folder resumes the
same layout exactly, and everything else (another world size or ZeRO stage,
another strategy, inspect, export, predict, ``MODEL.WEIGHTS``) reads the whole
weights, the optimizer state then starting afresh.  DeepSpeed unpickles its
files with ``weights_only=False``: pre-flight and the choice of the checkpoint
to resume refuse a file laid out otherwise than torch.save writes or pickling
anything but DeepSpeed's state, and DeepSpeed's own loads are then made
weights-only with its classes allowed
(:mod:`distribuuuu.checkpoint.deepspeed_files`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.deepspeed_files import weights_only_loads
from distribuuuu.checkpoint.format import EMA, MODEL, SavedRun, deepspeed_entries
from distribuuuu.dist import group as du
from distribuuuu.errors import DamagedCheckpointError
from distribuuuu.strategies.base import MicroBatch, Strategy, check_current_device
from distribuuuu.strategies.ddp import convert_syncbn
from distribuuuu.strategies.deepspeed_config import (
    DS_CONFIG_FILE,
    check_nvme,
    run_config,
)
from distribuuuu.strategies.precision import autocast, resolve_auto_precision
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import (
    ASYNC_CHECKPOINT,
    FP16,
    MICRO_BATCH_AUTO,
    PRECISE_BN,
    SYNCBN,
    StrategySpec,
    check_value,
)
from distribuuuu.strategies.spec import (
    EMA as EMA_FEATURE,
)

logger = logging.getLogger(__name__)

MISSING = (
    "DIST.STRATEGY deepspeed needs DeepSpeed, which is not installed here: "
    "pip install -e '.[deepspeed]'"
)


def deepspeed_installed() -> bool:
    """Whether DeepSpeed can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # blocked, or a module without a spec
        return False


def import_deepspeed(device: torch.device):
    """The deepspeed module, its accelerator set to ``device``'s type (DeepSpeed
    picks one once, at first use: on a machine with GPUs, a CPU run must say so)."""
    if not deepspeed_installed():
        raise ValueError(MISSING)
    os.environ["DS_ACCELERATOR"] = "cuda" if device.type == "cuda" else "cpu"
    # DeepSpeed 0.19 calls torch's collectives by their deprecated names.
    warnings.filterwarnings(
        "ignore",
        message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    import deepspeed

    return deepspeed


def join_group(device: torch.device) -> None:
    """What DeepSpeed's engine needs from the launch: LOCAL_RANK in the
    environment, and a process group, of this one process where the run has
    none.

    DeepSpeed reads LOCAL_RANK as the index of the GPU it makes current (its
    engine) and allocates on (ZeRO-3): on CUDA it is our device's index, not
    the launch's local rank, which differs where each task sees only its own
    GPUs (under ``srun --gpus-per-task=1`` every task's GPU is cuda:0).  On
    the CPU it is the launch's local rank (srun sets SLURM_LOCALID instead).
    """
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        os.environ["LOCAL_RANK"] = str(index)
    else:
        os.environ.setdefault("LOCAL_RANK", str(du.detect_launch().local_rank))
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)


# DeepSpeed's name of its CPU shared-memory all-reduce op (ShareMemCommBuilder).
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_inference_all_reduce(deepspeed: Any) -> None:
    """Keep ``deepspeed`` from building and mapping its CPU shared-memory
    all-reduce, which only its inference path calls.

    On the CPU, ``deepspeed.init_distributed`` compiles that C++ op at a
    venv's first run (about 2 minutes on 2 cores) and, when its launcher sets
    ``LOCAL_SIZE``, creates a 66 MB ``/dev/shm`` buffer per rank that it never
    removes.  DeepSpeed builds the op only where ``deepspeed.ops``'s table of
    compatible ops says so; the table is kept, so marking the op incompatible
    there lasts (tests/strategies/test_deepspeed.py checks that it does).
    Training's collectives are torch's all the same.
    """
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def _engine(model: nn.Module) -> Any:
    """``model``, the DeepSpeedEngine that prepare_model returned (untyped:
    its ``optimizer`` and ``module`` are DeepSpeed's)."""
    return model


@register
class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine with ZeRO; our optimizer, schedule and checkpoints."""

    name = "deepspeed"
    contiguous_only = "ZeRO flattens the parameters"
    refused = {
        FP16: "DIST.STRATEGY deepspeed (under autocast, DeepSpeed 0.19's ZeRO "
        "skips steps on loss-scaled gradients, never lowering the scale); use bf16",
        ASYNC_CHECKPOINT: "DIST.STRATEGY deepspeed: its engine writes its own "
        "files, and its background engines (the decoupled and fast ones, built "
        "on DeepNVMe's CUDA I/O) commit them in a process of their own, with no "
        "point at which every rank's files are known complete",
        MICRO_BATCH_AUTO: "DIST.STRATEGY deepspeed (its engine owns the "
        "micro-batch and the step, collectives included); lower TRAIN.BATCH_SIZE "
        "and raise TRAIN.ACCUM_STEPS yourself",
    }
    # What stage 3's partitioned parameters do not support.
    refused_by_stage_3 = dict.fromkeys(
        (EMA_FEATURE, SYNCBN, PRECISE_BN),
        "DIST.DEEPSPEED.ZERO_STAGE 3 (the parameters are partitioned); use stage "
        "1 or 2",
    )

    @classmethod
    def refusals(cls, spec: StrategySpec) -> Mapping[str, str]:
        if spec.deepspeed.zero_stage != 3:
            return cls.refused
        return {**cls.refused, **cls.refused_by_stage_3}

    @classmethod
    def check_config(cls, spec: StrategySpec) -> None:
        """What ZeRO stages 1 and 2 do not offload."""
        ds = spec.deepspeed
        check_value(ds.offload_params == "none" or ds.zero_stage == 3,
                    "DIST.DEEPSPEED.OFFLOAD_PARAMS", ds.offload_params,
                    f"needs DIST.DEEPSPEED.ZERO_STAGE 3 (not {ds.zero_stage}): "
                    "only stage 3 partitions the parameters")  # fmt: skip

    @classmethod
    def check_layout(cls, spec: StrategySpec, world_size: int, skeleton) -> None:
        """DeepSpeed installed, the nvme path writable, a user's json readable
        and in agreement with our keys (``auto`` resolved on ``spec.device``,
        as the ranks will resolve it: never to fp16, which it refuses)."""
        if not deepspeed_installed():
            raise ValueError(MISSING)
        check_nvme(spec.deepspeed)
        device, fp16 = spec.device or torch.device("cpu"), FP16 not in cls.refused
        precision = resolve_auto_precision(spec.precision, device, fp16_allowed=fp16)
        run_config(dataclasses.replace(spec, precision=precision), world_size)

    @classmethod
    def write_config(cls, spec: StrategySpec, world_size: int, out_dir: str) -> None:
        """The engine's config, as ``OUT_DIR/ds_config.json``."""
        text = json.dumps(run_config(spec, world_size), indent=2, sort_keys=True)
        path = os.path.join(out_dir, DS_CONFIG_FILE)
        cp.atomic_write(path, lambda f: f.write(text.encode() + b"\n"))

    @property
    def stage(self) -> int:
        return self.spec.deepspeed.zero_stage

    # --- the model and the optimizer ------------------------------------ #
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The DeepSpeed engine over ``model`` and our optimizer."""
        deepspeed = import_deepspeed(self.device)
        join_group(self.device)
        if self.device.type == "cpu":
            skip_inference_all_reduce(deepspeed)
        deepspeed.init_distributed(
            dist_backend=torch.distributed.get_backend(), dist_init_required=False
        )
        if self.spec.syncbn and du.is_distributed():
            model = convert_syncbn(model, self.device)
        # The shapes of the whole model, to check loaded weights against (ZeRO
        # stage 3 leaves the module's parameters empty), copied before the
        # move: the device never holds the model twice.
        self.skeleton = copy.deepcopy(model).to("meta")
        model = model.to(self.device)
        optimizer = self.spec.build_optimizer(model)
        config = run_config(self.spec, du.get_world_size())
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config
        )
        check_current_device(self.device, "DeepSpeed")
        return engine

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The engine's ZeRO optimizer: its parameter groups are ours (the
        schedule sets their learning rate)."""
        return _engine(model).optimizer

    def forward_is_collective(self, model: nn.Module) -> bool:
        """Stage 3 gathers each layer's parameters for its forward pass."""
        return self.stage == 3 and du.is_distributed()

    def describe(self, model: nn.Module) -> str:
        ds = self.spec.deepspeed
        return (
            f"deepspeed ZeRO-{self.stage} (optimizer offload "
            f"{ds.offload_optimizer}, parameter offload {ds.offload_params})"
        )

    def memory_mb(self, model: nn.Module) -> dict:
        """MiB this process holds of parameters, gradients and optimizer state
        (the state as the optimizer will hold it after its first step)."""
        zero, module = _engine(model).optimizer, _engine(model).module
        if self.stage == 3:
            mine = [p.ds_tensor for p in module.parameters()]
            partition = sum(t.numel() for t in zero.fp32_partitioned_groups_flat)
        else:
            mine = list(module.parameters())
            partition = sum(t.numel() for t in zero.single_partition_of_fp32_groups)
        params = sum(t.numel() * t.element_size() for t in mine)
        grads = params if self.stage == 1 else partition * 4
        per = self.spec.optimizer_state_tensors
        # The optimizer's fp32 partition of the weights, a copy beside the
        # module's (fp32) parameters, whatever the precision (autocast), except
        # where stage 3 steps the parameters' own partition in place.
        copied = self.stage != 3 or self.spec.deepspeed.offload_optimizer != "none"
        masters = partition if copied else 0
        state = (partition * per + masters) * 4
        return {
            "parameters_mb": params / 2**20,
            "gradients_mb": grads / 2**20,
            "optimizer_mb": state / 2**20,
        }

    # --- training -------------------------------------------------------- #
    def train_step(
        self, state, micro_batches: Iterable[MicroBatch], meter, loss_fn
    ) -> bool:
        """The engine's forward, backward and step per micro-batch (it steps
        the optimizer at the accumulation boundary, dividing the loss by the
        accumulation steps); False when it skipped the step (fp16 overflow)."""
        engine = state.model
        for images, targets, loss_targets in micro_batches:
            with autocast(self.device, state.amp_dtype):
                logits = engine(images)
                loss = loss_fn(logits, loss_targets)
            engine.backward(loss)
            engine.step()
            meter.update(loss.detach() * len(targets), logits.detach(), targets)
        # ZeRO's step measures the norm before clipping, every step.
        state.grad_norm = engine.get_global_grad_norm() if state.norm_wanted else None
        return engine.was_step_applied()

    # --- state in our checkpoint layout ---------------------------------- #
    def model_state_dict(self, model: nn.Module) -> dict:
        """The whole model in fp32 as the module holds it, on rank 0's CPU ({}
        elsewhere); a collective under stage 3.

        ZeRO 1 and 2 keep the module's parameters whole and in fp32 (mixed
        precision is torch's autocast), equal to the optimizer's fp32 partitions
        after each step: they are read as they are, so that the EMA swapped
        into them (best_ema.pth) is what is saved.  Stage 3 (no EMA) gathers
        its partitions of the optimizer's fp32 weights.
        """
        from deepspeed.utils import safe_get_full_fp32_param

        module = _engine(model).module
        keep = du.is_main_process()
        if self.stage != 3:
            if not keep:
                return {}
            weights = module.state_dict().items()
            return {name: tensor.detach().cpu().clone() for name, tensor in weights}
        params = dict(module.named_parameters())
        whole = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name in params:  # every rank takes part in the gather
                tensor = safe_get_full_fp32_param(params[name])
            if keep:
                whole[name] = tensor.detach().cpu().clone()
        return whole

    def load_model_state(self, model: nn.Module, weights: dict, strict=True) -> None:
        """Whole weights into the module (gathered under stage 3), then into
        the optimizer's fp32 master copy."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        module = _engine(model).module
        gather = contextlib.nullcontext()
        if self.stage == 3:
            gather = GatheredParameters(list(module.parameters()), modifier_rank=0)
        with gather:
            module.load_state_dict(weights, strict=strict)
        _engine(model).optimizer.refresh_fp32_params()

    def load_model_weights(self, model, weights, path, finetune_classes=None):
        def load(whole: dict, strict: bool) -> None:
            self.load_model_state(model, whole, strict)

        return cp.load_model_weights(
            self.skeleton, weights, path, load, finetune_classes
        )

    def optimizer_state_dict(self, model, optimizer) -> dict:
        """Empty: the optimizer state is in DeepSpeed's files only."""
        return {}

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        logger.warning(
            "the optimizer state of another strategy is not loaded into "
            "DeepSpeed's engine: it starts afresh"
        )

    def save_weights(self, model, optimizer, ema, writer, name: str) -> dict:
        """DeepSpeed's checkpoint in a ``.ds`` folder (every rank writes its
        partition), and the whole fp32 weights (and EMA) for everything else."""

        def write(folder: str) -> None:
            # DeepSpeed's files go to its tag folder; the folder itself gets
            # DeepSpeed's recovery scripts (zero_to_fp32.py).
            model.save_checkpoint(folder, tag=cp.DEEPSPEED_TAG, save_latest=False)
            files = os.path.join(folder, cp.DEEPSPEED_TAG)
            for file in os.listdir(files):  # torch.save does not fsync
                with open(os.path.join(files, file), "rb") as f:
                    os.fsync(f.fileno())

        folder, manifest = writer.folder(
            name, cp.DEEPSPEED_SUFFIX, write, cp.DEEPSPEED_TAG
        )
        entries = {
            MODEL: self.model_state_dict(model),
            **deepspeed_entries(folder, manifest, self.stage, du.get_world_size()),
        }
        if ema is not None:
            entries[EMA] = ema.tensors()
        return entries

    def load_weights(self, model, optimizer, saved: SavedRun, ema) -> bool:
        """DeepSpeed's own files where the layout is the same (exact); the
        whole weights otherwise, the optimizer state afresh."""
        if saved.deepspeed_layout != (self.stage, du.get_world_size()):
            return super().load_weights(model, optimizer, saved, ema)
        # Rank 0 checked the files before choosing this checkpoint (their
        # checksums, layout, and that they pickle nothing but DeepSpeed's own
        # state); each rank loads them weights-only all the same, since a
        # file can change after the check and DeepSpeed asks for
        # weights_only=False.
        directory = cp.deepspeed_folder(saved.path, saved.state)
        with weights_only_loads(directory):
            loaded, _ = model.load_checkpoint(
                directory,
                tag=cp.DEEPSPEED_TAG,
                load_module_strict=True,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        if loaded is None:
            raise DamagedCheckpointError(f"{directory}: DeepSpeed did not load it")
        if ema is None or not saved.has_ema:
            return False
        ema.load(saved.ema_tensors, saved.ema_counters)
        return True
