"""A pipeline's memory per stage: the model's chain traced step by step, and
each stage composed from it per schedule.

The chain (:func:`distribuuuu.models.chains.model_chain`) is what a
pipeline cuts between.  One forward and backward through all its steps, on
fake tensors in one process, tells of each step what its forward keeps for
the backward, its output, and the peaks of its forward and its backward;
each is a line in the batch through two traced batches.

A stage's rank then holds, at its peak: its steps' weights, gradients,
optimizer state and EMA; the schedule's receive buffers, one per
micro-batch (torch.distributed.pipelining keeps them from step to step: the
activations the stage takes in, the gradients of those it sends on); the
batch the loader gave it; and the activations of as many micro-batches as
the schedule holds in flight beside the one computing: GPipe all ``M``
forwards before any backward, 1F1B ``min(M, S - stage)`` (its warm-up), the
interleaved 1F1B Megatron's warm-up forwards over its model chunks.  The
fullest stage counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from distribuuuu.engine.losses import build_train_loss
from distribuuuu.models.chains import StagePart, Step, balanced_bounds, model_chain
from distribuuuu.plan.tracing import (
    ACTIVATIONS,
    OPTIMIZER,
    OTHER,
    TEMPORARIES,
    PeakTracker,
    TraceSpec,
    build_meta_model,
    fake_tensors,
    quiet,
)
from distribuuuu.strategies import build_strategy
from distribuuuu.strategies.chain import prepare_model
from distribuuuu.strategies.spec import PipelineSpec


@dataclasses.dataclass(frozen=True)
class ChainStep:
    """One step of the model's chain at one batch, in bytes: what its
    forward keeps for the backward (its output among it), its output, and
    the peaks of its forward and of its backward above what the steps before
    it keep (the gradients of the parameters left out)."""

    kept: float
    output: float
    forward_peak: float
    backward_peak: float


@dataclasses.dataclass(frozen=True)
class ChainTrace:
    """The model's chain: each step's parameters (count and bytes), buffer
    bytes, and :class:`ChainStep` at each of the two traced ``batches``."""

    parameters: list[int]
    parameter_bytes: list[int]
    buffer_bytes: list[int]
    batches: tuple[int, int]
    steps: tuple[list[ChainStep], list[ChainStep]]

    def at(self, batch: float) -> list[ChainStep]:
        """Every step at ``batch`` samples, on the lines through the two
        traced batches."""
        x = (batch - self.batches[0]) / (self.batches[1] - self.batches[0])
        return [
            ChainStep(*(a + (b - a) * x for a, b in zip(first, second)))
            for first, second in zip(
                *(map(dataclasses.astuple, steps) for steps in self.steps)
            )
        ]


def trace_chain(
    spec: TraceSpec, batches: tuple[int, int], act_ckpt: bool
) -> ChainTrace:
    """The model's chain, each step traced at the two ``batches``: a forward
    and backward through the chain as a pipeline's stages run them (one
    process, nothing allocated)."""
    strategy_spec = dataclasses.replace(
        spec.strategy,
        name="ddp",
        device=torch.device("cpu"),
        tensor_parallel=1,
        activation_checkpointing=act_ckpt,
        channels_last=False,
        compile_model=False,
    )
    with quiet():
        strategy = build_strategy(strategy_spec)
        model = build_meta_model(spec.model)
        with fake_tensors():
            model = prepare_model(strategy, model.to_empty(device="cpu"))
            steps = model_chain(model)
            parts = [StagePart(model, [step]) for step in steps]
            first, second = (_run(model, steps, spec, batch) for batch in batches)
    return ChainTrace(
        parameters=[sum(p.numel() for p in part.parameters()) for part in parts],
        parameter_bytes=[_bytes(part.parameters()) for part in parts],
        buffer_bytes=[_bytes(part.buffers()) for part in parts],
        batches=batches,
        steps=(first, second),
    )


def _bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _run(
    model: torch.nn.Module, steps: list[Step], spec: TraceSpec, batch: int
) -> list[ChainStep]:
    """One forward and backward through ``steps`` at ``batch`` samples."""
    part = StagePart(model, steps)
    tracker = PeakTracker()
    tracker.track_external(part)
    size = spec.image_size
    images = torch.empty(batch, 3, size, size)
    targets = torch.zeros(batch, dtype=torch.long)
    tracker.track_external(images, targets)
    kept, outputs, forward_peaks = [], [], []
    starts: list[tuple[int, int]] = []  # (step, point) where its backward starts

    def mark(index: int) -> Callable[[torch.Tensor], None]:
        def started(grad: torch.Tensor) -> None:
            starts.append((index, len(tracker.points)))

        return started

    with tracker:
        x, before = images, _rest(tracker.current())
        base = before
        for index, step in enumerate(steps):
            tracker.restart(recording=True)
            x = step.run(part, x)
            after = _rest(tracker.current())
            peak = max(_rest(point) for point in tracker.points)
            kept.append(after - before)
            forward_peaks.append(max(peak, after) - before)
            outputs.append(x.numel() * x.element_size())
            x.register_hook(mark(index))
            before = after
        loss = build_train_loss(spec.loss)(x, targets)
        tracker.restart(recording=True)
        starts.append((len(steps) - 1, 0))
        loss.backward()
        tracker.recording = False
    backward_peaks = _backward_peaks(kept, starts, tracker.points, base)
    return [
        ChainStep(*values)
        for values in zip(kept, outputs, forward_peaks, backward_peaks)
    ]


def _rest(point: tuple[int, ...]) -> int:
    """What a point holds but the parameters and their gradients."""
    return point[OPTIMIZER] + point[ACTIVATIONS] + point[TEMPORARIES] + point[OTHER]


def _backward_peaks(
    kept: list[int], starts: list[tuple[int, int]], points: list, base: int
) -> list[int]:
    """The peak of each step's backward above what the steps before it keep:
    it runs from the gradient of its output to that of its input."""
    begin: dict[int, int] = {}
    for index, at in starts:
        begin.setdefault(index, at)
    peaks = []
    for index in range(len(kept)):
        start = begin.get(index, len(points))
        end = begin.get(index - 1, len(points)) if index else len(points)
        segment = points[start:end] or points[max(start - 1, 0) : start + 1]
        below = base + sum(kept[:index])
        peaks.append(max(_rest(point) for point in segment) - below)
    return peaks


@dataclasses.dataclass(frozen=True)
class StageRun:
    """What a pipeline candidate's stages share: the schedule, the batch one
    schedule step sees per replica, the replicas, and what the rest of the
    run adds (bytes of optimizer state per parameter byte, the EMA, the
    image size)."""

    pipeline: PipelineSpec
    batch: int
    data_parallel: int
    optimizer_factor: float
    ema: bool
    image_size: int


def pipeline_peak(chain: ChainTrace, run: StageRun) -> dict[str, float]:
    """The parts of the fullest stage's peak (bytes by part)."""
    pipe = run.pipeline
    bounds = balanced_bounds(chain.parameters, pipe.pieces)
    ends = [*bounds[1:], len(chain.parameters)]
    steps = chain.at(run.batch / pipe.micro_batches)
    best: dict[str, float] = {}
    for stage in range(pipe.stages):
        pieces = range(stage, pipe.pieces, pipe.stages)
        chunks = [range(bounds[i], ends[i]) for i in pieces]
        parts = _stage_peak(chain, steps, run, stage, chunks)
        if sum(parts.values()) > sum(best.values(), -1.0):
            best = parts
    return best


def _stage_peak(
    chain: ChainTrace,
    steps: list[ChainStep],
    run: StageRun,
    stage: int,
    chunks: list[range],
) -> dict[str, float]:
    """What rank ``stage`` holds at its peak; ``chunks``: the chain steps of
    each of its model chunks."""
    pipe, last = run.pipeline, len(steps)
    mine = [i for chunk in chunks for i in chunk]
    params = sum(chain.parameter_bytes[i] for i in mine)
    buffers = sum(chain.buffer_bytes[i] for i in mine)
    received = pipe.micro_batches * sum(
        (steps[c.start - 1].output if c.start else 0)
        + (steps[c.stop - 1].output if c.stop < last else 0)
        for c in chunks
    )
    kept = max(sum(steps[i].kept for i in chunk) for chunk in chunks)
    forward = max(_inside(steps, c, i, forward=True) for c in chunks for i in c)
    backward = max(_inside(steps, c, i, forward=False) for c in chunks for i in c)
    # (activations, gradients) at the moments that may hold the peak
    if pipe.schedule == "gpipe":  # every forward, then the backwards
        held = (pipe.micro_batches - 1) * kept
        moments = [(held + forward, 0.0)]
        for chunk in chunks:  # the first backward: the gradients appear
            for i in chunk:
                grads = sum(chain.parameter_bytes[j] for j in chunk if j >= i)
                moments.append((held + _inside(steps, chunk, i, False), grads))
        moments.append((held - kept + backward, params))  # the next ones
    else:  # 1F1B: the warm-up forwards in flight, then a backward after each
        in_flight = _in_flight(pipe, stage, len(chunks))
        moments = [((in_flight - 1) * kept + max(forward, backward), params)]
    if run.data_parallel > 1:  # the gradients flattened to average them
        moments.append((float(params), params))
    activations, gradients = max(moments, key=sum)
    images = run.batch * 3 * run.image_size**2 * 4
    return {
        "parameters": params + buffers,
        "gradients": gradients,
        "optimizer": run.optimizer_factor * params,
        "ema": params + buffers if run.ema else 0,
        "activations": activations + received + images,
    }


def _in_flight(pipe: PipelineSpec, stage: int, chunks: int) -> int:
    """Micro-batches (of chunks) whose activations a 1F1B rank holds at
    most: its warm-up forwards and the one computing."""
    if pipe.schedule == "1f1b":
        return min(pipe.micro_batches, pipe.stages - stage)
    warmup = (pipe.stages - stage - 1) * 2 + (chunks - 1) * pipe.stages
    return min(pipe.micro_batches * chunks, warmup + 1)


def _inside(
    steps: Sequence[ChainStep], chunk: range, index: int, forward: bool
) -> float:
    """The peak of one micro-batch in a chunk, in step ``index``'s forward
    or backward (the chunk's earlier steps keep theirs)."""
    before = sum(steps[i].kept for i in range(chunk.start, index))
    step = steps[index]
    return before + (step.forward_peak if forward else step.backward_peak)
