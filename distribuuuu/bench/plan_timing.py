"""Step time predicted by the planner's cost model against step time
measured, on real gloo ranks (for ``tools/benchmark.py --only plan``).

Every rank builds one copy of the model per way of training it (no
gradient sync, ddp, zero1, fsdp), then times their optimizer steps
interleaved, round after round, each round starting with the next way, so
that the machine's drift and the order touch each alike; a round's step
takes the time of its slowest rank, and each way's figure is the median
over the rounds.  Each round starts with the ranks calibrating
(:func:`distribuuuu.plan.calibrate.calibrate`, as ``DIST.STRATEGY auto``
does at start-up) and predicting each way's step
(:func:`distribuuuu.plan.cost.step_cost`): the median of those predictions
judges the cost model under the conditions the steps met, and the first
round's is what a run planning at start-up would have predicted.  The two
differ where the machine's speed drifts over seconds: on the 2-core test
machine a pass of vit_tiny_patch4 at batch 32 takes 700-1200 ms in phases
of a few seconds, and a 2-second calibration catches one phase.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distribuuuu.dist.spawn import find_free_port
from distribuuuu.models import build_model
from distribuuuu.plan.calibrate import calibrate
from distribuuuu.plan.cost import Workload, step_cost
from distribuuuu.plan.flops import count_flops
from distribuuuu.plan.search import PREFERENCE_WINDOW, SIMPLER_FIRST
from distribuuuu.strategies.fsdp import shard_fully
from distribuuuu.strategies.zero1 import shard_optimizer

WAYS = ("none", "ddp", "zero1", "fsdp")
# Two strategies whose predicted steps differ by more than ORDER_MARGIN must
# be measured in the same order; the way the planner would choose must be
# measured within CHOSEN_SLACK of the fastest measured.
ORDER_MARGIN, CHOSEN_SLACK = 0.15, 0.10


@dataclass(frozen=True)
class TimedPlan:
    """A candidate as the cost model reads it (one data-parallel strategy)."""

    strategy: str
    data_parallel: int
    micro_batch: int
    tensor_parallel: int | None = None
    pipeline_stages: int | None = None
    pipeline_schedule: str | None = None
    shard_size: int | None = None
    zero_stage: int | None = None
    offload: object = None
    accum_steps: int = 1
    act_ckpt: bool = False


def _trainers(model: nn.Module, world: int) -> dict:
    """(model, optimizer) of each way of training a copy of ``model``."""
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    zero = DistributedDataParallel(copy.deepcopy(model))
    sharded = shard_fully(copy.deepcopy(model), torch.device("cpu"), False, None)
    zero_optimizer = shard_optimizer(adamw(zero.parameters()))
    return {
        "none": (plain, adamw(plain.parameters())),
        "ddp": (ddp, adamw(ddp.parameters())),
        "zero1": (zero, zero_optimizer),
        "fsdp": (sharded, adamw(sharded.parameters())),
    }


def _step(model: nn.Module, optimizer, images, targets) -> None:
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(images), targets).backward()
    optimizer.step()


def _predict(model: nn.Module, flops, settings: dict, world: int) -> tuple:
    """Calibrate on the live group and predict each way's step (seconds)."""
    tic = time.perf_counter()
    measured = calibrate(
        model,
        flops,
        image_size=settings["image_size"],
        device=torch.device("cpu"),
        procs_per_node=world,
        batch=settings["batch"],
    )
    done = time.perf_counter()
    cluster = measured.cluster(1, world)
    work = Workload.of(
        flops,
        None,
        optimizer_s=measured.optimizer_s,
        sharded_tensor_s=measured.sharded_tensor_s,
        sharded_collective_s=measured.sharded_collective_s,
    )
    batch = settings["batch"]
    plans = {
        "none": TimedPlan("ddp", 1, batch),
        "ddp": TimedPlan("ddp", world, batch),
        "zero1": TimedPlan("zero1", world, batch),
        "fsdp": TimedPlan("fsdp", world, batch),
    }
    predicted = {
        way: step_cost(plan, work, cluster).step_s for way, plan in plans.items()
    }
    calibration = {
        "calibrate_s": done - tic,
        "alpha_ms": 1e3 * measured.intra.latency_s,
        "beta_mb_s": measured.intra.bytes_per_s / 1e6,
        "gather_share": measured.intra.gather_share,
        "scatter_share": measured.intra.scatter_share,
        "gflop_per_s": measured.flops_per_s / 1e9,
        "overhead_ms": 1e3 * measured.overhead_s,
        "optimizer_ms": 1e3 * measured.optimizer_s,
        "sharded_tensor_ms": 1e3 * measured.sharded_tensor_s,
        "sharded_collective_ms": 1e3 * measured.sharded_collective_s,
        "gflop_per_image": flops.per_image / 1e9,
    }
    return predicted, calibration


def _rank_main(rank: int, world: int, port: int, settings: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        arch, size = settings["arch"], settings["image_size"]
        model = build_model(arch, 10)
        tic = time.perf_counter()
        flops = count_flops(functools.partial(build_model, arch, 10), size)
        count_s = time.perf_counter() - tic
        trainers = _trainers(model, world)
        images = torch.randn(settings["batch"], 3, size, size)
        targets = torch.randint(0, 10, (settings["batch"],))
        rounds: list[tuple] = []
        for index in range(settings["warmup"] + settings["rounds"]):
            predicted, calibration = _predict(model, flops, settings, world)
            seconds = {}
            start = index % len(WAYS)  # each way first as often as the others
            for way in WAYS[start:] + WAYS[:start]:
                trained, optimizer = trainers[way]
                dist.barrier()
                tic = time.perf_counter()
                _step(trained, optimizer, images, targets)
                seconds[way] = time.perf_counter() - tic
            rounds.append((seconds, predicted, {**calibration, "count_s": count_s}))
        gathered: list = [None] * world
        dist.all_gather_object(gathered, rounds)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def measure_plan_timing(
    arch: str = "vit_tiny_patch4",
    image_size: int = 32,
    batch: int = 32,
    ranks: int = 2,
    rounds: int = 9,
    warmup: int = 2,
) -> dict:
    """Per way (none, ddp, zero1, fsdp): the measured median step (ms, the
    slowest rank's each round), the median predicted one, the one predicted
    at start-up (the first round's), and each over the step without sync
    (what the collectives add, apart from the compute's calibration); the
    first calibration (rank 0's figures, the count's and calibration's
    seconds) and the range of the achieved GFLOP/s the timed rounds'
    calibrations read; and the machine's load average at the end."""
    settings = {"arch": arch, "image_size": image_size, "batch": batch}
    settings.update(rounds=rounds, warmup=warmup)
    with tempfile.TemporaryDirectory(prefix="distribuuuu-plan-") as work:
        out = os.path.join(work, "timing.pt")
        mp.start_processes(
            _rank_main,
            args=(ranks, find_free_port(), settings, out),
            nprocs=ranks,
            start_method="spawn",
        )
        per_rank = torch.load(out, weights_only=True)
    timed = range(warmup, warmup + rounds)
    first = per_rank[0][0]  # the first round's calibration: as at start-up
    rows = {}
    for way in WAYS:
        slowest = [max(rank[r][0][way] for rank in per_rank) for r in timed]
        measured = 1e3 * statistics.median(slowest)
        predicted = 1e3 * statistics.median(per_rank[0][r][1][way] for r in timed)
        at_start = 1e3 * first[1][way]
        rows[way] = {
            "measured_ms": measured,
            "predicted_ms": predicted,
            "error": predicted / measured - 1,
            "start_up_ms": at_start,
            "start_up_error": at_start / measured - 1,
        }
    for row in rows.values():  # what the sync adds to a step without it
        row["measured_over_none"] = row["measured_ms"] / rows["none"]["measured_ms"]
        row["predicted_over_none"] = row["predicted_ms"] / rows["none"]["predicted_ms"]
    speeds = [per_rank[0][r][2]["gflop_per_s"] for r in timed]
    return {
        "ways": rows,
        "judged": judge(rows),
        "calibration": first[2],
        "gflop_per_s_range": (min(speeds), max(speeds)),
        "load": os.getloadavg(),
    }


def judge(rows: dict) -> dict:
    """The predictions as a ranking of the strategies (ddp, zero1, fsdp):
    each pair they set more than :data:`ORDER_MARGIN` apart, faster first,
    and whether the measurement orders it alike; the way the planner would
    choose (the fastest predicted, or within its window the simplest) and
    its measured step over the fastest measured."""
    ways = [way for way in SIMPLER_FIRST if way in rows]
    predicted = {way: rows[way]["predicted_ms"] for way in ways}
    measured = {way: rows[way]["measured_ms"] for way in ways}
    pairs = []
    for a, b in itertools.combinations(ways, 2):
        fast, slow = sorted((a, b), key=predicted.__getitem__)
        if predicted[slow] / predicted[fast] - 1 > ORDER_MARGIN:
            right = measured[fast] < measured[slow]
            pairs.append({"faster": fast, "slower": slow, "right": right})
    window = min(predicted.values()) * (1 + PREFERENCE_WINDOW)
    chosen = next(way for way in ways if predicted[way] <= window)
    best = min(ways, key=measured.__getitem__)
    over = measured[chosen] / measured[best] - 1
    return {"pairs": pairs, "chosen": chosen, "best": best, "chosen_over_best": over}


def format_plan_timing(result: dict) -> str:
    """The result of :func:`measure_plan_timing` as a table."""
    lines = [
        "way     measured ms  predicted ms  error   at start-up  error"
        "   / none: measured  predicted"
    ]
    for way, row in result["ways"].items():
        lines.append(
            f"{way:<7} {row['measured_ms']:>11.1f} {row['predicted_ms']:>13.1f} "
            f"{row['error']:>+6.1%} {row['start_up_ms']:>12.1f} "
            f"{row['start_up_error']:>+6.1%} {row['measured_over_none']:>17.3f} "
            f"{row['predicted_over_none']:>10.3f}"
        )
    judged = result["judged"]
    pairs = judged["pairs"]
    wrong = [f"{p['faster']} < {p['slower']}" for p in pairs if not p["right"]]
    lines.append(
        f"pairs predicted over {ORDER_MARGIN:.0%} apart: "
        f"{len(pairs) - len(wrong)} of {len(pairs)} measured in that order"
        + (f" (wrong: {', '.join(wrong)})" if wrong else "")
        + f"; chosen {judged['chosen']}, measured {judged['chosen_over_best']:+.1%} "
        f"over the fastest measured ({judged['best']}; at most "
        f"{CHOSEN_SLACK:.0%} asked)"
    )
    cal, (slow, fast) = result["calibration"], result["gflop_per_s_range"]
    lines.append(
        f"first calibration: alpha {cal['alpha_ms']:.2f} ms, "
        f"beta {cal['beta_mb_s']:.0f} MB/s, "
        f"{cal['gflop_per_s']:.1f} GFLOP/s + {cal['overhead_ms']:.1f} ms a pass, "
        f"optimizer {cal['optimizer_ms']:.1f} ms "
        f"+ {cal['sharded_tensor_ms']:.2f} ms a DTensor, "
        f"FSDP {cal['sharded_collective_ms']:.2f} ms a collective, "
        f"gathers at {cal['gather_share']:.2f} and reduce-scatters at "
        f"{cal['scatter_share']:.2f} of beta, "
        f"{cal['gflop_per_image']:.3f} GFLOP/image "
        f"(counted in {cal['count_s']:.2f} s, calibrated in {cal['calibrate_s']:.2f} s)"
    )
    lines.append(f"the timed rounds' calibrations read {slow:.1f}-{fast:.1f} GFLOP/s")
    if "load" in result:
        lines.append(f"load average at the end: {result['load'][0]:.1f}")
    return "\n".join(lines)
