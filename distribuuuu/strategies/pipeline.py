"""``DIST.STRATEGY pipeline``: the layers split into stages, one per process,
with PyTorch's ``torch.distributed.pipelining`` running the schedule.

The world is a 2-D mesh, data parallel x pipeline (``dp`` x ``pp``): ranks
``d * STAGES ... d * STAGES + STAGES - 1`` form pipeline ``d``, neighbours in
one pipeline are neighbouring ranks.  Each batch of a pipeline (TRAIN.BATCH_SIZE
images, shared by its processes) is cut into DIST.PIPELINE.MICROBATCHES
micro-batches that flow through the stages under GPipe (all forwards, then all
backwards), 1F1B (a backward as soon as a micro-batch is through, so at most
STAGES micro-batches of activations are held) or interleaved 1F1B (several
stages per process, a smaller bubble).  After the schedule, the gradients of
each stage are averaged over its data-parallel replicas (one all-reduce per
stage); gradient clipping takes the norm over all stages.

Each stage holds its layers under the whole model's names, so the stages'
checkpoint pieces (DCP, like FSDP's) fit together into the whole model, load on
another stage count or world size, and read whole for the tools.

Semantics: BatchNorm normalizes each micro-batch (as in GPipe); a model
without BatchNorm trains exactly as one process with the same global batch.
Evaluation relays whole batches through the stages (any batch size; nothing
to overlap without a backward pass).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import (
    EMA,
    MODEL,
    OPTIMIZER,
    grouped_by_list,
    grouped_by_name,
    sharded_entries,
)
from distribuuuu.dist import group as du
from distribuuuu.models.chains import (
    ShapesUncounted,
    StagePart,
    Step,
    balanced_bounds,
    model_chain,
    named_bounds,
    step_sizes,
)
from distribuuuu.strategies.base import MicroBatch, Strategy
from distribuuuu.strategies.gradients import average_gradients, step_optimizer
from distribuuuu.strategies.mesh import ParallelDims
from distribuuuu.strategies.optimizer_keys import (
    keyed_by_name,
    own_groups_by_name,
    rekey_optimizer_state,
)
from distribuuuu.strategies.precision import autocast
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import (
    DISTILLATION,
    FP16,
    LAYER_DECAY,
    MICRO_BATCH_AUTO,
    PRECISE_BN,
    SYNCBN,
    PipelineSpec,
    StrategySpec,
    check_value,
)

if TYPE_CHECKING:
    from distribuuuu.engine.losses import TrainLoss
    from distribuuuu.engine.state import TrainState
    from distribuuuu.reporting.meters import MetricSums

logger = logging.getLogger(__name__)

# How pre-flight's refusals name this strategy.
_NAMED = "DIST.STRATEGY pipeline"

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


# --- where the model is cut ------------------------------------------------- #
def plan_split(
    model: nn.Module, pipe: PipelineSpec, arch: str
) -> tuple[list[Step], list[int]]:
    """The chain of ``model`` (MODEL.ARCH ``arch``) and the first step of
    each piece.  Raises ValueError for a model the pipeline cannot cut as
    asked."""
    steps, pieces = model_chain(model), pipe.pieces
    if len(steps) < pieces:
        raise ValueError(
            f"DIST.PIPELINE: {arch} has {len(steps)} layers to cut "
            f"between, too few for {pieces} stages"
        )
    if pipe.split:
        return steps, named_bounds(steps, list(pipe.split), pieces)
    return steps, balanced_bounds(step_sizes(model, steps), pieces)


def describe_split(model: nn.Module, steps: list[Step], bounds: list[int]) -> str:
    """One line per piece: its first and last layer and its parameters."""
    sizes = step_sizes(model, steps)
    ends = [*bounds[1:], len(steps)]
    return "\n".join(
        f"  stage {index}: {steps[start].name} .. {steps[end - 1].owns[-1]}, "
        f"{sum(sizes[start:end]):,} parameters"
        for index, (start, end) in enumerate(zip(bounds, ends))
    )


# --- activations between stages ------------------------------------------ #
# The dtypes activations travel in between stages, by index in the header.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 8


def send_activation(x: torch.Tensor, dst: int, group) -> None:
    """Send ``x`` with a header of its dtype and shape (to global rank ``dst``)."""
    shape = [*x.shape] + [0] * (_MAX_DIMS - x.dim())
    header = torch.tensor([_DTYPES.index(x.dtype), x.dim(), *shape], device=x.device)
    dist.send(header, dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def recv_activation(src: int, group, device: torch.device) -> torch.Tensor:
    """Receive what :func:`send_activation` sent from global rank ``src``."""
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, dims, *shape = header.tolist()
    x = torch.empty(shape[:dims], dtype=_DTYPES[dtype], device=device)
    dist.recv(x, src, group=group)
    return x


class PipelineForward(nn.Module):
    """Forward passes relayed through the stages whole, for evaluation: the
    last stage's process returns the logits, the others None."""

    def __init__(self, pieces: list[StagePart], indices: list[int], route):
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.indices, self.route = indices, route

    def forward(self, images: torch.Tensor) -> torch.Tensor | None:
        group, last, rank_of = self.route
        x, out = images, None
        for piece, index in zip(self.pieces, self.indices):
            if index > 0:
                x = recv_activation(rank_of(index - 1), group, images.device)
            x = piece(x)
            if index < last:
                send_activation(x, rank_of(index + 1), group)
            else:
                out = x
        return out


class _WholeShapes:
    """The whole model's state_dict names and shapes (on the meta device),
    which loaded weights are checked against."""

    def __init__(self, model: nn.Module):
        self.shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}

    def state_dict(self) -> dict:
        return {
            k: torch.empty(shape, dtype=dtype, device="meta")
            for k, (shape, dtype) in self.shapes.items()
        }


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name, shared ones under each
    of their names."""
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def broadcast_from_first_rank(
    model: nn.Module, part: nn.Module, device: torch.device
) -> None:
    """Give ``part``, this rank's layers of ``model`` already moved to
    ``device``, rank 0's values (each rank built the model from its own seed).

    The broadcasts go over the default group, which may be NCCL, so every
    tensor handed to it is on ``device``: ``part``'s own tensors receive in
    place, the layers of other stages pass through a device copy one tensor
    at a time, so that no GPU ever holds the whole model.
    """
    if not du.is_distributed():
        return
    held = dict(_tensors(part))
    sender = du.is_main_process()
    for name, tensor in _tensors(model):
        if name in held:
            staged = held[name].detach()
        elif sender:
            staged = tensor.detach().to(device)
        else:
            staged = torch.empty_like(tensor, device=device)
        dist.broadcast(staged, 0)


def whole_optimizer_order(
    model: nn.Module, param_groups: Callable[[nn.Module], list]
) -> list[str]:
    """The names of ``model``'s parameters in the order of the whole optimizer
    (that a whole optimizer state's indices follow), whose groups
    ``param_groups`` builds."""
    groups = param_groups(model)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    owner = {param: name for name, param in model.named_parameters()}
    return [owner[p] for group in groups for p in group["params"]]


@register
class PipelineStrategy(Strategy):
    """Stages of the model on the ranks of a pipeline; data parallel across
    pipelines."""

    name = "pipeline"
    refused = {
        SYNCBN: _NAMED,
        PRECISE_BN: _NAMED,
        LAYER_DECAY: _NAMED,
        FP16: f"{_NAMED} (the stages would have to agree on every skipped step); "
        "use bf16",
        DISTILLATION: f"{_NAMED} (its last stage, which computes the loss, never "
        "sees the images)",
        MICRO_BATCH_AUTO: f"{_NAMED} (a step passes activations from stage to "
        "stage: no rank can try one alone); size DIST.PIPELINE.MICROBATCHES and "
        "TRAIN.ACCUM_STEPS yourself",
    }

    @classmethod
    def check_config(cls, spec: StrategySpec) -> None:
        """Micro-batches that fill the schedule and split the batch."""
        pipe, key = spec.pipeline, "DIST.PIPELINE.MICROBATCHES"
        micro, stages = pipe.micro_batches, pipe.stages
        if pipe.schedule != "gpipe":
            check_value(micro >= stages, key, micro,
                        f"must be >= DIST.PIPELINE.STAGES {stages} under "
                        f"{pipe.schedule} (every stage needs a micro-batch in "
                        "flight)")  # fmt: skip
        if pipe.schedule == "interleaved_1f1b":
            check_value(micro % stages == 0, key, micro,
                        f"must be a multiple of DIST.PIPELINE.STAGES {stages} "
                        "under interleaved_1f1b")  # fmt: skip
        check_value(spec.batch_size % micro == 0, "TRAIN.BATCH_SIZE",
                    spec.batch_size, f"must be a multiple of the {micro} "
                    "pipeline micro-batches (DIST.PIPELINE.MICROBATCHES)")  # fmt: skip

    @classmethod
    def parallel_dims(cls, spec: StrategySpec, world_size: int) -> ParallelDims:
        return ParallelDims(world_size, pp=spec.pipeline.stages)

    @classmethod
    def check_layout(
        cls, spec: StrategySpec, world_size: int, skeleton: Callable[[], nn.Module]
    ) -> None:
        plan_split(skeleton(), spec.pipeline, spec.arch)

    def __init__(self, spec: StrategySpec):
        super().__init__(spec)
        self.pipe = spec.pipeline
        self.stages, self.pieces = self.pipe.stages, self.pipe.pieces
        self.micro = self.pipe.micro_batches
        # Set by each train_step, before its schedule computes a loss.
        self.step_loss: Callable[..., torch.Tensor] | None = None

    # --- the model ------------------------------------------------------- #
    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.dims.check()  # refused before the processes start
        mesh = self.mesh
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.stage = mesh.get_local_rank("pp")
        self.dp_size = self.dims.dp
        base = du.get_rank() - self.stage
        steps, bounds = plan_split(model, self.pipe, self.spec.arch)
        logger.info(
            "pipeline: %d stages x %d data-parallel, %s schedule, %d micro-batches; "
            "split %s:\n%s",
            self.stages,
            self.dp_size,
            self.pipe.schedule,
            self.micro,
            "as DIST.PIPELINE.SPLIT says" if self.pipe.split
            else "balanced by parameters",
            describe_split(model, steps, bounds),
        )  # fmt: skip
        self.whole = _WholeShapes(model)
        self.whole_names = whole_optimizer_order(model, self.spec.param_groups)
        ends = [*bounds[1:], len(steps)]
        self.indices = list(range(self.stage, self.pieces, self.stages))
        mine = [steps[bounds[i] : ends[i]] for i in self.indices]
        part = StagePart(model, [step for piece in mine for step in piece])
        part.to(self.device)
        broadcast_from_first_rank(model, part, self.device)
        pieces = [StagePart(part, piece) for piece in mine]

        def rank_of(index: int) -> int:
            return base + index % self.stages

        self.first, self.last = 0 in self.indices, self.pieces - 1 in self.indices
        route = (self.pp_group, self.pieces - 1, rank_of)
        self.relay = PipelineForward(pieces, self.indices, route)
        self.schedule = self._schedule(pieces)
        return part

    def _schedule(self, pieces: list[StagePart]):
        stages = [
            PipelineStage(
                ShapesUncounted(piece),
                index,
                self.pieces,
                self.device,
                group=self.pp_group,
            )
            for piece, index in zip(pieces, self.indices)
        ]
        kind = SCHEDULES[self.pipe.schedule]
        first = stages if kind is ScheduleInterleaved1F1B else stages[0]
        # scale_grads=False: the loss is divided here, by micro-batches and
        # accumulation steps, so gradients accumulate over schedule steps.
        return kind(first, self.micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.step_loss is not None  # the schedule runs in train_step
        return self.step_loss(logits, target)

    def describe(self, model: nn.Module) -> str:
        return (
            f"pipeline ({self.stages} stages x {self.dp_size} data-parallel, "
            f"{self.pipe.schedule}, {self.micro} micro-batches per batch)"
        )

    def holds_outputs(self, model: nn.Module) -> bool:
        return self.last

    def reads_images(self, model: nn.Module) -> bool:
        return self.first

    # --- training -------------------------------------------------------- #
    def train_step(
        self,
        state: TrainState,
        micro_batches: Iterable[MicroBatch],
        meter: MetricSums,
        loss_fn: TrainLoss,
    ) -> bool:
        """Each batch through the schedule; gradients averaged over the
        data-parallel replicas, clipped by the norm over all stages."""
        accum, seen = state.plan.accum, []

        def step_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(logits, target)
            seen.append(loss.detach())
            return loss / (self.micro * accum)

        self.step_loss = step_loss
        for micro, (images, targets, loss_targets) in enumerate(micro_batches):
            if micro == 0:
                state.optimizer.zero_grad(set_to_none=True)
            args = (images,) if self.first else ()
            target = loss_targets if self.last else None
            with autocast(self.device, state.amp_dtype):
                logits = self.schedule.step(*args, target=target)
            if self.last:
                # The first step's metadata inference computes a loss too.
                losses = torch.stack(seen[-self.micro :])
                loss_sum = losses.sum() * (len(targets) // self.micro)
                meter.update(loss_sum, logits.detach(), targets)
                seen.clear()
        params = list(state.model.parameters())
        average_gradients(params, self.dp_group, self.dp_size)
        clip, state.grad_norm = self.spec.clip_grad_norm, None
        if clip > 0 or state.norm_wanted:
            norm = self.gradient_norm(params)
            if clip > 0:  # by the norm of the gradients of all stages together
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
            state.grad_norm = norm if state.norm_wanted else None
        return step_optimizer(state.model, state.optimizer, state.scaler, 0.0).taken

    def gradient_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The norm of the gradients of all stages together (the replicas of
        a stage hold the same, averaged)."""
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else None
        squared = torch.zeros((), device=self.device) if local is None else local**2
        dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()

    # --- evaluation ------------------------------------------------------ #
    def eval_model(self, model: nn.Module) -> nn.Module:
        """The relay through the stages (each stage's replicas agree on their
        buffers: the BatchNorm statistics of the first pipeline)."""
        if self.dp_size > 1:
            for buffer in model.buffers():
                dist.broadcast(buffer, du.get_rank() % self.stages, group=self.dp_group)
        return self.relay

    # --- state in our checkpoint layout ---------------------------------- #
    def model_state_dict(self, model: nn.Module) -> dict:
        """Gathered from the first pipeline's stages on rank 0 ({} elsewhere),
        in the whole model's order; a collective.  The stages travel in host
        memory to rank 0 only: every GPU holds its own stage and no more."""
        first_pipeline = du.get_rank() < self.stages
        own = {}
        if first_pipeline:
            own = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        pieces = du.gather_object_on_main(own)
        if pieces is None:
            return {}
        merged = {k: v for piece in pieces for k, v in piece.items()}
        return {k: merged[k] for k in self.whole.shapes}

    def load_model_state(self, model: nn.Module, weights: dict, strict=True) -> None:
        """This stage's entries of a whole state_dict."""
        own = model.state_dict()
        model.load_state_dict({k: weights[k] for k in own if k in weights}, strict)

    def load_model_weights(self, model, weights, path, finetune_classes=None):
        """Checked against the whole model; each stage loads its entries."""

        def load(whole: dict, strict: bool) -> None:
            self.load_model_state(model, whole, strict)

        return cp.load_model_weights(self.whole, weights, path, load, finetune_classes)

    def optimizer_state_dict(self, model, optimizer) -> dict:
        """This stage's optimizer state keyed by parameter name."""
        return get_optimizer_state_dict(model, optimizer)

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        """This stage's entries of a whole optimizer state (keyed by index in
        the whole model's order, or by name)."""
        state = grouped_by_list(state)
        if not keyed_by_name(state):
            indices = list(range(len(self.whole_names)))
            state = rekey_optimizer_state(state, indices, self.whole_names)
        own = own_groups_by_name(state, model, optimizer)
        set_optimizer_state_dict(model, optimizer, own)

    def save_weights(self, model, optimizer, ema, writer, name: str) -> dict:
        """Every stage writes its pieces (DCP): the model, the optimizer by
        parameter name, the EMA; the replicas of a stage write them once."""
        shards = {
            MODEL: model.state_dict(),
            OPTIMIZER: grouped_by_name(get_optimizer_state_dict(model, optimizer)),
        }
        if ema is not None:
            shards[EMA] = ema.tensors()
        folder, manifest = writer.sharded(name, shards)
        return sharded_entries(folder, manifest)

    def load_weights(self, model, optimizer, saved, ema) -> bool:
        """Each stage reads its own pieces, whatever layout saved them."""
        if not saved.is_sharded:
            return super().load_weights(model, optimizer, saved, ema)
        directory = cp.shards_of(saved.path, saved.state)
        shards = {
            MODEL: model.state_dict(),
            OPTIMIZER: grouped_by_name(get_optimizer_state_dict(model, optimizer)),
        }
        cp.load_shards(shards, directory)
        model.load_state_dict(shards[MODEL])
        self.load_optimizer_state(model, optimizer, shards[OPTIMIZER])
        if ema is None or not saved.has_ema:
            return False
        ema.load_shards(directory, saved.ema_counters)
        return True


__all__ = ["PipelineStrategy", "plan_split"]
