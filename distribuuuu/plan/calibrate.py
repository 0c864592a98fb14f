"""What the cost model needs to know of the machine: the links' alpha and
beta, and the device's achieved FLOP/s on the model.

Measured (:func:`calibrate`, about a second in all): a few all-reduces of
one element and of a few MiB on the live process group give alpha (the
latency of a collective) and beta (the bus bandwidth, nccl-tests' busbw:
``2(n-1)/n x bytes / (t - alpha)``); one forward and backward pass of the
model at a small batch, over its counted FLOPs, gives the achieved FLOP/s;
on the CPU, which has no datasheet, a square matrix product gives the peak;
FSDP's own work per sharded tensor and per collective is timed on a small
model (:mod:`distribuuuu.plan.sharding_costs`).  Every rank measures and
the ranks keep the slowest figures, so that all of them plan alike.

On paper (:func:`paper_calibration`): the figures come from flags
(``--intra-gbps``, ``--inter-gbps``, ``--latency-us``) and the device's
datasheet (:mod:`distribuuuu.plan.devices`), with an assumed efficiency.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distribuuuu.plan.devices import dense_peak_flops, find_device
from distribuuuu.plan.flops import ModelFlops
from distribuuuu.plan.links import Cluster, Link
from distribuuuu.plan.sharding_costs import (
    COLLECTIVES_PER_UNIT,
    measure_sharded_tensor_s,
    measure_sharded_unit_s,
)
from distribuuuu.plan.timing import median_s, synchronize

# The share of the dense peak a model reaches, where it cannot be measured
# (on paper): an assumption.  Megatron-LM's largest GPT runs reached 52% of
# the A100's peak (Narayanan et al. 2021, sec. 1), the best case of large
# matrix products; image models at moderate sizes reach less.
PAPER_EFFICIENCY = 0.4
# Intra-node bandwidth on paper when no flag gives it: the datasheet's
# bidirectional NVLink or PCIe figure, halved to one direction.
LINK_DIRECTIONS = 2
# On paper, without --latency-us: a collective's latency.  GPUs: NCCL's small
# all-reduces take some tens of microseconds.  CPUs: gloo's took 1.5-2 ms
# between 2 local ranks on our 2-core test machine (issue 35).
PAPER_LATENCY_US = {"cuda": 20.0, "cpu": 1500.0}
# The model's speed is the line through a pass of SMALL_BATCH images and one
# of the run's micro-batch, or of as many images as take about LARGE_PASS_S.
SMALL_BATCH, LARGE_PASS_S = 2, 0.5
# torch 2.14 renamed the tensor forms of all-gather and reduce-scatter
# (``*_single``) and deprecated the old names, which older releases keep.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class Calibration:
    """The machine's figures, as :class:`distribuuuu.plan.links.Cluster` and
    :class:`distribuuuu.plan.cost.Workload` take them."""

    intra: Link
    inter: Link
    peak_flops: float  # dense peak of one device (datasheet, or measured on CPU)
    efficiency: float  # the share of it the model reaches
    source: str  # "measured" or "paper"
    overhead_s: float = 0.0  # of one forward and backward pass beyond its FLOPs
    optimizer_s: float = 0.0  # of an optimizer step over all the parameters
    sharded_tensor_s: float = 0.0  # of its step per DTensor parameter (dispatch)
    # FSDP's own seconds per gather or reduction, beyond the wire's alpha
    # and beta (hooks, copies, DTensor: plan/sharding_costs.py)
    sharded_collective_s: float = 0.0
    host: Link | None = None  # device <-> host memory; None on a CPU
    device_type: str = "cpu"  # "cuda": collectives overlap compute

    def cluster(self, nodes: int, procs_per_node: int) -> Cluster:
        """``nodes`` x ``procs_per_node`` devices with these figures."""
        return Cluster(
            nodes,
            procs_per_node,
            self.intra,
            self.inter,
            self.flops_per_s,
            overlap=self.device_type == "cuda",
            host=self.host,
            overhead_s=self.overhead_s,
        )

    @property
    def flops_per_s(self) -> float:
        """The FLOP/s one device achieves on the model."""
        return self.peak_flops * self.efficiency


def slowest(values: list[float], device: torch.device, group=None) -> list[float]:
    """Each of ``values`` at its largest over the ranks of ``group`` (as it
    is without a process group): the ranks plan from the same figures."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def measure_link(
    device: torch.device,
    group=None,
    large_bytes: int = 4 * 2**20,
    repeats: int = 5,
) -> Link | None:
    """Alpha and beta of the all-reduces of ``group`` (the world by
    default), and the share of that beta its all-gathers and
    reduce-scatters reach, or None without a process group of more than
    one rank: the medians of ``repeats`` collectives of ``large_bytes`` and
    of 4 x as many all-reduces of one element (cheap, and a rank held up
    for a few of them does not set the latency).  A collective: every rank
    of the group calls it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size(group)
    if size <= 1:
        return None
    small = torch.zeros(1, device=device)
    large = torch.zeros(large_bytes // 4, device=device)
    shard = torch.zeros(large.numel() // size, device=device)
    dist.barrier(group=group)
    timed = [
        median_s(lambda: dist.all_reduce(small, group=group), device, 4 * repeats),
        median_s(lambda: dist.all_reduce(large, group=group), device, repeats),
        median_s(
            lambda: ALL_GATHER(large, shard, group=group),
            device,
            repeats,
        ),
        median_s(
            lambda: REDUCE_SCATTER(shard, large, group=group),
            device,
            repeats,
        ),
    ]
    alpha, *whole = slowest(timed, device, group)
    moved = 2 * (size - 1) / size * large_bytes
    beta, gather, scatter = (
        factor * moved / max(seconds - alpha, 1e-9)
        for factor, seconds in zip((1.0, 0.5, 0.5), whole, strict=True)
    )
    return Link(alpha, beta, gather / beta, scatter / beta)


def measure_host_link(
    device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 3
) -> Link | None:
    """Alpha and beta of copies from pinned host memory to the CUDA
    ``device`` (None for a CPU, which has no other memory)."""
    if device.type != "cuda":
        return None
    small = torch.zeros(1).pin_memory()
    large = torch.zeros(nbytes // 4).pin_memory()
    alpha = median_s(lambda: small.to(device, non_blocking=True), device, repeats)
    whole = median_s(lambda: large.to(device, non_blocking=True), device, repeats)
    return Link(alpha, nbytes / max(whole - alpha, 1e-9))


def measure_peak_flops(
    device: torch.device, size: int = 1024, repeats: int = 2
) -> float:
    """FLOP/s of a ``size`` x ``size`` float32 matrix product on ``device``
    with this process's threads: the CPU's peak, which no datasheet gives."""
    a = torch.full((size, size), 0.5, device=device)
    b = torch.full((size, size), 0.25, device=device)
    seconds = median_s(lambda: a @ b, device, repeats)
    return 2 * size**3 / seconds


@contextlib.contextmanager
def _left_as_it_was(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run a pass on ``model`` and leave no trace: its buffers (BatchNorm's
    running statistics), gradients and the RNG as they were."""
    buffers = [b.detach().clone() for b in model.buffers()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
        for param in model.parameters():
            param.grad = None


def _train_pass(
    model: nn.Module,
    batch: int,
    image_size: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> Callable[[], float]:
    """A function that runs one forward and backward pass of ``batch``
    random images and returns its seconds."""
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    on = amp_dtype is not None

    def timed() -> float:
        tic = time.perf_counter()
        with torch.autocast(device.type, amp_dtype, enabled=on):
            loss = model(images).float().sum()
        loss.backward()
        synchronize(device)
        return time.perf_counter() - tic

    return timed


def _warm_pass(
    model: nn.Module,
    batches: list[int],
    image_size: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> tuple[int, Callable[[], float]]:
    """The first of ``batches`` whose pass fits in the device's memory, and
    its pass, warmed up at that shape (the last one's error where none fits)."""
    for batch in batches:
        try:
            run = _train_pass(model, batch, image_size, device, amp_dtype)
            run()
            return batch, run
        except torch.OutOfMemoryError:
            if batch == batches[-1]:
                raise
            for param in model.parameters():
                param.grad = None
            torch.cuda.empty_cache()
    raise ValueError("no batches to try")


def measure_model_speed(
    model: nn.Module,
    flops_per_image: float,
    *,
    image_size: int,
    device: torch.device,
    batch: int,
    amp_dtype: torch.dtype | None = None,
    budget_s: float = 0.3,
    rounds: int = 3,
) -> tuple[float, float]:
    """The FLOP/s ``model`` (plain, on ``device``) achieves in its forward
    and backward passes, and the seconds a pass takes beyond its FLOPs
    (``flops_per_image`` FLOPs an image): the line through a pass of
    :data:`SMALL_BATCH` images and one of ``batch`` (the run's micro-batch),
    warmed up, then timed in turn for ``rounds`` rounds, each round giving
    a slope and the median slope counting (a machine whose speed drifts
    touches both passes of a round alike).  The time an image takes grows
    with the batch on a CPU (vit_tiny_patch4 at 32 px: about 12% more at 32
    than between 2 and 6), so the line ends at the run's batch, or at the
    largest whose pass takes about :data:`LARGE_PASS_S` (at 3 x SMALL_BATCH
    where the device's memory holds no more).  Where a warm pass of the
    small batch takes more than ``budget_s``, the model is large for the
    device and that batch alone gives its speed (no overhead).  The model
    is left as it was."""
    was_training = model.training
    with _left_as_it_was(model, device):
        model.train()
        try:
            small = _train_pass(model, SMALL_BATCH, image_size, device, amp_dtype)
            small()  # warm-up: the allocator, oneDNN's or cuDNN's choices
            if (first := small()) > budget_s:
                return flops_per_image * SMALL_BATCH / first, 0.0
            affordable = int(LARGE_PASS_S * SMALL_BATCH / first)
            least = 3 * SMALL_BATCH
            batches = [max(min(batch, affordable), least), least]
            large, run = _warm_pass(model, batches, image_size, device, amp_dtype)
            pairs = [(small(), run()) for _ in range(rounds)]
        finally:
            model.train(was_training)
    slope = statistics.median((b - a) / (large - SMALL_BATCH) for a, b in pairs)
    t_small = statistics.median(a for a, _ in pairs)
    if slope <= 0:  # too noisy to tell: all of it is compute
        t_large = statistics.median(b for _, b in pairs)
        return flops_per_image / max(t_large / large, t_small / SMALL_BATCH), 0.0
    return flops_per_image / slope, max(t_small - slope * SMALL_BATCH, 0.0)


def measure_optimizer_s(
    parameters: int,
    device: torch.device,
    optimizer_class: Callable[[list], torch.optim.Optimizer] = torch.optim.AdamW,
    sample: int = 2**22,
) -> float:
    """Seconds of one step of ``optimizer_class`` over ``parameters`` on
    ``device``: a step over at most ``sample`` of them, scaled (the step
    is memory-bound, linear in its parameters)."""
    size = max(min(parameters, sample), 1)
    weights = nn.Parameter(torch.zeros(size, device=device))
    weights.grad = torch.zeros_like(weights)
    optimizer = optimizer_class([weights])
    return median_s(optimizer.step, device, repeats=3) * parameters / size


def device_peak_flops(
    device: torch.device, amp_dtype: torch.dtype | None, conv_share: float
) -> float:
    """The dense peak of ``device``: its datasheet's, or a float32 matrix
    product's measured FLOP/s on a CPU or a GPU the table lacks."""
    if device.type == "cuda":
        sheet = find_device(torch.cuda.get_device_name(device))
        if sheet is not None:
            return dense_peak_flops(sheet, amp_dtype, conv_share)
    return measure_peak_flops(device)


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast one device runs the model, measured in this process."""

    peak_flops: float  # dense peak (datasheet; a matrix product on a CPU)
    efficiency: float  # the share of it the model's passes reach
    overhead_s: float  # of one forward and backward pass beyond its FLOPs
    optimizer_s: float  # of an optimizer step over all the parameters


def measure_device(
    model: nn.Module,
    flops: ModelFlops,
    *,
    image_size: int,
    device: torch.device,
    batch: int,
    amp_dtype: torch.dtype | None = None,
) -> DeviceSpeed:
    """The speed of ``device`` on ``model`` (plain, on ``device``, left as
    it was; ``flops``: its count; ``batch``: the run's micro-batch), without
    a process group: what :func:`calibrate` measures on every rank, and what
    ``tools/plan.py --device cpu`` measures of this machine's CPU."""
    peak = device_peak_flops(device, amp_dtype, flops.conv_share)
    achieved, overhead = measure_model_speed(
        model,
        flops.per_image,
        image_size=image_size,
        device=device,
        batch=batch,
        amp_dtype=amp_dtype,
    )
    optimizer = measure_optimizer_s(flops.parameters, device)
    return DeviceSpeed(peak, achieved / peak, overhead, optimizer)


def _measure_links(device: torch.device, procs_per_node: int) -> tuple[Link, Link]:
    """(within a node, between nodes): the world's collectives give the
    link between nodes (a ring crosses each node's link once) and, on one
    node, the link within it; across nodes the nodes' own groups give the
    link within one.  A collective: every rank calls it."""
    world = measure_link(device) or Link(0.0, float("inf"))  # none in one process
    intra = world
    size = dist.get_world_size() if dist.is_initialized() else 1
    if 1 < procs_per_node < size and size % procs_per_node == 0:
        node_group, groups = dist.new_subgroups(group_size=procs_per_node)
        intra = measure_link(device, node_group) or world
        for group in groups:
            dist.destroy_process_group(group)
    return intra, world


def calibrate(
    model: nn.Module,
    flops: ModelFlops,
    *,
    image_size: int,
    device: torch.device,
    procs_per_node: int,
    batch: int,
    amp_dtype: torch.dtype | None = None,
) -> Calibration:
    """Measure the live machine (a collective: every rank calls it).

    ``model``: the plain model on ``device``, left as it was; ``flops``: its
    count; ``batch``: the run's micro-batch under ddp.  Every rank measures
    its device (:func:`measure_device`) and the slowest figures are kept;
    then the links (:func:`measure_link`, within and between nodes).
    FSDP's machinery is timed on units of the model's mean number of
    parameter tensors (:mod:`distribuuuu.plan.sharding_costs`), less the
    wire's latency.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the ranks measure side by side, as they will train
    speed = measure_device(
        model,
        flops,
        image_size=image_size,
        device=device,
        batch=batch,
        amp_dtype=amp_dtype,
    )
    tensors_per_unit = flops.parameter_tensors / (len(flops.blocks) + 1)
    per_flop, overhead, optimizer, sharded, unit = slowest(
        [
            1 / speed.efficiency,
            speed.overhead_s,
            speed.optimizer_s,
            measure_sharded_tensor_s(device),
            measure_sharded_unit_s(device, tensors_per_unit),
        ],
        device,
    )
    intra, world = _measure_links(device, procs_per_node)
    machinery = max(unit / COLLECTIVES_PER_UNIT - world.latency_s, 0.0)
    return Calibration(
        intra,
        world,
        speed.peak_flops,
        efficiency=1 / per_flop,
        source="measured",
        overhead_s=overhead,
        optimizer_s=optimizer,
        sharded_tensor_s=sharded,
        sharded_collective_s=machinery,
        host=measure_host_link(device),
        device_type=device.type,
    )


def _paper_link(gbit_per_s: float | None, latency_us: float, flag: str) -> Link:
    if gbit_per_s is None:
        raise ValueError(f"{flag}: the planner needs this link's speed on paper")
    return Link.of(gbit_per_s, latency_us)


def paper_calibration(
    device: str,
    *,
    nodes: int,
    procs_per_node: int,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    latency_us: float | None = None,
    amp_dtype: torch.dtype | None = None,
    conv_share: float = 0.0,
    speed: DeviceSpeed | None = None,
) -> Calibration:
    """The figures of a machine on paper (``tools/plan.py``).

    ``device``: "cpu" or a name :func:`~distribuuuu.plan.devices.find_device`
    knows; ``speed``: the device measured on the model (this machine's CPU,
    :func:`measure_device`), else its peak (datasheet, or a matrix product
    on this CPU) at :data:`PAPER_EFFICIENCY`.  A link the plan uses needs
    its flag, except the link within a node of a known GPU: its datasheet's
    NVLink or PCIe figure, one direction (and PCIe to the host, for
    offloaded state).  Raises ValueError naming the missing flag or the
    unknown device.
    """
    kind = "cpu" if device.strip().lower() == "cpu" else "cuda"
    latency = PAPER_LATENCY_US[kind] if latency_us is None else latency_us
    if kind == "cpu":
        peak = speed.peak_flops if speed else measure_peak_flops(torch.device("cpu"))
        datasheet_gbps, host = None, None
    else:
        sheet = find_device(device)
        if sheet is None:
            raise ValueError(
                f"--device {device!r}: not in the planner's datasheet table"
            )
        peak = dense_peak_flops(sheet, amp_dtype, conv_share)
        datasheet_gbps = sheet.link_gb_s * 8 / LINK_DIRECTIONS
        host = Link.of(sheet.host_gb_s * 8 / LINK_DIRECTIONS, latency)
    unused = Link(0.0, float("inf"))
    intra = unused
    if procs_per_node > 1:
        gbps = intra_gbps if intra_gbps is not None else datasheet_gbps
        intra = _paper_link(gbps, latency, "--intra-gbps")
    inter = _paper_link(inter_gbps, latency, "--inter-gbps") if nodes > 1 else intra
    if speed is None:
        speed = DeviceSpeed(peak, PAPER_EFFICIENCY, 0.0, 0.0)
    return Calibration(
        intra,
        inter,
        speed.peak_flops,
        speed.efficiency,
        "paper",
        overhead_s=speed.overhead_s,
        optimizer_s=speed.optimizer_s,
        host=host,
        device_type=kind,
    )
