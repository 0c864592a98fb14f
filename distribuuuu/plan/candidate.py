"""The plans the search weighs: :class:`Candidate` and
:func:`enumerate_candidates`.

A candidate is one way to run the job on a given world: a strategy, its
degrees (tensor parallel, pipeline stages, HSDP's shard groups, the ZeRO
stage and offload), the micro-batch one forward sees per data-parallel
replica and the accumulation steps that keep the global batch, and
activation checkpointing.  The fields that do not apply to its strategy are
None.

What each strategy takes is asked of its class, as pre-flight asks it
(:mod:`distribuuuu.strategies.chain`): its layout on the world
(``parallel_dims``), whether it splits its replicas' blocks
(``takes_tensor_parallel``), what its declarations refuse of the features the
run turns on, and its own checks of its keys and of the model.  A strategy
whose process drives several devices (``one_device_per_process`` False: dp)
is never a candidate: the plan counts one device per process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from distribuuuu.config.keys import CHOICES
from distribuuuu.models import find_blocks
from distribuuuu.strategies import STRATEGIES, Strategy, StrategySpec
from distribuuuu.strategies.chain import check_choices, check_layout
from distribuuuu.strategies.spec import DeepSpeedSpec, PipelineSpec

# What a DeepSpeed candidate offloads to host memory (its OFFLOAD_* keys).
OFFLOAD_NONE, OFFLOAD_OPTIMIZER, OFFLOAD_ALL = "none", "optimizer", "optimizer+params"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan: how the processes spread the model, and the batch geometry.

    ``micro_batch`` is TRAIN.BATCH_SIZE, the samples one forward sees per
    data-parallel replica (a pipeline's schedule step cuts it into its own
    micro-batches); ``micro_batch x accum_steps x data_parallel`` is the
    global batch.  ``data_parallel`` counts the replicas that read their own
    batches (every rank under HSDP).
    """

    strategy: str
    tensor_parallel: int | None  # DIST.TENSOR_PARALLEL; None: not taken
    pipeline_stages: int | None  # DIST.PIPELINE.STAGES
    pipeline_schedule: str | None  # DIST.PIPELINE.SCHEDULE
    data_parallel: int
    shard_size: int | None  # DIST.HSDP.SHARD_SIZE
    zero_stage: int | None  # DIST.DEEPSPEED.ZERO_STAGE
    offload: str | None  # DeepSpeed: none, optimizer or optimizer+params
    micro_batch: int
    accum_steps: int
    act_ckpt: bool

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (``tools/plan.py --json``'s candidate fields)."""
        return dataclasses.asdict(self)

    @property
    def layout(self) -> Candidate:
        """This plan at one sample per forward, without accumulation or
        checkpointing: what the model's spreading depends on."""
        return dataclasses.replace(self, micro_batch=1, accum_steps=1, act_ckpt=False)

    def strategy_spec(self, base: StrategySpec, micro_batches: int = 0) -> StrategySpec:
        """``base`` (the run's settings) running this plan; a pipeline's
        schedule cuts each batch into ``micro_batches``
        (DIST.PIPELINE.MICROBATCHES; 0: twice the stages)."""
        pipeline = base.pipeline
        if self.pipeline_stages is not None:
            pipeline = dataclasses.replace(
                pipeline,
                stages=self.pipeline_stages,
                schedule=self.pipeline_schedule or pipeline.schedule,
                micro_batches=micro_batches or 2 * self.pipeline_stages,
                split=(),
            )
        deepspeed = base.deepspeed
        if self.zero_stage is not None:
            offload = self.offload or OFFLOAD_NONE
            deepspeed = dataclasses.replace(
                deepspeed,
                zero_stage=self.zero_stage,
                offload_optimizer="none" if offload == OFFLOAD_NONE else "cpu",
                offload_params="cpu" if offload == OFFLOAD_ALL else "none",
                config="",
            )
        spec = dataclasses.replace(
            base,
            name=self.strategy,
            tensor_parallel=self.tensor_parallel or 1,
            pipeline=pipeline,
            deepspeed=deepspeed,
            batch_size=self.micro_batch,
            accum_steps=self.accum_steps,
            activation_checkpointing=self.act_ckpt,
        )
        if self.shard_size is not None:
            spec = dataclasses.replace(spec, hsdp_shard_size=self.shard_size)
        return spec


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the search asks of the run: its strategy settings (optimizer
    recipe, precision, ...), a model of its architecture without memory
    (``skeleton()``, on the meta device), the features it turns on that a
    strategy may refuse (pre-flight's ``turned_on``: feature -> the key that
    turns it on and its value), and DIST.PIPELINE.MICROBATCHES as configured
    (0: twice the stages)."""

    spec: StrategySpec
    skeleton: Callable[[], nn.Module]
    turned_on: Mapping[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    pipeline_micro_batches: int = 0


def divisors(number: int) -> list[int]:
    """The divisors of ``number``, in order."""
    return [d for d in range(1, number + 1) if number % d == 0]


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``."""
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def _takes_stages(cls: type[Strategy], base: StrategySpec, world: int) -> bool:
    probe = dataclasses.replace(base, pipeline=PipelineSpec(stages=2))
    return cls.parallel_dims(probe, world).pp == 2


def _takes_shard_size(cls: type[Strategy], base: StrategySpec, world: int) -> bool:
    probe = dataclasses.replace(base, hsdp_shard_size=1)
    return cls.parallel_dims(probe, world).shard == 1


def _takes_zero_stage(cls: type[Strategy], base: StrategySpec) -> bool:
    # A strategy whose declarations differ by ZeRO stage reads the stage.
    refusals = set()
    for stage in CHOICES["DIST.DEEPSPEED.ZERO_STAGE"]:
        spec = dataclasses.replace(base, deepspeed=DeepSpeedSpec(zero_stage=stage))
        refusals.add(tuple(sorted(cls.refusals(spec))))
    return len(refusals) > 1


def _layouts(
    name: str, cls: type[Strategy], world: int, procs_per_node: int, base: StrategySpec
) -> Iterator[Candidate]:
    """Every layout of strategy ``name`` on ``world`` processes, at one
    sample per forward."""
    plain = Candidate(
        strategy=name,
        tensor_parallel=None,
        pipeline_stages=None,
        pipeline_schedule=None,
        data_parallel=world,
        shard_size=None,
        zero_stage=None,
        offload=None,
        micro_batch=1,
        accum_steps=1,
        act_ckpt=False,
    )
    if cls.takes_tensor_parallel:
        for tp in divisors(world):
            yield dataclasses.replace(plain, tensor_parallel=tp)
    elif _takes_stages(cls, base, world):
        for stages in divisors(world)[1:]:
            for schedule in CHOICES["DIST.PIPELINE.SCHEDULE"]:
                yield dataclasses.replace(
                    plain, pipeline_stages=stages, pipeline_schedule=schedule
                )
    elif _takes_shard_size(cls, base, world):
        # Shard groups within the world, the processes of a node first.
        sizes = [s for s in divisors(world) if 1 < s < world]
        sizes.sort(key=lambda s: (s != procs_per_node, s))
        for size in sizes:
            yield dataclasses.replace(plain, shard_size=size)
    elif _takes_zero_stage(cls, base):
        for stage in CHOICES["DIST.DEEPSPEED.ZERO_STAGE"]:
            offloads = [OFFLOAD_NONE, OFFLOAD_OPTIMIZER]
            if stage == 3:
                offloads.append(OFFLOAD_ALL)
            for offload in offloads:
                yield dataclasses.replace(plain, zero_stage=stage, offload=offload)
    else:
        yield plain


def layouts(
    world: int, procs_per_node: int, run: RunFacts
) -> list[tuple[Candidate, str]]:
    """Every strategy's layouts on ``world`` processes (``procs_per_node`` on
    each node), each with why it cannot run ('' where it can): what its
    strategy refuses of the run, or its checks of the layout and the model."""
    model = functools.cache(run.skeleton)
    found = []
    for name, cls in STRATEGIES.items():
        if not cls.one_device_per_process:
            continue
        for layout in _layouts(name, cls, world, procs_per_node, run.spec):
            spec = layout.strategy_spec(run.spec, run.pipeline_micro_batches)
            reason = ""
            try:
                check_choices(dataclasses.replace(spec, batch_size=0), run.turned_on)
                check_layout(spec, world, model)
            except ValueError as error:
                reason = str(error)
            replicas = cls.replicas(spec, world)
            found.append((dataclasses.replace(layout, data_parallel=replicas), reason))
    return found


def enumerate_candidates(
    world: int, procs_per_node: int, global_batch: int, run: RunFacts
) -> list[Candidate]:
    """The candidates for ``global_batch`` samples per optimizer step on
    ``world`` processes: each layout that can run, at every micro-batch that
    is a power of two and divides the global batch over its replicas (the
    accumulation steps make up the rest), with activation checkpointing off
    and, where the model has blocks to recompute, on."""
    run = dataclasses.replace(run, skeleton=functools.cache(run.skeleton))
    checkpoints = [False, True] if find_blocks(run.skeleton()) else [False]
    found = []
    for layout, reason in layouts(world, procs_per_node, run):
        if reason:
            continue
        cls = STRATEGIES[layout.strategy]
        per_replica, rest = divmod(global_batch, layout.data_parallel)
        if rest:
            continue
        for micro in powers_of_two(per_replica):
            if per_replica % micro:
                continue
            batch = dataclasses.replace(
                layout, micro_batch=micro, accum_steps=per_replica // micro
            )
            try:  # the strategy's own rules of the batch (a pipeline's cuts)
                spec = batch.strategy_spec(run.spec, run.pipeline_micro_batches)
                cls.check_config(spec)
            except ValueError:
                continue
            for act_ckpt in checkpoints:
                found.append(dataclasses.replace(batch, act_ckpt=act_ckpt))
    return found
