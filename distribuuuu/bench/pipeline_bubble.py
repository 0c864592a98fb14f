"""The bubble of pipeline schedules, measured on real ranks (for
``tools/benchmark.py --only pipeline``).

Each of ``stages`` gloo processes holds an equal stage (a stack of linear
layers), so the work of every stage is the same.  The bubble is the share
of a schedule step the rank's thread does not run, ``1 - thread time /
wall time`` (waiting for its neighbours, while gloo's own threads move the
activations), measured within each step, so that it holds while the
machine's speed drifts (the test machine's does, in phases of seconds); the
median over the steps, the mean over the ranks.  GPipe and 1F1B
have the same ideal bubble, ``(S - 1) / (M + S - 1)`` (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters", 2021, sec.
2.2), which is what the planner predicts
(:func:`distribuuuu.plan.cost.bubble_fraction`); 1F1B holds at most S
micro-batches of activations instead of M.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from distribuuuu.dist.spawn import find_free_port
from distribuuuu.plan.calibrate import measure_link
from distribuuuu.plan.cost import bubble_fraction

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _stage(width: int, layers: int) -> nn.Module:
    return nn.Sequential(
        *[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    )


def _schedule_step(kind, module, *, rank: int, stages: int, micro: int, settings):
    """A function that runs one schedule step of ``micro`` micro-batches."""
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    schedule = kind(stage, micro, loss_fn=lambda y, t: y.sum())
    batch, width = settings["batch"], settings["width"]
    args = (torch.randn(batch, width),) if rank == 0 else ()
    target = torch.zeros(batch, width) if rank == stages - 1 else None
    return lambda: schedule.step(*args, target=target)


def _bubbles(
    module, *, rank: int, stages: int, micro: int, transfer_s: float, settings
) -> list:
    """Per schedule: the median over the repeats of the step's seconds, of
    the share of them this rank's thread did not run (``1 - thread time /
    wall time``) and of that thread time; ``transfer_s``, one activation's
    transfer priced on the link, goes with them for the prediction."""
    rows = []
    for name, kind in SCHEDULES.items():
        step = _schedule_step(
            kind, module, rank=rank, stages=stages, micro=micro, settings=settings
        )
        step()  # warm-up (the first step infers the shapes)
        walls, idle, computing = [], [], []
        for _ in range(settings["repeats"]):
            wall, cpu = time.perf_counter(), time.thread_time()
            step()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            walls.append(wall)
            idle.append(max(0.0, 1 - cpu / wall))
            computing.append(cpu)
        rows.append(
            {
                "schedule": name,
                "micro_batches": micro,
                "step_ms": 1e3 * statistics.median(walls),
                "bubble": statistics.median(idle),
                "ideal_bubble": bubble_fraction(stages, micro),
                "compute_s": statistics.median(computing),
                "transfer_s": transfer_s,
            }
        )
    return rows


def _rank_main(rank: int, stages: int, port: int, settings: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=stages)
    try:
        torch.manual_seed(rank)
        module = _stage(settings["width"], settings["layers"])
        link = measure_link(torch.device("cpu"))
        assert link is not None  # a group of two ranks at least
        activation = 4 * settings["width"] * settings["batch"]  # float32
        results = [
            row
            for micro in settings["micro"]
            for row in _bubbles(
                module,
                rank=rank,
                stages=stages,
                micro=micro,
                transfer_s=link.seconds(activation / micro),
                settings=settings,
            )
        ]
        gathered: list[list | None] = [None] * stages
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def measure_bubble(
    stages: int = 2,
    micro: tuple[int, ...] = (2, 4, 8),
    width: int = 1024,
    layers: int = 8,
    batch: int = 512,
    repeats: int = 5,
) -> list[dict]:
    """Per schedule and micro-batch count: the step time and bubble, beside
    the ideal bubble and the planner's prediction of the share of the step
    a stage does not compute (the ideal bubble's slots, each with its two
    transfers priced on the measured link, as
    :func:`distribuuuu.plan.cost.pipeline_cost` prices them), each the mean
    over the ranks."""
    settings = {"micro": micro, "width": width, "layers": layers}
    settings.update(batch=batch, repeats=repeats)
    with tempfile.TemporaryDirectory(prefix="distribuuuu-bubble-") as work:
        out = os.path.join(work, "bubble.pt")
        mp.start_processes(
            _rank_main,
            args=(stages, find_free_port(), settings, out),
            nprocs=stages,
            start_method="spawn",
        )
        per_rank = torch.load(out, weights_only=True)
    rows = []
    for index, first in enumerate(per_rank[0]):
        same = [ranks[index] for ranks in per_rank]
        rows.append(
            {
                "schedule": first["schedule"],
                "micro_batches": first["micro_batches"],
                "ideal_bubble": first["ideal_bubble"],
                "step_ms": statistics.mean(r["step_ms"] for r in same),
                "bubble": statistics.mean(r["bubble"] for r in same),
                "predicted_bubble": _predicted_bubble(same, stages),
            }
        )
    return rows


def _predicted_bubble(ranks: list[dict], stages: int) -> float:
    """The share of a step the planner predicts a stage does not compute,
    the mean over the ranks: the busiest rank's slot (its compute of one
    micro-batch, and the two transfers of one) taken ``M + S - 1`` times
    sets the step, as :func:`distribuuuu.plan.cost.pipeline_cost` has it."""
    micro = ranks[0]["micro_batches"]
    slot = max(r["compute_s"] / micro + 2 * r["transfer_s"] for r in ranks)
    step = (micro + stages - 1) * slot
    return statistics.mean(1 - r["compute_s"] / step for r in ranks)


def format_bubble(rows: list[dict]) -> str:
    """The rows of :func:`measure_bubble` as a table."""
    lines = ["schedule  micro-batches  step ms  bubble  ideal  predicted"]
    lines += [
        f"{r['schedule']:<9} {r['micro_batches']:>13} {r['step_ms']:>8.1f} "
        f"{r['bubble']:>7.1%} {r['ideal_bubble']:>6.1%} "
        f"{r['predicted_bubble']:>10.1%}"
        for r in rows
    ]
    return "\n".join(lines)
