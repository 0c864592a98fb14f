"""The strategy contract: how one process holds, trains and saves the model.

A strategy turns a plain model and optimizer into what one process runs, and
back into our checkpoint layout.  :class:`Strategy` is the contract and its
default behaviour (a model on this process's one device, the whole state in
every rank); each file of this package overrides what its way of spreading the
model does differently.  The training loop, evaluation and resume call only
these methods, never ``isinstance`` on a wrapper.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import EMA, MODEL, OPTIMIZER, SavedRun
from distribuuuu.dist import group as du
from distribuuuu.models.wrappers import unwrap_model
from distribuuuu.reporting import reports
from distribuuuu.strategies.broadcast import broadcast_buffers
from distribuuuu.strategies.gradients import gradient_norm, step_optimizer
from distribuuuu.strategies.mesh import ParallelDims, axis
from distribuuuu.strategies.optimizer_keys import (
    keyed_by_name,
    own_groups_by_name,
    parameter_names,
    rekey_optimizer_state,
)
from distribuuuu.strategies.precision import autocast
from distribuuuu.strategies.spec import StrategySpec

if TYPE_CHECKING:  # imported for the annotations only
    from distribuuuu.engine.losses import Distilled, TrainLoss
    from distribuuuu.engine.state import TrainState
    from distribuuuu.models.ema import ModelEma
    from distribuuuu.reporting.meters import MetricSums

logger = logging.getLogger(__name__)

# One micro-batch of a training step: the model's input, the labels (for the
# metrics) and the loss targets (mixed labels under Mixup/CutMix; beside the
# teacher's logits under distillation).
MicroBatch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | Distilled"]


def check_current_device(device: torch.device, library: str) -> None:
    """RuntimeError unless CUDA's current device is still ``device``, the one
    device chosen for this process, after ``library``, which sets the current
    device itself (DeepSpeed, DataParallel), returned."""
    if device.type != "cuda" or device.index is None:
        return
    current = torch.cuda.current_device()
    if current != device.index:
        raise RuntimeError(
            f"{library} made cuda:{current} the current device of this process, "
            f"not {device}, the one chosen for it"
        )


class Strategy:
    """One way of spreading a model over devices and processes.

    Built once per run from its :class:`StrategySpec` (this process's device
    and autocast dtype among it); every method takes the model it prepared.
    The class attributes declare what the strategy takes, for pre-flight to
    ask before a run starts.
    """

    name: ClassVar[str] = ""
    # Why the model's tensors keep their contiguous layout under this
    # strategy (MODEL.CHANNELS_LAST off, said in the log); "": they need not.
    contiguous_only: ClassVar[str] = ""
    # Each process drives one device (so a node needs a GPU per process);
    # False for a process that drives every GPU it sees.
    one_device_per_process: ClassVar[bool] = True
    # Whether MODEL.COMPILE may compile the model (one module per process).
    compiles: ClassVar[bool] = False
    # Whether DIST.TENSOR_PARALLEL may split the blocks of its replicas.
    takes_tensor_parallel: ClassVar[bool] = False
    # Whether DIST.DDP.COMM_HOOK applies (it wraps the model in DDP).
    takes_comm_hook: ClassVar[bool] = False
    # Features it refuses (spec.SYNCBN, spec.FP16, ...) -> why, the end of
    # pre-flight's "... is not supported with ..." (in the order checked).
    refused: ClassVar[Mapping[str, str]] = {}
    # Set by a layout of more axes than data parallelism: its groups.
    dp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None

    def __init__(self, spec: StrategySpec):
        self.spec, self.amp_dtype = spec, spec.amp_dtype
        # A strategy is built once the process has chosen its device: never None.
        self.device = cast(torch.device, spec.device)
        self.tensor_parallel = None
        if spec.tensor_parallel > 1:
            from distribuuuu.strategies.tensor import TensorParallel

            self.tensor_parallel = TensorParallel(spec)

    # --- what it takes, asked before the run ----------------------------- #
    @classmethod
    def refusals(cls, spec: StrategySpec) -> Mapping[str, str]:
        """The features refused under ``spec`` (see :attr:`refused`)."""
        return cls.refused

    @classmethod
    def check_config(cls, spec: StrategySpec) -> None:
        """ValueError for a value of the strategy's own keys that cannot work
        (checked when the config is loaded)."""

    @classmethod
    def cpu_collectives(cls, spec: StrategySpec) -> bool:
        """Whether collectives on host tensors need gloo beside nccl."""
        return False

    @classmethod
    def parallel_dims(cls, spec: StrategySpec, world_size: int) -> ParallelDims:
        """``world_size`` processes on the axes of this strategy's layout."""
        return ParallelDims(world_size, tp=spec.tensor_parallel)

    @classmethod
    def replicas(cls, spec: StrategySpec, world_size: int) -> int:
        """How many data-parallel replicas ``world_size`` processes form (each
        reads its own batches; the processes of one replica share them)."""
        return cls.parallel_dims(spec, world_size).dp

    @classmethod
    def check_layout(
        cls, spec: StrategySpec, world_size: int, skeleton: Callable[[], nn.Module]
    ) -> None:
        """Refuse (ValueError) a layout that cannot work, before the processes
        start; ``skeleton()`` builds the model without memory."""

    @classmethod
    def write_config(cls, spec: StrategySpec, world_size: int, out_dir: str) -> None:
        """Write the strategy's own config files beside config.yaml (rank 0)."""

    # --- the layout ------------------------------------------------------ #
    @functools.cached_property
    def dims(self) -> ParallelDims:
        """This run's processes on the strategy's axes."""
        return self.parallel_dims(self.spec, du.get_world_size())

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The run's one device mesh (built on first use: a collective)."""
        return self.dims.build_mesh(self.device.type)

    def data_parallel(self) -> tuple[int, int]:
        """This process's replica and the number of replicas."""
        world, replicas = du.get_world_size(), self.dims.dp
        return du.get_rank() // (world // replicas), replicas

    # --- the model and the optimizer ------------------------------------ #
    def split_tensors(self, model: nn.Module) -> nn.Module:
        """The chain's tensor-parallel step: ``model``'s blocks split over
        the ``tp`` axis (on this process's device), where it is on."""
        if self.tensor_parallel is None:
            return model
        self.dp_group = axis(self.mesh, "dp").get_group()
        return self.tensor_parallel.apply(model, self.mesh)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The chain's wrapping step: ``model`` on this process's device,
        wrapped or sharded for the run."""
        return model.to(self.device)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer of OPTIM over the prepared ``model``."""
        return self.spec.build_optimizer(model)

    def devices(self, model: nn.Module) -> list[torch.device]:
        """The devices this process's ``model`` runs on."""
        return [self.device]

    def spread(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights are DTensors spread over the ranks (its
        state then goes through DCP and torch's distributed state_dict API).

        Asked of the modules too: after a forward pass FSDP2 keeps the root's
        parameters gathered as plain tensors, yet its state_dict still holds
        shards (torch 2.15).
        """
        return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
            isinstance(param, DTensor) for param in model.parameters()
        )

    def forward_is_collective(self, model: nn.Module) -> bool:
        """Whether every rank must run each forward pass (spread weights)."""
        return self.spread(model)

    def holds_outputs(self, model: nn.Module) -> bool:
        """Whether this process's forward passes return the logits that count:
        the ranks of a tensor-parallel group all get them, the first counts
        (a pipeline's last stage holds them; its other stages return None)."""
        return self.tensor_parallel is None or self.tensor_parallel.rank == 0

    def reads_images(self, model: nn.Module) -> bool:
        """Whether this process's forward passes read the input images (a
        pipeline's later stages get activations instead, and labels)."""
        return True

    def describe(self, model: nn.Module) -> str:
        """A few words for the start-up report."""
        return self.name

    def memory_mb(self, model: nn.Module) -> dict:
        """MiB of what this process holds, for the start-up report: parameters
        (its shards of sharded ones), and where the strategy knows them,
        gradients and optimizer state."""
        return {"parameters_mb": reports.parameter_mb(model)}

    # --- training -------------------------------------------------------- #
    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """Backward passes inside synchronize gradients only if ``sync``
        (False for all but the last micro-batch of gradient accumulation)."""
        yield

    def train_step(
        self,
        state: TrainState,
        micro_batches: Iterable[MicroBatch],
        meter: MetricSums,
        loss_fn: TrainLoss,
    ) -> bool:
        """Forward, backward and optimizer step of ``plan.accum`` micro-batches;
        False when a GradScaler skipped the step.

        Gradients are synchronized on the last micro-batch only.  The metrics
        of each micro-batch go to ``meter``.
        """
        model, accum = state.model, state.plan.accum
        for micro, (images, targets, loss_targets) in enumerate(micro_batches):
            with self.gradient_sync(model, sync=micro == accum - 1):
                with autocast(self.device, state.amp_dtype):
                    logits = model(images)
                    loss = loss_fn(logits, loss_targets)
                if micro == 0:
                    # Free the last step's gradients here, just before backward
                    # allocates new ones, not after the step: then the allocator
                    # hands backward the memory just freed, where freeing before
                    # the forward made CPU runs page-fault twice as often and the
                    # step 5-10% slower (tools/benchmark.py, resnet20 on CPU).
                    # torchvision's reference loop zeroes at the same place.
                    state.optimizer.zero_grad(set_to_none=True)
                state.scaler.scale(loss / accum).backward()
            meter.update(loss.detach() * len(targets), logits.detach(), targets)
        self.reduce_gradients(model)
        clip = self.spec.clip_grad_norm
        check_skip = state.ema is not None
        norm_of = self.gradient_norm if state.norm_wanted else None
        stepped = step_optimizer(
            model, state.optimizer, state.scaler, clip, check_skip, norm_of
        )
        state.grad_norm = stepped.grad_norm if state.norm_wanted else None
        return stepped.taken

    def gradient_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The global norm of this process's ``params``' gradients, reduced
        (before clipping; every rank gets it): what ``clip_grad_norm_`` would
        return for the whole model's gradients in one process."""
        return gradient_norm(params)

    def reduce_gradients(self, model: nn.Module) -> None:
        """Finish the gradients after the last backward of a step, where the
        strategy reduces them itself (DDP and FSDP do it during backward)."""

    # --- evaluation ------------------------------------------------------ #
    def eval_model(self, model: nn.Module) -> nn.Module:
        """The module to evaluate, with rank 0's buffers on every rank.

        Unwrapped: the ranks of an exact evaluation may run different numbers
        of batches, which a DDP forward (a collective) would not allow.
        """
        broadcast_buffers(model)
        return unwrap_model(model)

    def plain_model(self, model: nn.Module) -> nn.Module:
        """The model without its wrapper (an FSDP model is its own)."""
        return unwrap_model(model)

    # --- state in our checkpoint layout ---------------------------------- #
    def model_state_dict(self, model: nn.Module) -> dict:
        """The whole model's state_dict without wrapper prefixes (on rank 0 at
        least; a collective where the weights are spread), in the keys of the
        plain model."""
        if not self.spread(model):
            whole = unwrap_model(model).state_dict()
        else:
            from distribuuuu.strategies import spread

            whole = spread.whole_model_state(model)
        if self.tensor_parallel is not None:
            whole = self.tensor_parallel.whole_keys(whole)
        return whole

    def load_model_state(self, model: nn.Module, weights: dict, strict=True) -> None:
        """Load a whole state_dict (every rank passes it).

        ``strict=False`` lets keys be missing (fine-tuning leaves out a new
        head); those keep their values.
        """
        if self.tensor_parallel is not None:
            weights = self.tensor_parallel.split_keys(weights)
        if not self.spread(model):
            unwrap_model(model).load_state_dict(weights, strict=strict)
            return
        from distribuuuu.strategies import spread

        spread.load_whole_model_state(model, weights, strict)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict:
        """The whole optimizer state (on rank 0 at least); keyed by parameter
        name where the weights are spread (a collective)."""
        if not self.spread(model):
            return optimizer.state_dict()
        from distribuuuu.strategies import spread

        return spread.whole_optimizer_state(model, optimizer)

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load a whole optimizer state (every rank passes it), keyed by
        parameter index (as DDP and ZeRO save it) or by parameter name (as
        FSDP does): renamed to what the model takes first."""
        by_name = keyed_by_name(state)
        if not self.spread(model):
            if by_name:
                state = own_groups_by_name(state, model, optimizer)
                names = parameter_names(model, optimizer)
                state = rekey_optimizer_state(state, names, list(range(len(names))))
            optimizer.load_state_dict(state)
            return
        from distribuuuu.strategies import spread

        if not by_name:
            names = parameter_names(model, optimizer)
            state = rekey_optimizer_state(state, list(range(len(names))), names)
        spread.load_whole_optimizer_state(model, optimizer, state)

    def save_weights(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ema: ModelEma | None,
        writer: cp.CheckpointWriter,
        name: str,
    ) -> dict:
        """The model, optimizer and EMA entries of training checkpoint ``name``.

        Whole tensors; where the weights are spread, every rank has ``writer``
        write its shards instead (nothing is gathered) and the entries name
        them.
        """
        if self.spread(model):
            from distribuuuu.strategies import spread

            return spread.save_shards(model, optimizer, ema, writer, name)
        entries = {
            MODEL: self.model_state_dict(model),
            OPTIMIZER: self.optimizer_state_dict(model, optimizer),
        }
        if ema is not None:
            entries[EMA] = ema.tensors()
        return entries

    def load_weights(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        saved: SavedRun,
        ema: ModelEma | None,
    ) -> bool:
        """Load what :meth:`save_weights` wrote (each rank reads its own
        shards into spread weights; a sharded checkpoint is read whole
        otherwise); True if the checkpoint held an EMA to load into ``ema``."""
        if saved.is_sharded and self.spread(model):
            from distribuuuu.strategies import spread

            return spread.load_shards(model, optimizer, saved, ema)
        if saved.is_sharded:
            saved = SavedRun(saved.path, cp.load_full(saved.path))
        self.load_model_weights(model, saved.state, saved.path)
        if saved.holds_optimizer:
            self.load_optimizer_state(model, optimizer, saved.optimizer_state)
        else:  # DeepSpeed's optimizer state is in its own files
            logger.warning(
                "%s holds no optimizer state this strategy reads: it starts afresh",
                saved.path,
            )
        if ema is None or not saved.has_ema:
            return False
        ema.load(saved.ema_tensors, saved.ema_counters)
        return True

    def load_model_weights(
        self,
        model: nn.Module,
        weights: dict,
        path: str,
        finetune_classes: int | None = None,
    ) -> list[str]:
        """Load the weights of checkpoint or state_dict ``weights`` (from file
        ``path``), checked against the model; the keys skipped (a classifier
        head of another size when ``finetune_classes`` is given)."""

        def load(whole: dict, strict: bool) -> None:
            self.load_model_state(model, whole, strict)

        if self.tensor_parallel is not None:
            weights = self.tensor_parallel.split_keys(cp.weights_in(weights))
        plain = self.plain_model(model)
        return cp.load_model_weights(plain, weights, path, load, finetune_classes)
