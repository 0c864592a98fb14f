"""How close the planner's memory per rank comes to real ranks (for
``tools/benchmark.py --only plan``).

For each case (a strategy, its degrees and batch) on 2 and 4 gloo
processes, the planner predicts the peak memory of the fullest rank
(:class:`~distribuuuu.plan.memory.MemoryModel`, fake tensors in this
process); then real ranks build the same run and train it through the
engine's own step while ``MemTracker`` follows every tensor they hold, the
strategy's own buffers included (DDP's buckets, FSDP's gathered blocks,
DeepSpeed's flat partitions); the measured peak is the fullest rank's over a
warm-up step and two more.  The issue's tolerance: 5%, 10% for pipeline,
tensor parallelism and DeepSpeed.

All cases of one world run in one spawn of that world's processes.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distribuuuu.dist.group import release_groups
from distribuuuu.dist.spawn import find_free_port
from distribuuuu.engine.loop import train_step
from distribuuuu.engine.losses import LossSpec, build_train_loss
from distribuuuu.engine.state import BatchPlan, Progress, RunClock, TrainState
from distribuuuu.models import build_configured
from distribuuuu.models.ema import ModelEma
from distribuuuu.models.spec import ModelSpec
from distribuuuu.optim.build import build_optimizer, build_param_groups, state_tensors
from distribuuuu.optim.spec import OptimizerSpec
from distribuuuu.plan.candidate import Candidate
from distribuuuu.plan.memory import MIB, MemoryModel
from distribuuuu.plan.tracing import PeakTracker, TraceSpec, quiet
from distribuuuu.reporting.meters import MetricSums
from distribuuuu.strategies import StrategySpec, build_strategy
from distribuuuu.strategies.chain import prepare_model

# The tolerance, by strategy (tensor parallelism: 10% too).
TOLERANCE = {"pipeline": 0.10, "deepspeed": 0.10}
TENSOR_PARALLEL_TOLERANCE = 0.10
DEFAULT_TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model and run the cases share."""

    arch: str = "vit_tiny_patch4"
    image_size: int = 32
    num_classes: int = 10
    optimizer: str = "adamw"
    ema: bool = True

    def trace_spec(self, ema: bool | None = None) -> TraceSpec:
        """What the planner traces for this workload."""
        optimizer = OptimizerSpec(
            name=self.optimizer,
            base_lr=0.1,
            weight_decay=0.05,
            momentum=0.9,
            dampening=0.0,
            nesterov=False,
            betas=(0.9, 0.999),
            eps=1e-8,
            rmsprop_alpha=0.99,
            lars_eta=0.001,
            no_decay_norm_bias=True,
            layer_decay=1.0,
        )
        model = ModelSpec(
            arch=self.arch,
            num_classes=self.num_classes,
            pretrained=False,
            dropout=-1.0,
            drop_path=-1.0,
            bn_momentum=-1.0,
            bn_eps=-1.0,
        )

        def optimizer_of(module: torch.nn.Module) -> torch.optim.Optimizer:
            return build_optimizer(module, optimizer)

        def groups_of(module: torch.nn.Module) -> list:
            return build_param_groups(module, optimizer)

        strategy = StrategySpec(
            arch=self.arch,
            image_size=self.image_size,
            build_optimizer=optimizer_of,
            param_groups=groups_of,
            optimizer_state_tensors=state_tensors(optimizer),
        )
        loss = LossSpec(self.num_classes)
        uses_ema = self.ema if ema is None else ema
        return TraceSpec(model, strategy, loss, self.image_size, ema=uses_ema)


def case(strategy: str, world: int, micro_batch: int, **fields: Any) -> Candidate:
    """A candidate of ``strategy`` on ``world`` ranks (its replicas counted
    from its degrees)."""
    stages = fields.get("pipeline_stages") or 1
    degree = fields.get("tensor_parallel") or 1
    values = {
        "tensor_parallel": None,
        "pipeline_stages": None,
        "pipeline_schedule": None,
        "shard_size": None,
        "zero_stage": None,
        "offload": None,
        "accum_steps": 1,
        "act_ckpt": False,
        **fields,
    }
    return Candidate(
        strategy=strategy,
        data_parallel=world // (stages * degree),
        micro_batch=micro_batch,
        **values,
    )


def default_cases(world: int, batch: int = 32) -> list[Candidate]:
    """The issue's cases on ``world`` ranks: ddp, zero1, fsdp with and
    without activation checkpointing, hsdp 2 x 2, pipeline GPipe and 1F1B,
    tensor parallel 2, fsdp x tensor parallel and DeepSpeed 1-3."""
    cases = [
        case("ddp", world, batch),
        case("zero1", world, batch),
        case("fsdp", world, batch),
        case("fsdp", world, batch, act_ckpt=True),
        case("pipeline", world, batch, pipeline_stages=2, pipeline_schedule="gpipe"),
        case("pipeline", world, batch, pipeline_stages=2, pipeline_schedule="1f1b"),
        case("ddp", world, batch, tensor_parallel=2),
    ]
    if world >= 4:
        cases.append(case("hsdp", world, batch, shard_size=2))
        cases.append(case("fsdp", world, batch, tensor_parallel=2))
    cases += [case("deepspeed", world, batch, zero_stage=s) for s in (1, 2, 3)]
    return cases


def tolerance(candidate: Candidate) -> float:
    """The issue's tolerance for ``candidate``'s prediction."""
    if (candidate.tensor_parallel or 1) > 1:
        return TENSOR_PARALLEL_TOLERANCE
    return TOLERANCE.get(candidate.strategy, DEFAULT_TOLERANCE)


def takes_ema(candidate: Candidate) -> bool:
    """DeepSpeed's ZeRO-3 refuses MODEL.EMA (its parameters are partitioned)."""
    return not (candidate.strategy == "deepspeed" and candidate.zero_stage == 3)


def measure_rank(
    rank: int, world: int, workload: Workload, candidate: Candidate, steps: int = 3
) -> float:
    """This rank's peak MiB training ``candidate`` through the engine's step
    (``steps`` steps, the first a warm-up that creates the optimizer state).

    The tracker follows what the strategy allocates from the moment it
    prepares the model; the model is built before and tracked as it is.
    """
    spec = workload.trace_spec(ema=workload.ema and takes_ema(candidate))
    run = dataclasses.replace(
        candidate.strategy_spec(spec.strategy, spec.pipeline_micro_batches),
        device=torch.device("cpu"),
        channels_last=False,
    )
    torch.manual_seed(rank)
    with quiet():
        strategy = build_strategy(run)
        model = build_configured(spec.model)
        tracker = PeakTracker(modules=False)
        tracker.track_external(model)
        with tracker:
            tracker.restart(recording=False)
            model = prepare_model(strategy, model)
            ema = ModelEma(model, 0.999, warmup=True) if spec.ema else None
            state = TrainState(
                strategy=strategy,
                model=model,
                optimizer=strategy.build_optimizer(model),
                scaler=torch.amp.GradScaler("cpu", enabled=False),
                amp_dtype=None,
                device=torch.device("cpu"),
                normalize=torch.nn.Identity(),
                plan=BatchPlan(candidate.micro_batch, candidate.accum_steps, world),
                progress=Progress(),
                clock=RunClock(1, 0),
                writer=None,  # type: ignore[arg-type]
                classes=[],
                ema=ema,
            )
            loss_fn = build_train_loss(spec.loss)
            meter = MetricSums(state.device, 1)
            size = spec.image_size
            for _ in range(steps):
                images = torch.randn(candidate.micro_batch, 3, size, size)
                targets = torch.randint(0, spec.loss.num_classes, (len(images),))
                batches = [(images, targets)] * candidate.accum_steps
                train_step(state, iter(batches), meter, loss_fn)
            peak = tracker.peak
    del state, model, ema, strategy
    release_groups()
    return peak / MIB


def _rank_main(
    rank: int, world: int, port: int, workload: Workload, cases: list, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        peaks: list[float | str] = []
        for candidate in cases:
            try:
                peaks.append(measure_rank(rank, world, workload, candidate))
            except Exception as error:  # noqa: BLE001 - reported as the case's row
                peaks.append(f"{type(error).__name__}: {error}")
            dist.barrier()
        torch.save(peaks, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
        release_groups()


def measure_peaks(
    world: int, workload: Workload, cases: list[Candidate]
) -> list[float | str]:
    """The fullest rank's measured peak MiB of each case, on ``world`` gloo
    processes started once for all of them (or why the case failed)."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank_main,
            args=(world, find_free_port(), workload, cases, out),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        ranks = [
            torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True)
            for r in range(world)
        ]
    found: list[float | str] = []
    for index in range(len(cases)):
        each = [rank[index] for rank in ranks]
        failed = [peak for peak in each if isinstance(peak, str)]
        found.append(failed[0] if failed else max(each))
    return found


def predict_peaks(
    workload: Workload, cases: list[Candidate]
) -> list[tuple[float, str]]:
    """The planner's peak MiB (and how it was found) of each case."""
    models = {ema: MemoryModel(workload.trace_spec(ema=ema)) for ema in (False, True)}
    found = []
    for candidate in cases:
        estimate = models[workload.ema and takes_ema(candidate)].estimate(candidate)
        found.append((estimate.peak_mib, estimate.method))
    return found


def describe(candidate: Candidate) -> str:
    """A few words naming a case."""
    words = [candidate.strategy]
    if (candidate.tensor_parallel or 1) > 1:
        words.append(f"tp{candidate.tensor_parallel}")
    if candidate.pipeline_stages:
        words.append(f"{candidate.pipeline_stages}st {candidate.pipeline_schedule}")
    if candidate.shard_size:
        words.append(
            f"{candidate.data_parallel // candidate.shard_size}x{candidate.shard_size}"
        )
    if candidate.zero_stage:
        words.append(f"zero{candidate.zero_stage}")
    if candidate.act_ckpt:
        words.append("ckpt")
    return " ".join(words)


def plan_accuracy(
    workload: Workload | None = None,
    worlds: tuple[int, ...] = (2, 4),
    batch: int = 32,
    deepspeed: bool | None = None,
) -> dict:
    """Predicted against measured peak memory per rank for the issue's cases
    on each of ``worlds``; DeepSpeed's cases where it is installed (or as
    ``deepspeed`` says)."""
    from distribuuuu.strategies.deepspeed import deepspeed_installed

    workload = workload or Workload()
    if deepspeed is None:
        deepspeed = deepspeed_installed()
    rows = []
    for world in worlds:
        cases = [
            c
            for c in default_cases(world, batch)
            if deepspeed or c.strategy != "deepspeed"
        ]
        tic = time.perf_counter()
        predicted = predict_peaks(workload, cases)
        planned = time.perf_counter() - tic
        measured = measure_peaks(world, workload, cases)
        for candidate, (mib, method), real in zip(cases, predicted, measured):
            if isinstance(real, str):
                rows.append(
                    {
                        "case": describe(candidate),
                        "world": world,
                        "predicted_mib": mib,
                        "failed": real,
                    }
                )
                continue
            error = mib / real - 1
            rows.append(
                {
                    "case": describe(candidate),
                    "world": world,
                    "candidate": candidate.as_dict(),
                    "predicted_mib": mib,
                    "measured_mib": real,
                    "error": error,
                    "method": method,
                    "tolerance": tolerance(candidate),
                    "within": abs(error) <= tolerance(candidate),
                }
            )
        rows.append({"case": "planning time", "world": world, "seconds": planned})
    return {
        "workload": dataclasses.asdict(workload),
        "batch": batch,
        "deepspeed": deepspeed,
        "rows": rows,
    }


def format_accuracy(result: dict) -> str:
    """The table of :func:`plan_accuracy`."""
    lines = [
        f"plan memory: {result['workload']['arch']} at "
        f"{result['workload']['image_size']} px, batch {result['batch']} per replica",
        f"{'case':<28}{'world':>6}{'predicted':>11}{'measured':>10}{'error':>8}  how",
    ]
    for row in result["rows"]:
        if "seconds" in row:
            lines.append(
                f"  planning {row['world']} ranks' cases: {row['seconds']:.1f} s"
            )
            continue
        if "failed" in row:
            lines.append(f"{row['case']:<28}{row['world']:>6}  failed: {row['failed']}")
            continue
        mark = "" if row["within"] else f"  (over {row['tolerance']:.0%})"
        lines.append(
            f"{row['case']:<28}{row['world']:>6}{row['predicted_mib']:>11.1f}"
            f"{row['measured_mib']:>10.1f}{row['error']:>+8.1%}  {row['method']}{mark}"
        )
    if not result["deepspeed"]:
        lines.append("DeepSpeed is not installed: its cases were left out")
    return "\n".join(lines)
