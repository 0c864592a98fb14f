"""The project's own training step run without memory: fake tensors, a fake
process group, and a tracker of what the process would hold.

Three tools of torch do the work; the first two are private, and a canary
test (``tests/plan/test_torch_tools.py``) names each when a release changes
it:

- ``torch.distributed._tools.mem_tracker.MemTracker`` sorts every tensor
  storage alive into parameters, buffers, gradients, optimizer state,
  activations (forward), temporaries (backward) and other tensors, after
  every operation.  Under ``FakeTensorMode`` it counts what a real run holds
  (its storages' sizes), and nothing is allocated or computed.
- The fake process group (``torch.testing._internal.distributed.fake_pg``'s
  ``FakeStore``, backend ``"fake"``) lets one process play rank ``r`` of a
  world of ``N``: collectives return at once with tensors of the right
  shapes, so tensor parallelism and FSDP run as that rank would.  Device
  meshes are built before fake tensors are on.  DDP's C++ reducer takes no
  fake tensor: DDP is traced in one process (:mod:`distribuuuu.plan.memory`
  adds its buckets).
- ``FakeTensorMode``.

The step traced is the engine's (:func:`distribuuuu.engine.loop.train_step`):
the strategy's forward, backward and optimizer step, the gradients kept until
the next step's backward replaces them, then the EMA.  A pipeline's stages
are measured step by step of the model's chain instead
(:mod:`distribuuuu.plan.stages`), and composed per schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from distribuuuu.dist.group import release_groups
from distribuuuu.engine.loop import train_step
from distribuuuu.engine.losses import LossSpec, build_train_loss
from distribuuuu.engine.state import BatchPlan, Progress, RunClock, TrainState
from distribuuuu.models import build_configured
from distribuuuu.models.ema import ModelEma
from distribuuuu.models.spec import ModelSpec
from distribuuuu.reporting.meters import MetricSums
from distribuuuu.strategies import Strategy, StrategySpec, build_strategy
from distribuuuu.strategies.chain import prepare_model

# MemTracker's categories (its _MemRefType values) -> the indices of a point.
PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES, OTHER = range(6)
_CATEGORIES = {
    "Parameter": PARAMETERS,
    "Buffer": PARAMETERS,
    "Gradient": GRADIENTS,
    "Optstate": OPTIMIZER,
    "Activation": ACTIVATIONS,
    "Temp": TEMPORARIES,
    "Other": OTHER,
}


class _NoModules:
    """In MemTracker's place of its module tracker: no hooks on modules, so
    nothing is told apart but optimizer state (every tensor an activation).
    The pipeline's schedule computes its gradients with ``autograd.grad``,
    which the module tracker's hooks on leaf tensors refuse (torch 2.14)."""

    is_bw = False
    parents = {"Global"}

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class PeakTracker(MemTracker):
    """MemTracker that follows what the process holds after every operation,
    and lets a step call its model several times; with ``modules`` False it
    counts the total alone (no hooks on the modules).

    :attr:`peak` is the most bytes held since the last :meth:`restart`;
    :attr:`points` collects, while :attr:`recording`, the bytes held by
    category (indexed by :data:`PARAMETERS` ... :data:`OTHER`).  To measure
    a real run's peak (the ``predicted/measured`` line on a CPU), enter one
    before the strategy prepares the model (its buffers are allocated
    then), the model built before and passed to :meth:`track_external`.

    MemTracker itself refuses a second call of a root module until its
    statistics per module are cleared, and updates a peak per module after
    every operation; neither is needed here, and the second took half of a
    trace's time.
    """

    def __init__(self, modules: bool = True) -> None:
        super().__init__()
        if not modules:
            self._mod_tracker = _NoModules()  # type: ignore[assignment]
        self.recording = False
        self.peak = 0
        self.points: list[tuple[int, ...]] = []
        self.ops: list[Any] = []  # the operation after which each point was taken
        self._op: Any = None

    def restart(self, recording: bool) -> None:
        """Forget the peak and the points so far: both start from what is
        held now; points are recorded from now on if ``recording``."""
        held = self.current()
        self.recording, self.peak = recording, sum(held)
        self.points, self.ops = [held], [None]

    def current(self) -> tuple[int, ...]:
        """Bytes held now, by category."""
        held = [0] * 6
        for snapshot in self._curr_mem_snap.values():
            for kind, size in snapshot.items():
                index = _CATEGORIES.get(getattr(kind, "value", kind))
                if index is not None:
                    held[index] += size
        return tuple(held)

    def _update_peak_stats(self, peak_state: Any) -> None:
        held = self.current()
        self.peak = max(self.peak, sum(held))
        if self.recording:
            self.points.append(held)
            self.ops.append(self._op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.namespace == "prim":  # a tensor's device asked: nothing held
            return func(*args, **(kwargs or {}))
        self._op = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # the root called again in one step
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` over the fake process group.

    RuntimeError where a process group is already joined: plan before
    joining it, or in a process of its own.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "the planner traces over a fake process group, and this process "
            "has joined a real one: plan before joining it, or in a process of "
            "its own"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        release_groups()


def _moved_in_place(original: Callable) -> Callable:
    def to(module: nn.Module, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], str | torch.device):
            device = torch.device(args[0])
            tensors = [*module.parameters(), *module.buffers()]
            if all(_same_device(t.device, device) for t in tensors):
                return module
        return original(module, *args, **kwargs)

    return to


def _same_device(held: torch.device, asked: torch.device) -> bool:
    return held.type == asked.type and asked.index in (None, held.index)


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Fake tensors on, and ``nn.Module.to`` a device that the module is on
    already returns it as it is: torch swaps a fake parameter for its copy,
    which the fake mode's weak references to it forbid (torch 2.14, 2.15)."""
    original = nn.Module.to
    nn.Module.to = _moved_in_place(original)  # type: ignore[method-assign]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The package's log lines off while a trace builds a run (the builders
    log what they build)."""
    package = logging.getLogger("distribuuuu")
    disabled, package.disabled = package.disabled, True
    try:
        yield
    finally:
        package.disabled = disabled


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    """What a trace builds: the model, the run's strategy settings (with its
    optimizer recipe and precision), its loss, image size and EMA, and
    DIST.PIPELINE.MICROBATCHES as configured (0: twice the stages)."""

    model: ModelSpec
    strategy: StrategySpec
    loss: LossSpec
    image_size: int
    ema: bool = False
    pipeline_micro_batches: int = 0


def build_meta_model(spec: ModelSpec) -> nn.Module:
    """The model of ``spec`` on the meta device (random weights, never
    downloaded); under :func:`fake_tensors`, ``to_empty(device="cpu")``
    makes it a model of fake tensors."""
    with torch.device("meta"):
        return build_configured(dataclasses.replace(spec, pretrained=False))


# One operation's line in the batch: (rest, its slope per sample, gradients,
# optimizer state, activations, their slope, temporaries, their slope), in
# bytes; the rest is all but parameters, gradients, optimizer state and EMA.
Line = tuple[float, float, int, int, float, float, float, float]
# What a traced phase is: the points and their operations (PeakTracker's).
Points = tuple[Sequence[tuple[int, ...]], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class Phase:
    """What a rank holds through one phase of a step, as lines in the batch.

    The same operations run at every batch size, so each operation's bytes
    are a line through its two traced batches (activations grow with the
    batch, exactly so for convolutions, attention and norms).  ``lines``
    keeps those of the operations that may hold the peak at some batch with
    some share of the gradients and optimizer state (a sharded one): the
    others hold less rest at the first batch, grow slower, and hold fewer
    gradients and less optimizer state than one of them.  ``parameters`` is
    the largest over the phase.
    """

    parameters: int
    first_batch: int
    lines: tuple[Line, ...]

    @classmethod
    def of(
        cls, traced: tuple[Points, Points], batches: tuple[int, int], ema_bytes: int
    ) -> Phase:
        """The phase traced at two ``batches`` (the tracker held
        ``ema_bytes`` of moving average among 'other')."""
        scale = 1.0 / (batches[1] - batches[0])

        def parts(p: tuple[int, ...]) -> tuple[int, int, int]:
            temporaries = p[TEMPORARIES] + p[OTHER] - ema_bytes
            return p[ACTIVATIONS] + temporaries, p[ACTIVATIONS], temporaries

        lines: list[Line] = []
        for a, b in _paired(*traced):
            (rest_a, act_a, tmp_a), (rest_b, act_b, tmp_b) = parts(a), parts(b)
            lines.append(
                (
                    float(rest_a),
                    (rest_b - rest_a) * scale,
                    max(a[GRADIENTS], b[GRADIENTS]),
                    max(a[OPTIMIZER], b[OPTIMIZER]),
                    float(act_a),
                    (act_b - act_a) * scale,
                    float(tmp_a),
                    (tmp_b - tmp_a) * scale,
                )
            )
        points = [*traced[0][0], *traced[1][0]]
        return cls(
            parameters=max((p[PARAMETERS] for p in points), default=0),
            first_batch=batches[0],
            lines=_undominated(lines),
        )

    def peak(
        self, batch: float, grads: float = 1.0, optimizer: float = 1.0
    ) -> tuple[float, ...]:
        """``(total, gradients, optimizer state, activations, temporaries)``
        at ``batch`` samples of the operation whose total (without the
        parameters and EMA) is largest, with its gradients and optimizer
        state scaled by ``grads`` and ``optimizer``."""
        x = batch - self.first_batch
        return max(
            (
                (
                    rest + slope * x + grads * g + optimizer * o,
                    grads * g,
                    optimizer * o,
                    act + act_slope * x,
                    tmp + tmp_slope * x,
                )
                for rest, slope, g, o, act, act_slope, tmp, tmp_slope in self.lines
            ),
            default=(0.0, 0.0, 0.0, 0.0, 0.0),
        )


def _paired(first: Points, second: Points) -> list[tuple[tuple[int, ...], ...]]:
    """The points of the same operations at the two batches.  The step runs
    the same operations at every batch; where a library's caches make one
    run an operation or two more, the sequences are aligned on their
    operations and those left out."""
    (a, a_ops), (b, b_ops) = first, second
    if len(a) == len(b):
        return list(zip(a, b))
    matcher = difflib.SequenceMatcher(None, a_ops, b_ops, autojunk=False)
    return [
        (a[i + k], b[j + k])
        for i, j, size in matcher.get_matching_blocks()
        for k in range(size)
    ]


def _undominated(lines: list[Line]) -> tuple[Line, ...]:
    """The lines that no other beats in rest, its slope, gradients and
    optimizer state all."""
    kept: list[Line] = []
    for line in sorted(set(lines), key=lambda r: (-r[0], -r[1], -r[2], -r[3])):
        if not any(
            k[1] >= line[1] and k[2] >= line[2] and k[3] >= line[3] for k in kept
        ):
            kept.append(line)
    return tuple(kept)


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """A traced step: its forward phase (the last step's gradients alive)
    and the rest (backward, optimizer, EMA), split where the step zeroes the
    gradients."""

    forward: Phase
    backward: Phase


def _state(strategy: Strategy, model: nn.Module, ema: ModelEma | None) -> TrainState:
    return TrainState(
        strategy=strategy,
        model=model,
        optimizer=strategy.build_optimizer(model),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        amp_dtype=strategy.amp_dtype,
        device=torch.device("cpu"),
        normalize=nn.Identity(),
        plan=BatchPlan(1, 1, 1),
        progress=Progress(),
        clock=RunClock(1, 0),
        writer=cast(Any, None),  # the step writes nothing
        classes=[],
        ema=ema,
    )


def _ema_bytes(ema: ModelEma | None) -> int:
    """The bytes of the moving average this rank holds (its shards)."""
    if ema is None:
        return 0
    tensors = [_local(t) for t in ema.average.values()]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def trace_steps(
    spec: TraceSpec, strategy_spec: StrategySpec, batches: tuple[int, int]
) -> StepTrace:
    """The engine's training step traced at the two ``batches`` (samples per
    forward), after a warm-up step that creates the optimizer state; this
    process runs it as the strategy of ``strategy_spec`` does on the fake
    world already joined (or alone)."""
    strategy_spec = dataclasses.replace(
        strategy_spec,
        device=torch.device("cpu"),
        channels_last=False,  # the same bytes in another layout
        compile_model=False,
    )
    with quiet():
        strategy = build_strategy(strategy_spec)
        if dist.is_initialized() and dist.get_world_size() > 1:
            strategy.mesh  # noqa: B018 - built before fake tensors are on
        model = build_meta_model(spec.model)
        with fake_tensors():
            model = prepare_model(strategy, model.to_empty(device="cpu"))
            ema = ModelEma(model, 0.999, warmup=True) if spec.ema else None
            state = _state(strategy, model, ema)
            return _run_steps(state, spec, strategy_spec.accum_steps, batches)


def _run_steps(
    state: TrainState, spec: TraceSpec, accum: int, batches: tuple[int, int]
) -> StepTrace:
    loss_fn, meter = build_train_loss(spec.loss), MetricSums(state.device, 1)
    size = spec.image_size

    def step(batch: int, tracker: PeakTracker | None = None) -> None:
        images = torch.empty(batch, 3, size, size)
        targets = torch.zeros(batch, dtype=torch.long)
        if tracker is not None:
            tracker.track_external(images, targets)
            tracker.restart(recording=True)
        state.plan = BatchPlan(batch, accum, 1)
        train_step(state, iter([(images, targets)] * accum), meter, loss_fn)

    # A first step, untracked, leaves the gradients and the optimizer state
    # that the measured steps find, as a run's steps after its first do.  A
    # model alone takes a step of the optimizer over zero gradients for it;
    # spread over ranks, the step is run: its first forward initialises
    # DTensor's state lazily.
    if dist.is_initialized():
        step(batches[0])
    else:
        for param in state.model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        state.optimizer.step()
    tracker = PeakTracker()
    tracker.track_external(state.model, state.optimizer)
    ema_bytes = _ema_bytes(state.ema)
    if state.ema is not None:
        tracker.track_external(*state.ema.average.values())
    optimizer, forward = state.optimizer, []  # forward: Points of each step
    zero_grad = optimizer.zero_grad

    def forward_done(set_to_none: bool = True) -> None:
        # The step zeroes the gradients between the first forward and its
        # backward: the phase of the last step's gradients ends here.
        forward.append((tracker.points, tracker.ops))
        tracker.restart(recording=True)
        zero_grad(set_to_none)

    optimizer.zero_grad = forward_done  # type: ignore[method-assign]
    backward: list[Points] = []
    with tracker:
        for batch in batches:
            step(batch, tracker)
            tracker.recording = False
            backward.append((tracker.points, tracker.ops))
    del optimizer.zero_grad  # the instance's own again
    return StepTrace(
        Phase.of((forward[0], forward[1]), batches, ema_bytes),
        Phase.of((backward[0], backward[1]), batches, ema_bytes),
    )
