"""A plan on paper, from a config and the machine's figures
(``tools/plan.py``): nothing is launched, the traces run in this process on
the fake process group.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config.validation import largest_train_size
from distribuuuu.dist.group import cpu_threads
from distribuuuu.engine.specs import loss_spec, model_spec, strategy_spec, turned_on
from distribuuuu.errors import ConfigError
from distribuuuu.models import build_configured
from distribuuuu.plan.calibrate import (
    Calibration,
    DeviceSpeed,
    measure_device,
    paper_calibration,
)
from distribuuuu.plan.candidate import RunFacts
from distribuuuu.plan.cost import Workload
from distribuuuu.plan.devices import find_device
from distribuuuu.plan.flops import ModelFlops, count_flops
from distribuuuu.plan.memory import MemoryModel
from distribuuuu.plan.search import Machine, PlanResult, plan
from distribuuuu.plan.tracing import TraceSpec
from distribuuuu.strategies.comm_hooks import compressed_share

GIB_IN_MIB = 1024
# On a CPU, a model up to this many parameters is measured on this machine
# (seconds); a larger one is priced at the paper efficiency of the CPU's peak.
MEASURED_PARAMETERS = 100_000_000
# Appended to a plan's overrides: a plan reads no data, so the data set's
# folders need not exist where it is made.
NO_DATA = ["MODEL.DUMMY_INPUT", "True"]


@dataclasses.dataclass(frozen=True)
class PaperMachine:
    """The machine of ``tools/plan.py``'s flags."""

    nodes: int
    procs_per_node: int
    device: str  # "cpu" or a datasheet's name
    device_memory_gib: float | None = None  # None: the datasheet's (a CPU: RAM)
    intra_gbps: float | None = None
    inter_gbps: float | None = None
    latency_us: float | None = None

    @property
    def on_cpu(self) -> bool:
        return self.device.strip().lower() == "cpu"

    def memory_mib(self) -> float:
        """Memory of one device in MiB: the flag's, the datasheet's (its GB
        read as GiB), or on a CPU this machine's RAM over the processes."""
        if self.device_memory_gib is not None:
            return self.device_memory_gib * GIB_IN_MIB
        if self.on_cpu:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return total / 2**20 / self.procs_per_node
        sheet = find_device(self.device)
        if sheet is None:
            raise ValueError(
                f"--device {self.device!r}: not in the planner's datasheet table"
            )
        return sheet.memory_gb * GIB_IN_MIB


def amp_dtype_on(cfg: CfgNode, on_cpu: bool) -> torch.dtype | None:
    """TRAIN.MIXED_PRECISION's autocast dtype on paper: auto is bf16 on the
    GPUs of the datasheet table (all of compute capability 8.0 or newer) and
    none on a CPU; fp16 falls back to bf16 on a CPU."""
    precision = cfg.TRAIN.MIXED_PRECISION
    if precision == "auto":
        precision = "none" if on_cpu else "bf16"
    if precision == "none":
        return None
    if precision == "fp16" and not on_cpu:
        return torch.float16
    return torch.bfloat16


def _skeleton(cfg: CfgNode) -> nn.Module:
    spec = dataclasses.replace(model_spec(cfg), pretrained=False)
    with torch.device("meta"):
        return build_configured(spec)


@dataclasses.dataclass
class PaperRun:
    """What the plans of one config share, whatever the machine: its run's
    facts, its memory model (each trace run once, when first needed), its
    FLOPs and precision.  ``on_cpu``: a CPU's precision (auto is none)."""

    cfg: CfgNode
    run: RunFacts
    memory: MemoryModel
    flops: ModelFlops
    amp_dtype: torch.dtype | None

    @classmethod
    def of(cls, cfg: CfgNode, on_cpu: bool) -> PaperRun:
        """The run of ``cfg`` on paper (counts its FLOPs; traces nothing yet)."""
        amp = amp_dtype_on(cfg, on_cpu)
        precision = {None: "none", torch.float16: "fp16"}.get(amp, "bf16")
        spec = strategy_spec(
            cfg, torch.device("cpu"), precision=precision, amp_dtype=amp
        )
        micro_batches = cfg.DIST.PIPELINE.MICROBATCHES
        skeleton = functools.cache(functools.partial(_skeleton, cfg))
        run = RunFacts(spec, skeleton, turned_on(cfg), micro_batches)
        size = largest_train_size(cfg)
        trace = TraceSpec(
            model_spec(cfg), spec, loss_spec(cfg), size, cfg.MODEL.EMA, micro_batches
        )
        flops = count_flops(functools.partial(_skeleton, cfg), size)
        return cls(cfg, run, MemoryModel(trace), flops, amp)

    def machine(self, machine: PaperMachine) -> Machine:
        """``machine`` as the search weighs it; ConfigError for a flag it
        needs or an unknown device."""
        try:
            memory_mib = machine.memory_mib()
            speed = self.cpu_speed(machine.procs_per_node) if machine.on_cpu else None
            calibration = paper_calibration(
                machine.device,
                nodes=machine.nodes,
                procs_per_node=machine.procs_per_node,
                intra_gbps=machine.intra_gbps,
                inter_gbps=machine.inter_gbps,
                latency_us=machine.latency_us,
                amp_dtype=self.amp_dtype,
                conv_share=self.flops.conv_share,
                speed=speed,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from error
        return self.machine_of(
            calibration, machine.nodes, machine.procs_per_node, memory_mib
        )

    def cpu_speed(self, procs_per_node: int) -> DeviceSpeed | None:
        """This machine's CPU measured on the model, with the threads one of
        ``procs_per_node`` processes gets (:func:`~distribuuuu.dist.group.
        cpu_threads`); None for a model of more than
        :data:`MEASURED_PARAMETERS` parameters (its peak at
        :data:`~distribuuuu.plan.calibrate.PAPER_EFFICIENCY` then)."""
        if self.flops.parameters > MEASURED_PARAMETERS:
            return None
        cpus = len(os.sched_getaffinity(0))
        threads = torch.get_num_threads()
        torch.set_num_threads(cpu_threads(cpus, procs_per_node, os.environ))
        try:
            spec = dataclasses.replace(model_spec(self.cfg), pretrained=False)
            return measure_device(
                build_configured(spec),
                self.flops,
                image_size=largest_train_size(self.cfg),
                device=torch.device("cpu"),
                batch=self.cfg.TRAIN.BATCH_SIZE,
                amp_dtype=self.amp_dtype,
            )
        finally:
            torch.set_num_threads(threads)

    def machine_of(
        self,
        calibration: Calibration,
        nodes: int,
        procs_per_node: int,
        memory_mib: float,
    ) -> Machine:
        """``nodes`` x ``procs_per_node`` devices of ``memory_mib`` each, with
        ``calibration``'s figures (on paper, or measured by ``auto``)."""
        cluster = calibration.cluster(nodes, procs_per_node)
        workload = Workload.of(
            self.flops,
            self.amp_dtype,
            pipeline_microbatches=self.cfg.DIST.PIPELINE.MICROBATCHES,
            virtual_stages=self.cfg.DIST.PIPELINE.VIRTUAL_STAGES,
            optimizer_s=calibration.optimizer_s,
            sharded_tensor_s=calibration.sharded_tensor_s,
            sharded_collective_s=calibration.sharded_collective_s,
            gradient_share=compressed_share(
                strategy_spec(self.cfg).comm_hook, self.flops.shapes
            ),
        )
        return Machine(cluster, memory_mib, self.cfg.DIST.AUTO.HEADROOM, workload)

    def plan(self, machine: PaperMachine | Machine) -> PlanResult:
        """The plan on ``machine``: the global batch of plain ddp on its
        world, DIST.AUTO.HEADROOM of its memory."""
        if isinstance(machine, PaperMachine):
            machine = self.machine(machine)
        cluster = machine.cluster
        world = cluster.nodes * cluster.procs_per_node
        train = self.cfg.TRAIN
        global_batch = train.BATCH_SIZE * train.ACCUM_STEPS * world
        return plan(self.run, self.memory, machine, global_batch)


def plan_on_paper(cfg: CfgNode, machine: PaperMachine) -> PlanResult:
    """The plan of the run ``cfg`` on ``machine``.  Raises ConfigError for a
    flag the machine needs or an unknown device, and
    :class:`~distribuuuu.plan.search.NothingFitsError` when nothing fits."""
    return PaperRun.of(cfg, machine.on_cpu).plan(machine)
