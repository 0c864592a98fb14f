"""Peak memory per rank of a candidate plan, measured with fake tensors in
one process: nothing is allocated, a few configurations are traced once, and
each candidate is composed from them in microseconds.

The traces (:mod:`distribuuuu.plan.tracing`) run the engine's own training
step, its ordering of gradients, optimizer step and EMA included, each at
two batch sizes and with activation checkpointing as the candidate has it:

- the whole model in one process: what ddp, zero1, fsdp, hsdp and DeepSpeed
  are composed from;
- the blocks split over ``degree`` ranks of tensor parallelism, rank 0 of a
  fake world of ``degree`` (one trace per degree);
- the model's chain step by step, for a pipeline's stages
  (:mod:`distribuuuu.plan.stages`).

Every traced operation's bytes are a line in the batch, so any micro-batch
is read off them, and a phase's peak is found again where part of what it
holds is sharded.  What the model's shapes tell is exact: FSDP2's shards of
each parameter, ZeRO-1's partition of the optimizer state, the blocks FSDP
gathers.  Per strategy:

- **ddp**: the whole model's step, plus DDP's gradient buckets (a copy of
  the gradients, ``gradient_as_bucket_view`` being off), which DDP's C++
  reducer allocates where fake tensors cannot reach.
- **zero1**: ddp's, with this rank's share of the optimizer state under
  ``ZeroRedundancyOptimizer``'s partition (largest parameters first, each to
  the rank holding least).
- **fsdp / hsdp**: parameters, gradients, optimizer state and EMA sharded over
  the shard group as FSDP2 shards them (dim 0, rank 0's piece the largest),
  plus the root's parameters and two blocks gathered (the one computing and
  the one prefetched).
- **tensor parallel**: its own trace; over fsdp, sharded again over the
  replicas as FSDP shards the split model.
- **pipeline**: per stage, see :mod:`distribuuuu.plan.stages`.
- **DeepSpeed** 1/2/3: analytic (its engine flattens real storage, which
  fake tensors have not), from the whole model's trace: see
  :func:`_deepspeed`.

A fragmentation factor multiplies the peak: 1.0 on a CPU, whose tracker
counts exactly the storages alive; a GPU's caching allocator holds more.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from distribuuuu.models import find_blocks
from distribuuuu.plan.candidate import OFFLOAD_ALL, OFFLOAD_NONE, Candidate
from distribuuuu.plan.stages import ChainTrace, StageRun, pipeline_peak, trace_chain
from distribuuuu.plan.tracing import (
    StepTrace,
    TraceSpec,
    build_meta_model,
    fake_world,
    quiet,
    trace_steps,
)

MIB = 2**20
# What a rank holds, as MemoryEstimate names the parts.
PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "ema")
# The two batch sizes each configuration is traced at.
TRACED_BATCHES = (2, 4)
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py, 0.19): the bucket
# of gradients being reduced (fp32 elements, allocated whole at every
# backward's start), ZeRO-3's parameters kept whole on every rank (fewer
# elements than this).
DEEPSPEED_REDUCE_BUCKET = 500_000_000
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One rank's peak memory in MiB (its largest rank's), and what it holds
    at that peak: parameters (and buffers; gathered ones too), gradients
    (DDP's buckets too), optimizer state, activations (the batch too),
    temporaries of the backward and the optimizer, and the EMA.

    ``peak_mib`` is their sum times the fragmentation factor.  ``method``
    says how it was found: ``traced`` (this layout's own trace), ``composed``
    (from traces of other layouts and the model's shapes) or ``analytic``.
    """

    peak_mib: float
    parameters_mib: float
    gradients_mib: float
    optimizer_mib: float
    activations_mib: float
    temporaries_mib: float
    ema_mib: float
    method: str

    @classmethod
    def of(
        cls,
        parts: dict[str, float],
        method: str,
        fragmentation: float = 1.0,
    ) -> MemoryEstimate:
        """From bytes by part (the keys of the ``*_mib`` fields)."""
        mib = {f"{name}_mib": max(parts.get(name, 0.0), 0.0) / MIB for name in PARTS}
        return cls(peak_mib=sum(mib.values()) * fragmentation, method=method, **mib)


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the model's shapes tell without a trace, in bytes as stored."""

    parameters: tuple[tuple[int, int, int], ...]  # (numel, rows, element size)
    groups: tuple[tuple[int, ...], ...]  # numel of each parameter, by optimizer group
    float_buffers: int  # BatchNorm's statistics: followed by the EMA
    buffers: int
    blocks: tuple[int, ...]  # parameter bytes of each block (FSDP's units)

    @classmethod
    def of(
        cls, model: nn.Module, param_groups: Callable[[nn.Module], list]
    ) -> ModelShapes:
        trainable = [p for p in model.parameters() if p.requires_grad]
        try:
            groups = param_groups(model)
        except ValueError:  # a spec without an optimizer recipe
            groups = [{"params": trainable}]
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        return cls(
            parameters=tuple(
                (p.numel(), p.shape[0] if p.dim() else 1, p.element_size())
                for p in trainable
            ),
            groups=tuple(tuple(p.numel() for p in group["params"]) for group in groups),
            float_buffers=sum(
                b.numel() * b.element_size()
                for b in model.buffers()
                if b.is_floating_point()
            ),
            buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
            blocks=tuple(
                sum(p.numel() * p.element_size() for p in block.parameters())
                for block in find_blocks(model)
            ),
        )

    @property
    def total(self) -> int:
        """Bytes of the trainable parameters."""
        return sum(numel * size for numel, _, size in self.parameters)

    @property
    def element_size(self) -> int:
        """Bytes per element of the parameters as stored."""
        return self.parameters[0][2] if self.parameters else 4

    def fsdp_shard(self, ranks: int) -> int:
        """Bytes of rank 0's shards under FSDP2 over ``ranks`` (each
        parameter cut along its first dimension, rank 0's piece the largest)."""
        return sum(
            math.ceil(rows / ranks) * (numel // max(rows, 1)) * size
            for numel, rows, size in self.parameters
        )

    def zero1_partition(self, ranks: int) -> int:
        """Bytes of the parameters whose optimizer state the fullest rank
        keeps under ZeroRedundancyOptimizer (per group, the largest
        parameter first to the rank holding least)."""
        held = [0] * ranks
        for group in self.groups:
            for numel in sorted(group, reverse=True):
                held[held.index(min(held))] += numel
        return max(held) * self.element_size

    def gathered(self, element_size: int | None) -> tuple[int, int]:
        """Bytes of the largest block and of the rest of the model (the
        root's FSDP unit) when gathered in ``element_size`` bytes (None: as
        stored)."""
        largest = max(self.blocks, default=0)
        root = self.total - sum(self.blocks)
        if element_size is None:
            return largest, root
        stored = self.element_size
        return largest * element_size // stored, root * element_size // stored


class MemoryModel:
    """Peak memory per rank of the candidates of one run.

    Traces what the candidates asked about need, once each: the whole model
    in one process, the blocks split over ``degree`` ranks (tensor
    parallel), the chain step by step (pipelines), with activation
    checkpointing as each candidate has it; then composes each candidate
    from them.  ``fragmentation`` multiplies each peak.
    """

    def __init__(self, spec: TraceSpec, fragmentation: float = 1.0):
        self.spec, self.fragmentation = spec, fragmentation
        self.batches = TRACED_BATCHES
        self._traced: dict[tuple, Any] = {}
        self._shapes: ModelShapes | None = None

    def _once(self, key: tuple, trace: Callable[[], Any]) -> Any:
        if key not in self._traced:
            self._traced[key] = trace()
        return self._traced[key]

    # --- what is traced, once ------------------------------------------- #
    @property
    def shapes(self) -> ModelShapes:
        """The model's shapes (its parameters, groups, blocks)."""
        if self._shapes is None:
            with quiet():
                model = build_meta_model(self.spec.model)
            self._shapes = ModelShapes.of(model, self.spec.strategy.param_groups)
        return self._shapes

    def whole(self, act_ckpt: bool) -> StepTrace:
        """The whole model's step in one process."""
        return self.split(1, act_ckpt)

    def split(self, degree: int, act_ckpt: bool) -> StepTrace:
        """The step of rank 0 of ``degree`` ranks that split the blocks
        (tensor parallel, one replica; 1: the whole model alone)."""
        spec = dataclasses.replace(
            self.spec.strategy,
            name="ddp",
            tensor_parallel=degree,
            activation_checkpointing=act_ckpt,
            accum_steps=1,
        )

        def trace() -> StepTrace:
            if degree == 1:
                return trace_steps(self.spec, spec, self.batches)
            with fake_world(degree, 0):
                return trace_steps(self.spec, spec, self.batches)

        return self._once(("split", degree, act_ckpt), trace)

    def chain(self, act_ckpt: bool) -> ChainTrace:
        """The model's chain, step by step (for pipeline stages)."""

        def trace() -> ChainTrace:
            return trace_chain(self.spec, self.batches, act_ckpt)

        return self._once(("chain", act_ckpt), trace)

    # --- what the traces tell -------------------------------------------- #
    @property
    def optimizer_factor(self) -> float:
        """Bytes of optimizer state per byte of trainable parameters (as the
        forward holds it, the step's temporaries gone)."""
        phase = self.whole(False).forward
        held = max((line[3] for line in phase.lines), default=0)
        return held / max(self.shapes.total, 1)

    @property
    def ema_bytes(self) -> int:
        """The EMA's bytes (parameters and float buffers), 0 without."""
        if not self.spec.ema:
            return 0
        return self.shapes.total + self.shapes.float_buffers

    @property
    def compute_size(self) -> int | None:
        """Bytes per element of gathered parameters (the autocast dtype's)."""
        dtype = self.spec.strategy.amp_dtype
        return None if dtype is None else torch.empty((), dtype=dtype).element_size()

    # --- candidates ------------------------------------------------------ #
    def estimate(self, candidate: Candidate) -> MemoryEstimate:
        """The peak memory of ``candidate``'s fullest rank."""
        compose = _COMPOSERS.get(candidate.strategy)
        if compose is None:
            raise ValueError(
                f"the planner has no memory model of DIST.STRATEGY {candidate.strategy}"
            )
        parts, method = compose(self, candidate)
        return MemoryEstimate.of(parts, method, self.fragmentation)


def supported(name: str) -> bool:
    """Whether the planner has a memory model of strategy ``name``."""
    return name in _COMPOSERS


def _peak(
    trace: StepTrace,
    batch: float,
    fixed: Mapping[str, float],
    grads: float = 1.0,
    optimizer: float = 1.0,
) -> dict[str, float]:
    """The parts of the fuller phase of ``trace`` at ``batch``: ``fixed``
    plus the phase's parameters and its fullest operation's parts, with its
    gradients and optimizer state scaled by ``grads`` and ``optimizer``."""
    best: dict[str, float] = {}
    for phase in (trace.forward, trace.backward):
        held = phase.peak(batch, grads, optimizer)
        parts = {name: fixed.get(name, 0.0) for name in PARTS}
        parts["parameters"] += phase.parameters
        for index, name in enumerate(PARTS[1:5], start=1):
            parts[name] += held[index]
        if sum(parts.values()) > sum(best.values(), -1.0):
            best = parts
    return best


def _replicated(memory: MemoryModel, candidate: Candidate) -> tuple[dict, str]:
    """ddp and zero1: the whole model's step beside DDP's buckets (ZeRO-1
    keeps this rank's share of the optimizer state)."""
    if (candidate.tensor_parallel or 1) > 1:
        return _tensor_parallel(memory, candidate, shard_ranks=1)
    dp, shapes = candidate.data_parallel, memory.shapes
    optimizer = 1.0
    if candidate.strategy == "zero1" and dp > 1:
        optimizer = shapes.zero1_partition(dp) / max(shapes.total, 1)
    fixed = {
        "gradients": shapes.total if dp > 1 else 0,  # DDP's buckets
        "ema": memory.ema_bytes,
    }
    trace = memory.whole(candidate.act_ckpt)
    return _peak(trace, candidate.micro_batch, fixed, 1.0, optimizer), "composed"


def _sharded(memory: MemoryModel, candidate: Candidate) -> tuple[dict, str]:
    """fsdp and hsdp: FSDP2 over the shard group (hsdp's, or all replicas)."""
    if (candidate.tensor_parallel or 1) > 1:
        return _tensor_parallel(memory, candidate, candidate.data_parallel)
    ranks, shapes = candidate.shard_size or candidate.data_parallel, memory.shapes
    if ranks == 1:  # one process: the plain model
        return _replicated(memory, dataclasses.replace(candidate, strategy="ddp"))
    shard = shapes.fsdp_shard(ranks)
    share = shard / max(shapes.total, 1)
    block, root = shapes.gathered(memory.compute_size)
    trace = memory.whole(candidate.act_ckpt)
    # The whole model's parameters counted in the trace become this rank's
    # shards, and the root's and two blocks' gathered ones.
    fixed = {
        "parameters": shard + 2 * block + root - shapes.total,
        "ema": shard + shapes.float_buffers if memory.spec.ema else 0,
    }
    return _peak(trace, candidate.micro_batch, fixed, share, share), "composed"


def _tensor_parallel(
    memory: MemoryModel, candidate: Candidate, shard_ranks: int
) -> tuple[dict, str]:
    """Tensor parallelism of ``tensor_parallel`` ranks per block (its own
    trace), the replicas under DDP's averaging (``shard_ranks`` 1) or FSDP
    over ``shard_ranks`` replicas (composed: its shards of the split model)."""
    degree, shapes = candidate.tensor_parallel or 1, memory.shapes
    trace = memory.split(degree, candidate.act_ckpt)
    local = trace.backward.parameters / max(shapes.total + shapes.buffers, 1)
    share = 1 / shard_ranks
    fixed = {"ema": memory.ema_bytes * local * share}
    if shard_ranks > 1:  # FSDP's shards of the split model, two blocks gathered
        block, root = shapes.gathered(memory.compute_size)
        held = trace.backward.parameters
        fixed["parameters"] = (2 * block + root) * local - held * (1 - share)
    parts = _peak(trace, candidate.micro_batch, fixed, share, share)
    return parts, "traced" if shard_ranks == 1 else "composed"


def _pipeline(memory: MemoryModel, candidate: Candidate) -> tuple[dict, str]:
    """Each stage composed from the model's chain; the fullest counts."""
    spec = memory.spec
    plan = candidate.strategy_spec(spec.strategy, spec.pipeline_micro_batches)
    run = StageRun(
        pipeline=plan.pipeline,
        batch=candidate.micro_batch,
        data_parallel=candidate.data_parallel,
        optimizer_factor=memory.optimizer_factor,
        ema=spec.ema,
        image_size=spec.image_size,
    )
    return pipeline_peak(memory.chain(candidate.act_ckpt), run), "composed"


def _deepspeed(memory: MemoryModel, candidate: Candidate) -> tuple[dict, str]:
    """DeepSpeed ZeRO 1/2/3 from the whole model's step (analytic: its
    engine flattens real storage, which fake tensors have not).

    The module's parameters become views of one flat buffer (ZeRO-3: this
    rank's partition of it, the parameters below the persistence threshold
    kept whole, and two blocks gathered); beside it an fp32 copy of this
    rank's partition and its optimizer state (both in host memory when
    offloaded), the partition's averaged gradients (ZeRO-3: the gradients
    partitioned as they are reduced), and the bucket of gradients being
    reduced, allocated at its default size whatever the model's.
    """
    stage, dp = candidate.zero_stage or 1, candidate.data_parallel
    # Offloaded state leaves a GPU's memory; a CPU's is where it goes.
    device = memory.spec.strategy.device
    on_cpu = device is not None and device.type == "cpu"
    offloaded = (candidate.offload or OFFLOAD_NONE) != OFFLOAD_NONE and not on_cpu
    shapes = memory.shapes
    total, size = shapes.total, shapes.element_size
    partition = math.ceil(total / dp)
    parameters = 0.0 if offloaded else float(partition)  # the fp32 copy
    grads = 1.0
    if stage == 3:
        kept = sum(
            numel * size
            for numel, _, _ in shapes.parameters
            if numel < DEEPSPEED_PERSISTENCE_THRESHOLD
        )
        block, root = shapes.gathered(memory.compute_size)
        all_out = offloaded and candidate.offload == OFFLOAD_ALL
        partitioned = 0 if all_out else (total - kept) / dp
        parameters += kept + partitioned + 2 * block + root - total
        grads = 1.0 / dp
    fixed = {
        "parameters": parameters,
        "gradients": DEEPSPEED_REDUCE_BUCKET * 4 + partition,
        "ema": memory.ema_bytes,
    }
    optimizer = 0.0 if offloaded else partition / max(total, 1)
    trace = memory.whole(candidate.act_ckpt)
    return _peak(trace, candidate.micro_batch, fixed, grads, optimizer), "analytic"


_COMPOSERS: dict[str, Callable[[MemoryModel, Candidate], tuple[dict, str]]] = {
    "ddp": _replicated,
    "zero1": _replicated,
    "fsdp": _sharded,
    "hsdp": _sharded,
    "pipeline": _pipeline,
    "deepspeed": _deepspeed,
}
