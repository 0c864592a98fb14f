"""Device audit (issue 33): every strategy, prepared on the meta device in a
fake world of 4 ranks, hands its process groups tensors on its training
device only.

Each strategy runs, on ranks of torch's fake process group one after the
other in this process, what it owns of a run: prepare (the model and the
optimizer), the first training step, the evaluation (its module and a
forward pass: the pipeline's relay through the stages) and the save paths
(the training checkpoint's entries and best.pth's whole weights).  The audit
(tests/device_audit.py) records the device of every tensor each collective
hands to each group, torch's own included (DDP's reducer, SyncBN, ZeRO,
FSDP, DTensor's functional collectives), and fails on one that is not on
meta.  The control group of host-side checks (gloo beside NCCL) may carry
CPU tensors; object collectives pickle onto a device torch picks from the
group's backend, and are recorded only.  Layouts: ddp (with SyncBN), zero1,
fsdp, pipeline 2 stages x 2 replicas, tensor parallel 2 x ddp and x fsdp.

Where meta or a fake group cannot do what a run does, and so what is not
covered:

* the pipeline's schedule: torch 2.14 refuses to infer stage shapes over a
  fake group (our stages are built without static shapes), so a stand-in
  runs each stage's micro-batches; the audit checks the device and group the
  strategy gave each ``PipelineStage`` and the device of what it hands the
  schedule, not torch's own P2P traffic inside the schedule;
* DDP's reducer waits for the result of its all-reduce, which a fake group
  leaves empty on meta: a communication hook all-reduces the same bucket
  over the same group in place of DDP's built-in one;
* FSDP2 runs on meta only through two private shims (``fsdp_on_meta``);
  ``torch.autocast`` has no meta device, so the step runs in full precision;
* what DCP writes (``checkpoint.save_sharded``: files, and DCP's planning
  over object collectives): a meta tensor has no bytes to write, so the
  sharded saves stop where the strategy hands its shards to DCP;
* ranks simulated: 0 (and 1-3 for ZeRO's consolidation, stage 1 for the
  pipeline); the others run the same code on other ranks of their groups;
* DeepSpeed (its own communication layer) and DataParallel (CUDA only):
  fakes of ``deepspeed`` and of the CUDA calls record which device each is
  handed (a table, the last parametrized test).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.machinery
import os
import sys
import types
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.optim  # noqa: F401  (before the audits patch torch)
import torch.nn.functional as F
from device_audit import CONTROL, WORLD, CollectiveAudit, fake_rank, fsdp_on_meta
from fake_devices import FakeCuda, GpuShyLinear
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from distribuuuu import checkpoint as cp
from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.models import build_model, vit
from distribuuuu.reporting.meters import MetricSums
from distribuuuu.strategies import base, build_strategy, dp, pipeline
from distribuuuu.strategies.chain import split_tensors, wrap

# torch.distributed.optim is imported above, before any audit patches torch:
# on torch 2.11 its import scripts the functional optimizers, and TorchScript
# fails on the patched names (the zero1 audit failed first in its process).
WORLD_SIZE = 4
META = torch.device("meta")
BATCH = 8
ALL = ("step", "evaluation", "save")
VIT = "vit_tiny_patch4"  # a smaller one of its class is built: one block


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one strategy runs in the audit.

    ``turns``: (rank, phases after prepare) in the order the fake ranks run;
    a later rank receives what an earlier one sent (the pipeline's relay
    from stage 0 to stage 1, ZeRO's optimizer shards gathered on rank 0),
    and stands in for the ranks not run yet (ZeRO's ranks 1 to 3 send
    their shards to each other: rank 1, which sends first, runs first).
    ``must_use``: (phase, group) pairs that must see collectives, so that an
    audit that saw nothing cannot pass.
    """

    keys: tuple[str, ...]
    turns: tuple[tuple[int, tuple[str, ...]], ...]
    must_use: frozenset[tuple[str, str]]
    arch: str = "resnet8"


def _uses(*pairs: str) -> frozenset[tuple[str, str]]:
    return frozenset(tuple(pair.split(":")) for pair in pairs)


LAYOUTS = {
    "ddp": Layout(
        ("DIST.STRATEGY", "ddp", "MODEL.SYNCBN", "True"),
        ((0, ALL),),
        _uses("prepare:world", "step:world", "evaluation:world"),
    ),
    "zero1": Layout(
        ("DIST.STRATEGY", "zero1"),
        ((1, ("save",)), (2, ("save",)), (3, ("save",)), (0, ALL)),
        _uses("prepare:world", "step:world", "evaluation:world", "save:control"),
    ),
    "fsdp": Layout(
        ("DIST.STRATEGY", "fsdp"),
        ((0, ALL),),
        _uses("prepare:world", "step:world", "evaluation:world", "save:world"),
    ),
    "pipeline 2 x 2": Layout(
        ("DIST.STRATEGY", "pipeline", "DIST.PIPELINE.STAGES", "2")
        + ("OPTIM.CLIP_GRAD_NORM", "1.0"),
        ((0, ("step", "evaluation")), (1, ALL), (0, ("save",))),
        _uses("prepare:world", "step:dp", "step:pp", "evaluation:dp")
        | _uses("evaluation:pp", "save:control"),
    ),
    "tensor 2 x ddp": Layout(
        ("DIST.STRATEGY", "ddp", "DIST.TENSOR_PARALLEL", "2"),
        ((0, ALL),),
        _uses("prepare:world", "step:tp", "step:dp")
        | _uses("evaluation:tp", "save:tp"),
        arch=VIT,
    ),
    "tensor 2 x fsdp": Layout(
        ("DIST.STRATEGY", "fsdp", "DIST.TENSOR_PARALLEL", "2"),
        ((0, ALL),),
        _uses("prepare:world", "step:tp", "step:dp")
        | _uses("evaluation:tp", "evaluation:dp", "save:tp", "save:dp"),
        arch=VIT,
    ),
}


def _model(arch: str) -> nn.Module:
    """A tiny model on the CPU, as the trainer builds it before the strategy."""
    torch.manual_seed(0)
    if arch == VIT:  # the same class and plan, one block
        return vit.VisionTransformer(4, 32, 1, 2, 64, 10)
    return build_model(arch, 10)


class StandInSchedule:
    """Runs a pipeline stage's micro-batches in place of torch's schedule,
    which cannot infer the stages' shapes over a fake group: the first stage
    from the images, the others from an activation of the shape the stage
    before produced (on an earlier fake rank), backward from the loss or
    from ones."""

    def __init__(self, stage, micro: int, loss_fn, shapes: dict):
        self.stage, self.micro, self.loss_fn = stage, micro, loss_fn
        self.shapes, self.handed = shapes, []

    def step(self, *args, target=None):
        stage, micro = self.stage, self.micro
        self.handed += [
            tensor.device for tensor in (*args, target) if tensor is not None
        ]
        if stage.is_first:
            inputs = args[0].tensor_split(micro)
        else:
            shape = self.shapes[stage.stage_index - 1]
            inputs = [
                torch.empty(shape, device=stage.device, requires_grad=True)
                for _ in range(micro)
            ]
        targets = target.tensor_split(micro) if stage.is_last else [None] * micro
        outputs = []
        for x, y in zip(inputs, targets):
            out = stage.submod(x)
            if stage.is_last:
                self.loss_fn(out, y).backward()
            else:
                self.shapes[stage.stage_index] = out.shape
                out.backward(torch.ones_like(out))
            outputs.append(out.detach())
        return torch.cat(outputs) if stage.is_last else None


def _all_reduce_at_once(state, bucket):  # no annotation: DDP checks its text
    """DDP's default communication hook (the mean of the bucket over the
    world), completed at once: on meta the fake group's work has no result
    for DDP's reducer to wait for."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    done = torch.futures.Future()
    done.set_result(buffer.div_(dist.get_world_size()))
    return done


def _name_groups(audit: CollectiveAudit, strategy, model: nn.Module) -> None:
    """Name the groups the strategy built: its pp and dp groups, and the
    mesh dimensions of its DTensor weights (tp; dp of FSDP x TP)."""
    for name in ("pp", "dp"):
        group = getattr(strategy, f"{name}_group", None)
        if group is not None:
            audit.name_group(group, name)
    for param in model.parameters():
        if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names:
            mesh = param.device_mesh
            for name in mesh.mesh_dim_names:
                audit.name_group(mesh.get_group(name), name)


def _run_turn(audit, layout, rank: int, phases, tmp_path, monkeypatch, shapes):
    """Fake rank ``rank``: prepare, then ``phases``, each recorded apart."""
    schedules = []

    def stand_in(stage, micro, loss_fn, scale_grads):
        schedules.append(StandInSchedule(stage, micro, loss_fn, shapes))
        return schedules[-1]

    monkeypatch.setitem(pipeline.SCHEDULES, "1f1b", stand_in)
    # torch.autocast knows no meta device, even switched off: full precision.
    for module in (base, pipeline):
        monkeypatch.setattr(module, "autocast", lambda device, dtype: nullcontext())
    with fake_rank(rank, WORLD_SIZE):
        audit.begin_turn()
        cfg = load_cfg(opts=["MODEL.ARCH", layout.arch, *layout.keys])
        strategy = build_strategy(strategy_spec(cfg, META))
        audit.phase = "prepare"
        model = wrap(strategy, split_tensors(strategy, _model(layout.arch)))
        optimizer = strategy.build_optimizer(model)
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, _all_reduce_at_once)
        _name_groups(audit, strategy, model)
        for schedule in schedules:
            assert (schedule.stage.device, schedule.stage.group) == (
                META,
                strategy.pp_group,
            ), "a PipelineStage off the training device or the pp group"
        images = torch.randn(BATCH, 3, 28, 28, device=META)
        labels = torch.randint(10, (BATCH,), device=META)
        if "step" in phases:
            audit.phase = "step"
            state = types.SimpleNamespace(
                model=model,
                optimizer=optimizer,
                scaler=torch.amp.GradScaler("cpu", enabled=False),
                amp_dtype=None,
                plan=types.SimpleNamespace(accum=1),
                ema=None,
                norm_wanted=True,  # a print step: the norm's collectives too
                grad_norm=None,
            )
            batches = [(images, labels, labels)]
            meter = MetricSums(META, topk=5)
            strategy.train_step(state, batches, meter, F.cross_entropy)
            for schedule in schedules:
                assert set(schedule.handed) == {META}, "the schedule got host data"
        if "evaluation" in phases:
            audit.phase = "evaluation"
            module = strategy.eval_model(model).eval()
            with torch.no_grad():
                module(images)
        if "save" in phases:
            audit.phase = "save"
            # DCP cannot write meta tensors: the save stops where it would.
            writer = cp.CheckpointWriter(str(tmp_path))
            written = mock.patch.object(writer, "sharded", return_value=("x", {}))
            with written:
                strategy.save_weights(model, optimizer, None, writer, "ckpt")
            strategy.model_state_dict(model)  # best.pth


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_collective_gets_tensors_on_the_training_device(
    name, tmp_path, monkeypatch
):
    layout, audit, shapes = LAYOUTS[name], CollectiveAudit(), {}
    with audit.recording(), fsdp_on_meta():
        for rank, phases in layout.turns:
            _run_turn(audit, layout, rank, phases, tmp_path, monkeypatch, shapes)
    counts = collections.Counter(map(str, audit.off_device(META)))
    wrong = "\n".join(f"{count} x {handed}" for handed, count in counts.items())
    assert not wrong, f"{name} handed tensors off the training device (meta):\n{wrong}"
    missing = layout.must_use - audit.groups_used()
    assert not missing, f"{name}: no collective seen in {sorted(missing)}"


def test_the_audit_flags_host_tensors_on_the_main_group_only():
    """A CPU tensor broadcast over the default group is flagged; over the
    control group it is not; a meta one is never."""
    audit = CollectiveAudit()
    with audit.recording(), fake_rank(1, WORLD_SIZE):
        from distribuuuu.dist import group as du

        audit.phase = "check"
        dist.broadcast(torch.zeros(2), 0)
        dist.broadcast(torch.zeros(2, device=META), 0)
        dist.all_reduce(torch.zeros(2), group=du.control_group())
    flagged = [(h.group, h.devices) for h in audit.off_device(META)]
    assert flagged == [(WORLD, ("cpu",))]
    assert {h.group for h in audit.handed} == {WORLD, CONTROL}


# --- strategies meta cannot host: the device each hands over ----------------- #
@dataclasses.dataclass(frozen=True)
class Handover:
    """One row of the table: a strategy on ``device`` with ``gpus`` visible
    GPUs (the launch's ``env``), and what the fakes must see handed over."""

    strategy: str
    device: str
    gpus: int
    env: tuple[tuple[str, str], ...]
    handed: tuple[tuple[str, str], ...]


TORCHRUN = (("LOCAL_RANK", "1"),)
# srun --gpus-per-task=1: each task sees its own GPU, as cuda:0.
SRUN = (("SLURM_PROCID", "1"), ("SLURM_LOCALID", "1"), ("SLURM_NTASKS", "4"))
SRUN += (("SLURM_STEP_ID", "0"), ("SLURM_NODELIST", "node1"))
HANDOVERS = [
    # DeepSpeed: the model on the device; its accelerator of the device's
    # type; the engine's device, the GPU of LOCAL_RANK, the device itself.
    Handover(
        "deepspeed",
        "cuda:1",
        2,
        TORCHRUN,
        (("model", "cuda:1"), ("accelerator", "cuda"), ("engine", "cuda:1")),
    ),
    Handover(
        "deepspeed",
        "cuda:0",
        1,
        SRUN,
        (("model", "cuda:0"), ("accelerator", "cuda"), ("engine", "cuda:0")),
    ),
    Handover("deepspeed", "cpu", 0, SRUN, (("model", "cpu"), ("accelerator", "cpu"))),
    # DataParallel: the model on the device, which leads its GPUs and
    # gathers the outputs; on one GPU no DataParallel.
    Handover(
        "dp",
        "cuda:1",
        2,
        (),
        (("model", "cuda:1"), ("device_ids", "1,0"), ("output_device", "1")),
    ),
    Handover("dp", "cuda:0", 1, (), (("model", "cuda:0"),)),
]


def _fake_deepspeed(cuda: FakeCuda, seen: dict) -> types.ModuleType:
    """A ``deepspeed`` module whose engine records what it was handed and,
    as DeepSpeed's does, makes the GPU of LOCAL_RANK current."""
    module = types.ModuleType("deepspeed")
    module.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)

    def initialize(model, optimizer, config):
        seen["model"] = str(model.moved_to or next(model.parameters()).device)
        seen["accelerator"] = os.environ["DS_ACCELERATOR"]
        if seen["accelerator"] == "cuda":
            cuda.set_device(int(os.environ["LOCAL_RANK"]))
            seen["engine"] = f"cuda:{cuda.current_device()}"
        return model, optimizer, None, None

    module.initialize = initialize
    module.init_distributed = lambda dist_backend, dist_init_required: None
    module.ops = types.SimpleNamespace(__compatible_ops__={})
    return module


class _DataParallelSeen(nn.Module):
    """Stands in for DataParallel (which asks CUDA for its GPUs' properties)
    and records what it was given."""

    def __init__(self, module, device_ids=None, output_device=None, *, seen: dict):
        super().__init__()
        self.module = module
        every = device_ids is None  # DataParallel's default: every GPU, from 0
        seen["device_ids"] = "all" if every else ",".join(map(str, device_ids))
        seen["output_device"] = str(output_device)


@pytest.mark.parametrize("row", HANDOVERS, ids=lambda r: f"{r.strategy}-{r.device}")
def test_strategies_meta_cannot_host_hand_over_the_training_device(row, monkeypatch):
    seen: dict = {}
    device = torch.device(row.device)
    cuda = FakeCuda(row.gpus, current=device.index or 0)
    if row.gpus:
        cuda.install(monkeypatch)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.setenv(name, "")  # restored (or removed) after the test
        monkeypatch.delenv(name)
    for name, value in row.env:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DS_ACCELERATOR", "")
    monkeypatch.setitem(sys.modules, "deepspeed", _fake_deepspeed(cuda, seen))
    monkeypatch.setattr(
        dp, "AutocastDataParallel", functools.partial(_DataParallelSeen, seen=seen)
    )
    cfg = load_cfg(
        opts=["DIST.STRATEGY", row.strategy, "TRAIN.MIXED_PRECISION", "none"]
    )
    strategy = build_strategy(strategy_spec(cfg, device))
    model = GpuShyLinear()
    if row.strategy == "deepspeed":
        with fake_rank(1, WORLD_SIZE):  # DeepSpeed's collectives are its own
            strategy.prepare_model(model)
    else:
        strategy.prepare_model(model)
        seen["model"] = str(model.moved_to)
    assert tuple(sorted(seen.items())) == tuple(sorted(row.handed))


def test_the_private_torch_apis_of_the_audit_still_work():
    """The audit stands on private torch APIs: the fake process group
    (torch.testing._internal.distributed.fake_pg), c10d ops that carry their
    group and functional collectives that name theirs, seen by a dispatch
    mode (torch.utils._python_dispatch), with kernels for meta tensors."""
    from torch.distributed import _functional_collectives as funcol

    audit = CollectiveAudit()
    with audit.recording(), fake_rank(2, WORLD_SIZE):
        where = (dist.get_rank(), dist.get_world_size())
        assert where == (2, 4), (
            f"torch's private fake process group made rank {where[0]} of "
            f"{where[1]}, not 2 of 4: the device audit needs another way to "
            "simulate ranks in one process"
        )
        audit.phase = "check"
        pair = dist.new_group([2, 3])
        dist.broadcast(torch.zeros(2, device=META), 0)
        funcol.all_reduce(torch.zeros(2, device=META), "sum", pair)
    seen = [(h.group, h.op, h.devices) for h in audit.handed]
    assert seen == [
        (WORLD, "broadcast_", ("meta",)),
        ("ranks 2,3", "all_reduce", ("meta",)),
    ], (
        f"the audit saw {seen}: torch's private c10d / functional collective "
        "ops or their dispatch to a TorchDispatchMode changed"
    )
    from torch.distributed.device_mesh import _get_device_handle

    with fsdp_on_meta():
        assert _get_device_handle("meta") is torch.meta, (
            "torch's private _get_device_handle no longer finds a device's "
            "module as torch.<type>: fsdp_on_meta must give FSDP2 its meta "
            "module another way"
        )
