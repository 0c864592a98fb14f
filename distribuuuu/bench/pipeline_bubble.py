"""The bubble of pipeline schedules, measured on real ranks (for
``tools/benchmark.py --only pipeline``).

Each of ``stages`` gloo processes holds an equal stage (a stack of linear
layers), so the work of every stage is the same.  A rank first times its
stage's forward and backward of one micro-batch alone; then it times whole
schedule steps of ``micro`` micro-batches.  The bubble is the share of a
step the rank does not spend computing: ``1 - micro x t_micro / t_step``
(waiting for the neighbours and the point-to-point transfers).  GPipe and
1F1B have the same ideal bubble, ``(S - 1) / (M + S - 1)`` (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters", 2021, sec.
2.2); 1F1B holds at most S micro-batches of activations instead of M.
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

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _stage(width: int, layers: int) -> nn.Module:
    return nn.Sequential(
        *[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    )


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (the schedule's first step also infers shapes)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def _step_seconds(
    kind, module, *, rank: int, stages: int, micro: int, settings: dict
) -> float:
    """Median seconds of a schedule step of ``micro`` micro-batches."""
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    schedule = kind(stage, micro, loss_fn=lambda y, t: y.sum())
    batch, width = settings["batch"], settings["width"]
    args = (torch.randn(batch, width),) if rank == 0 else ()
    target = torch.zeros(batch, width) if rank == stages - 1 else None
    return _median_seconds(
        lambda: schedule.step(*args, target=target), settings["repeats"]
    )


def _rank_main(rank: int, stages: int, port: int, settings: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=stages)
    try:
        torch.manual_seed(rank)
        width, batch = settings["width"], settings["batch"]
        module = _stage(width, settings["layers"])
        results = []
        for micro in settings["micro"]:
            x = torch.randn(batch // micro, width, requires_grad=rank > 0)

            def alone(x=x) -> None:
                module(x).sum().backward()

            t_micro = _median_seconds(alone, settings["repeats"])
            for name, kind in SCHEDULES.items():
                t_step = _step_seconds(
                    kind,
                    module,
                    rank=rank,
                    stages=stages,
                    micro=micro,
                    settings=settings,
                )
                results.append(
                    {
                        "schedule": name,
                        "micro_batches": micro,
                        "step_ms": 1e3 * t_step,
                        "bubble": max(0.0, 1 - micro * t_micro / t_step),
                        "ideal_bubble": (stages - 1) / (micro + stages - 1),
                    }
                )
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
    """Per schedule and micro-batch count: the step time and bubble, each the
    mean over the ranks, beside the ideal bubble."""
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
                **first,
                "step_ms": statistics.mean(r["step_ms"] for r in same),
                "bubble": statistics.mean(r["bubble"] for r in same),
            }
        )
    return rows


def format_bubble(rows: list[dict]) -> str:
    """The rows of :func:`measure_bubble` as a table."""
    lines = ["schedule  micro-batches  step ms  bubble  ideal"]
    lines += [
        f"{r['schedule']:<9} {r['micro_batches']:>13} {r['step_ms']:>8.1f} "
        f"{r['bubble']:>7.1%} {r['ideal_bubble']:>6.1%}"
        for r in rows
    ]
    return "\n".join(lines)
