"""Time per optimizer step of a candidate plan: its compute, the collectives
its strategy issues, and the pipeline's bubble.

*Compute*: the model's FLOPs per image (:mod:`distribuuuu.plan.flops`; plus
each block's forward again under activation checkpointing) over the
achieved FLOP/s of one device (a measured efficiency x the device's peak,
:mod:`distribuuuu.plan.calibrate`).

*Collectives*: each costs ``alpha + factor x bytes / beta`` on its group's
link (:mod:`distribuuuu.plan.links`).  Ranks lie on the mesh as the
strategies build it (:mod:`distribuuuu.strategies.mesh`): ``tp``
neighbours, then ``pp``, then ``dp``; HSDP's ``shard`` groups are neighbours
and ``replicate`` strides over them.

*Pipeline*: a step of ``M`` micro-batches over ``S`` stages takes ``M + S - 1``
slots of the slowest stage (GPipe and 1F1B alike); with ``V`` model chunks per
process (interleaved 1F1B) the bubble shrinks to ``(S - 1) / V`` slots, so its
share of the step is ``(S - 1) / (V M + S - 1)`` (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21,
sec. 2.2.1-2.2.2: bubble time fraction ``(p - 1) / m``, and ``(1 / v) (p - 1) /
m`` interleaved, relative to the ideal time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from distribuuuu.models.chains import balanced_bounds
from distribuuuu.plan.flops import ModelFlops
from distribuuuu.plan.links import (
    Cluster,
    all_reduce_s,
    gather_s,
    group_link,
    send_s,
)

MIB = 2**20

# DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel:
# bucket_cap_mb=25, and dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, for the
# first bucket, which holds the last layers' gradients).
DDP_BUCKET_BYTES = 25 * MIB
DDP_FIRST_BUCKET_BYTES = 1 * MIB
# DeepSpeed ZeRO-1/2's reduce_bucket_size and allgather_bucket_size
# defaults (elements; deepspeed/runtime/zero/config.py).
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000


class Plan(Protocol):
    """What the cost model reads of a candidate (:mod:`distribuuuu.plan.candidate`)."""

    @property
    def strategy(self) -> str: ...
    @property
    def tensor_parallel(self) -> int | None: ...
    @property
    def pipeline_stages(self) -> int | None: ...
    @property
    def pipeline_schedule(self) -> str | None: ...
    @property
    def data_parallel(self) -> int: ...
    @property
    def shard_size(self) -> int | None: ...
    @property
    def zero_stage(self) -> int | None: ...
    @property
    def offload(self) -> object: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def accum_steps(self) -> int: ...
    @property
    def act_ckpt(self) -> bool: ...


@dataclass(frozen=True)
class Workload:
    """The model and the run's precision, as the cost model reads them."""

    flops: ModelFlops
    param_bytes: int = 4  # per parameter as stored (and as gradients reduce)
    compute_param_bytes: int = 4  # as gathered to compute (2 under bf16/fp16)
    activation_bytes: int = 4  # per element between blocks (2 under autocast)
    pipeline_microbatches: int = 0  # DIST.PIPELINE.MICROBATCHES; 0: 2 x stages
    virtual_stages: int = 2  # DIST.PIPELINE.VIRTUAL_STAGES (interleaved_1f1b)
    # What DDP's all-reduces carry per byte of gradients (DIST.DDP.COMM_HOOK:
    # 0.5 under fp16 and bf16, PowerSGD's factors' share of the numbers).
    gradient_share: float = 1.0
    # Seconds of the optimizer's step over all the parameters on one device;
    # a rank steps its share of them.
    optimizer_s: float = 0.0
    # Seconds the optimizer's step spends per parameter tensor that is a
    # DTensor (FSDP's shards, tensor-parallel blocks): DTensor's dispatch,
    # whatever the tensor's size.
    sharded_tensor_s: float = 0.0
    # Seconds FSDP's passes spend per gather or reduction of a unit beyond
    # the wire's (hooks, copies, DTensor): exposed on a CPU.
    sharded_collective_s: float = 0.0

    @classmethod
    def of(
        cls, flops: ModelFlops, amp_dtype: torch.dtype | None, **keys: Any
    ) -> Workload:
        """The workload of a run in ``amp_dtype`` (None: full precision):
        float32 parameters and gradients; under autocast, activations and
        FSDP's gathered parameters in its dtype.  ``keys``: the other fields."""
        low = 4 if amp_dtype is None else torch.finfo(amp_dtype).bits // 8
        return cls(flops, compute_param_bytes=low, activation_bytes=low, **keys)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one optimizer step, and of what it is made."""

    step_s: float
    compute_s: float
    comm_s: float  # collectives the compute does not hide
    bubble_s: float = 0.0  # a pipeline's idle slots


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The share of a pipeline step that a stage idles:
    ``(S - 1) / (V M + S - 1)`` (``V`` = 1: GPipe, 1F1B)."""
    return (stages - 1) / (virtual * micro_batches + stages - 1)


def _degree(value: int | None) -> int:
    return value or 1


def _offloads(plan: Plan) -> bool:
    return bool(plan.offload) and plan.offload != "none"


def _per_image_flops(flops: ModelFlops, act_ckpt: bool, tensor_parallel: int):
    """(forward + backward, backward) FLOPs of one image on one rank: a
    tensor-parallel rank computes its share of each block; activation
    checkpointing runs each block's forward twice."""
    blocks = sum(block.forward_flops for block in flops.blocks)
    scale = 1.0
    total = flops.per_image
    if tensor_parallel > 1 and flops.forward > 0:
        block_share = blocks / flops.forward  # of forward and backward alike
        scale = 1 - block_share + block_share / tensor_parallel
        total *= scale
    if act_ckpt:
        total += blocks / tensor_parallel
    return total, flops.backward * scale


def _units(flops: ModelFlops) -> list[int]:
    """Parameters of each unit FSDP gathers: the blocks, then the rest."""
    blocks = [block.parameters for block in flops.blocks]
    return [*blocks, max(flops.parameters - sum(blocks), 0)]


def ddp_exposed_s(
    cluster: Cluster, unit_bytes: list[float], backward_s: float, size: int
) -> float:
    """Seconds DDP's all-reduces outlast the last backward pass.

    Gradients fill buckets (1 MiB, then 25 MiB each) from the last unit to
    the first (``unit_bytes`` in forward order), and each bucket's
    all-reduce starts once its gradients are ready and the previous one is
    done.  Gradients are taken to be ready in proportion to the bytes before
    them: a simplification (their FLOPs would be closer).
    """
    total = max(sum(unit_bytes), 1.0)
    ready_bytes, bucket, cap, finish = 0.0, 0.0, DDP_FIRST_BUCKET_BYTES, 0.0
    for nbytes in reversed(unit_bytes):
        left = nbytes
        while left > 0:
            take = min(left, cap - bucket)
            left, bucket, ready_bytes = left - take, bucket + take, ready_bytes + take
            if bucket >= cap:
                ready = backward_s * ready_bytes / total
                finish = max(finish, ready) + all_reduce_s(cluster, bucket, size)
                bucket, cap = 0.0, DDP_BUCKET_BYTES
    if bucket > 0:
        finish = max(finish, backward_s) + all_reduce_s(cluster, bucket, size)
    return max(finish - backward_s, 0.0)


@dataclass(frozen=True)
class _Step:
    """One candidate's step as the collectives' cost functions read it."""

    plan: Plan
    work: Workload
    cluster: Cluster
    compute_s: float  # of the whole step on one rank
    backward_s: float  # of one micro-batch's backward pass

    @property
    def tp(self) -> int:
        return _degree(self.plan.tensor_parallel)

    @property
    def dp(self) -> int:
        return self.plan.data_parallel

    def unit_params(self) -> list[float]:
        """Parameters of each unit on one rank (a tensor-parallel rank holds
        its share of each block)."""
        units = _units(self.work.flops)
        return [u / self.tp for u in units[:-1]] + [units[-1]]

    def hidden(self, comm_s: float, first_and_last: float) -> float:
        """The part of ``comm_s`` compute does not hide: all of it where the
        rank waits for each collective, else what outlasts the compute (never
        less than the first gather and the last reduction)."""
        if not self.cluster.overlap:
            return comm_s
        return max(comm_s - self.compute_s, min(first_and_last, comm_s))

    def offload_s(self, nbytes: float) -> float:
        """Copies of ``nbytes`` between device and host, where state is
        offloaded (nothing to copy on a CPU, which has no separate host)."""
        host = self.cluster.host
        if not _offloads(self.plan) or host is None:
            return 0.0
        return host.seconds(nbytes)


def _ddp_s(step: _Step) -> float:
    """DDP: gradients all-reduced in buckets during the last backward pass
    (on a CPU within one node, where gloo's copies take the cores that the
    compute keeps busy, after it; across nodes the wire's time runs beside
    the backward, as measured over shaped links); under tensor parallelism,
    in one all-reduce after it."""
    per_param = step.work.param_bytes * step.work.gradient_share
    unit_bytes = [u * per_param for u in step.unit_params()]
    if step.tp > 1:
        return all_reduce_s(step.cluster, sum(unit_bytes), step.dp, step.tp)
    if not step.cluster.overlap and step.cluster.nodes == 1:
        return ddp_exposed_s(step.cluster, unit_bytes, 0.0, step.dp)
    return ddp_exposed_s(step.cluster, unit_bytes, step.backward_s, step.dp)


def _zero1_s(step: _Step) -> float:
    """ZeRO-1 (ZeroRedundancyOptimizer over DDP): DDP's all-reduces, then
    the parameters broadcast by the rank that updated them, one collective
    per rank (its bucket: strategies/zero1.py takes
    ``parameters_as_bucket_view``)."""
    n = step.dp
    if n <= 1:
        return 0.0
    link, share = group_link(step.cluster, n)
    nbytes = step.work.flops.parameters * step.work.param_bytes
    broadcasts = n * link.latency_s
    broadcasts += (n - 1) / n * nbytes / (link.bytes_per_s * share)
    return _ddp_s(step) + broadcasts


def _sharded_s(
    step: _Step, size: int, stride: int, *, reduce_every: bool, machinery: bool
) -> tuple:
    """Gathers and reductions of units sharded over ``size`` ranks: each
    unit gathered for its forward and again for its backward (the root
    once, it is not resharded between them), its gradients reduce-scattered
    on the last micro-batch (on every one with ``reduce_every``); with
    ``machinery``, FSDP's own work around each of them.  Returns (seconds,
    first gather + last reduction)."""
    cluster, work, plan = step.cluster, step.work, step.plan
    units = step.unit_params()
    gathers = [
        gather_s(cluster, u * work.compute_param_bytes, size, stride) for u in units
    ]
    reduces = [
        gather_s(cluster, u * work.param_bytes, size, stride, scatter=True)
        for u in units
    ]
    per_micro = 2 * sum(gathers) - gathers[-1]
    reductions = sum(reduces) * (plan.accum_steps if reduce_every else 1)
    if machinery:  # around each of the gathers and reductions above
        held = [u for u in units if u > 0]
        gathered = 2 * len(held) - (units[-1] > 0)
        per_micro += gathered * work.sharded_collective_s
        reductions += len(held) * work.sharded_collective_s
    shard_bytes = sum(units) / max(size, 1)
    offload = step.offload_s(shard_bytes * work.compute_param_bytes * 2)
    offload = offload * plan.accum_steps + step.offload_s(
        shard_bytes * work.param_bytes
    )
    seconds = per_micro * plan.accum_steps + reductions + offload
    return seconds, gathers[-1] + reduces[0]


def _fsdp_s(step: _Step) -> float:
    """FSDP2 over the data-parallel ranks (``tp`` apart)."""
    seconds, edges = _sharded_s(
        step, step.dp, step.tp, reduce_every=False, machinery=True
    )
    return step.hidden(seconds, edges)


def _hsdp_s(step: _Step) -> float:
    """HSDP: FSDP within groups of ``shard_size`` neighbours, and each
    unit's gradient shard all-reduced across the groups (``replicate``)."""
    shard = _degree(step.plan.shard_size)
    replicas = max(step.dp // shard, 1)
    seconds, edges = _sharded_s(step, shard, 1, reduce_every=False, machinery=True)
    nbytes = step.work.param_bytes / shard
    seconds += sum(
        all_reduce_s(step.cluster, u * nbytes, replicas, shard)
        for u in step.unit_params()
    )
    return step.hidden(seconds, edges)


def _buckets_s(step: _Step, nbytes: float) -> float:
    """DeepSpeed's bucketed reduce-scatters (or all-gathers, which cost the
    same) of ``nbytes`` over the data-parallel ranks."""
    buckets = max(math.ceil(step.work.flops.parameters / DEEPSPEED_BUCKET_ELEMENTS), 1)
    return buckets * gather_s(step.cluster, nbytes / buckets, step.dp)


def _deepspeed_s(step: _Step) -> float:
    """DeepSpeed ZeRO: stage 1 reduce-scatters the gradients at the step's
    end, stage 2 after every micro-batch, both all-gather the updated
    parameters; stage 3 gathers and reduces per module, as FSDP does, its
    gradients reduced after every micro-batch.  Its collectives carry the
    compute dtype."""
    stage, plan, work = _degree(step.plan.zero_stage), step.plan, step.work
    if stage >= 3:
        seconds, edges = _sharded_s(
            step, step.dp, 1, reduce_every=True, machinery=False
        )
        return step.hidden(seconds, edges)
    nbytes = work.flops.parameters * work.compute_param_bytes
    reduces = _buckets_s(step, nbytes) * (plan.accum_steps if stage == 2 else 1)
    gathers = _buckets_s(step, nbytes)
    offload = step.offload_s(2 * nbytes / max(step.dp, 1))
    return reduces + gathers + offload


def _tensor_parallel_s(step: _Step) -> float:
    """Megatron's all-reduces of a block's activations: two in its forward
    and two in its backward pass (Shoeybi et al. 2019, fig. 4), two more
    where activation checkpointing runs the forward again."""
    if step.tp <= 1:
        return 0.0
    plan, work = step.plan, step.work
    per_block = 4 + 2 * plan.act_ckpt
    seconds = sum(
        per_block
        * all_reduce_s(
            step.cluster,
            plan.micro_batch * b.output_numel * work.activation_bytes,
            step.tp,
        )
        for b in work.flops.blocks
    )
    return seconds * plan.accum_steps


COLLECTIVES = {
    "ddp": _ddp_s,
    "zero1": _zero1_s,
    "fsdp": _fsdp_s,
    "hsdp": _hsdp_s,
    "deepspeed": _deepspeed_s,
}


def _pipeline_split(flops: ModelFlops, stages: int, virtual: int):
    """(forward share of the busiest process, its parameters, the largest
    activation crossing a cut, per image) when the blocks are cut into
    ``stages x virtual`` pieces balanced by parameters, as the pipeline cuts
    them (the layers before the first block go with the first piece), and
    the pieces dealt round-robin to the processes."""
    pieces, blocks = stages * virtual, flops.blocks
    if len(blocks) < pieces:
        numel = max((b.output_numel for b in blocks), default=0)
        return 1 / stages, flops.parameters / stages, numel
    starts = [*balanced_bounds([b.parameters for b in blocks], pieces), len(blocks)]
    rest_flops = flops.forward - sum(b.forward_flops for b in blocks)
    rest_params = flops.parameters - sum(b.parameters for b in blocks)
    work, params = [0.0] * stages, [0.0] * stages
    for piece in range(pieces):
        own = blocks[starts[piece] : starts[piece + 1]]
        work[piece % stages] += sum(b.forward_flops for b in own)
        params[piece % stages] += sum(b.parameters for b in own)
    work[0] += rest_flops
    params[0] += rest_params
    cuts = [blocks[start - 1].output_numel for start in starts[1:-1]]
    busiest = max(range(stages), key=work.__getitem__)
    return work[busiest] / max(flops.forward, 1.0), params[busiest], max(cuts)


def pipeline_cost(plan: Plan, work: Workload, cluster: Cluster) -> StepCost:
    """A pipeline step: ``M`` micro-batches of ``micro_batch / M`` images
    through ``S`` stages (``V`` chunks per process under interleaved 1F1B),
    the busiest process setting the pace; each slot receives an activation
    and a gradient from its neighbours; the stages' gradients all-reduced
    over the data-parallel replicas at the end."""
    stages = _degree(plan.pipeline_stages)
    virtual = work.virtual_stages if plan.pipeline_schedule == "interleaved_1f1b" else 1
    micro = min(work.pipeline_microbatches or 2 * stages, plan.micro_batch)
    per_image, _ = _per_image_flops(work.flops, plan.act_ckpt, 1)
    share, params, cut = _pipeline_split(work.flops, stages, virtual)
    images = plan.micro_batch / micro
    slot = share * (cluster.overhead_s + per_image * images / cluster.flops_per_s)
    compute = plan.accum_steps * micro * slot
    compute += work.optimizer_s * params / max(work.flops.parameters, 1)
    bubble = plan.accum_steps * (stages - 1) / virtual * slot
    transfer = send_s(cluster, cut * images * work.activation_bytes, stages)
    comm = plan.accum_steps * 2 * (virtual * micro + stages - 1) * transfer
    comm += all_reduce_s(cluster, params * work.param_bytes, plan.data_parallel, stages)
    return StepCost(compute + bubble + comm, compute, comm, bubble)


def _optimizer_step_s(plan: Plan, work: Workload) -> float:
    """Seconds of one rank's optimizer step: its share of the parameters
    (its tensor-parallel share, and of those its shard where the optimizer
    state is sharded: zero1, fsdp, DeepSpeed over the replicas, hsdp within
    its shard group), and DTensor's dispatch for each tensor that is one."""
    share = 1 / _degree(plan.tensor_parallel)
    if plan.strategy == "hsdp":
        share /= _degree(plan.shard_size)
    elif plan.strategy in ("zero1", "fsdp", "deepspeed"):
        share /= plan.data_parallel
    sharded = plan.strategy in ("fsdp", "hsdp") and plan.data_parallel > 1
    split = _degree(plan.tensor_parallel) > 1
    dtensors = work.flops.parameter_tensors if sharded or split else 0
    return work.optimizer_s * share + dtensors * work.sharded_tensor_s


def step_cost(plan: Plan, work: Workload, cluster: Cluster) -> StepCost:
    """Seconds of one optimizer step of ``plan`` (``accum_steps``
    micro-batches of ``micro_batch`` images per replica) on ``cluster``."""
    if plan.strategy == "pipeline":
        return pipeline_cost(plan, work, cluster)
    if plan.strategy not in COLLECTIVES:
        raise ValueError(
            f"no cost model for strategy {plan.strategy!r}: one of "
            f"{sorted([*COLLECTIVES, 'pipeline'])}"
        )
    tp = _degree(plan.tensor_parallel)
    per_image, backward = _per_image_flops(work.flops, plan.act_ckpt, tp)
    one_pass = cluster.overhead_s + per_image * plan.micro_batch / cluster.flops_per_s
    compute = plan.accum_steps * one_pass + _optimizer_step_s(plan, work)
    backward_s = backward * plan.micro_batch / cluster.flops_per_s
    step = _Step(plan, work, cluster, compute, backward_s)
    comm = COLLECTIVES[plan.strategy](step) + _tensor_parallel_s(step)
    return StepCost(compute + comm, compute, comm)
