"""What a run costs beyond its training steps, for tools/benchmark.py: its
start-up beyond importing torch and torchvision, and the stop check (the
ranks' agreement on a stop request, :func:`distribuuuu.dist.group.all_reduce_max_int`,
between real gloo ranks on this machine) per check and per training step
with DIST.STOP_CHECK_STEPS."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distribuuuu.dist.group import all_reduce_max_int
from distribuuuu.dist.spawn import find_free_port


def _rank_main(rank: int, world: int, port: int, calls: int, repeats: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for _ in range(10):  # connections warm
            all_reduce_max_int(0)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            tic = time.perf_counter()
            for _ in range(calls):
                all_reduce_max_int(0)
            seconds.append((time.perf_counter() - tic) / calls)
        if rank == 0:
            torch.save(seconds, out)
    finally:
        dist.destroy_process_group()


def measure_stop_check(ranks: int = 2, calls: int = 200, repeats: int = 5) -> dict:
    """Seconds of one stop check between ``ranks`` local gloo processes: the
    median, slowest and fastest of ``repeats`` means over ``calls`` checks."""
    with tempfile.TemporaryDirectory(prefix="distribuuuu-stop-") as work:
        seconds = on_local_ranks(_rank_main, ranks, (calls, repeats), work)
    return {**summarize(seconds), "ranks": ranks}


def on_local_ranks(main, ranks: int, args: tuple, work: str):
    """Run ``main(rank, ranks, port, *args, out)`` in ``ranks`` new local
    processes; return what rank 0 saved to ``out`` (a file in ``work``)."""
    out = os.path.join(work, "result.pt")
    mp.start_processes(
        main,
        args=(ranks, find_free_port(), *args, out),
        nprocs=ranks,
        start_method="spawn",
    )
    return torch.load(out, weights_only=True)


def summarize(values: list[float]) -> dict:
    """Median, slowest and fastest of repeated measurements, and all of them."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def measure_startup(runs: dict[str, list[str]], env: dict, repeats: int) -> dict:
    """Seconds of each command of ``runs`` (``--dry-run``s), launch to exit,
    beside those of importing torch and torchvision alone (which goes first
    rotates with each repeat), and per command the per-repeat difference:
    what the run itself adds.  The first command's figures are also the
    result's own ``seconds`` and ``beyond_imports``."""
    commands = {**runs, "imports": [sys.executable, "-c", "import torch, torchvision"]}
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            tic = time.perf_counter()
            subprocess.run(
                commands[name], check=True, capture_output=True, timeout=600, env=env
            )
            seconds[name].append(time.perf_counter() - tic)
    measured = {}
    for name in runs:
        beyond = [a - b for a, b in zip(seconds[name], seconds["imports"])]
        measured[name] = {
            "seconds": summarize(seconds[name]),
            "beyond_imports": summarize(beyond),
        }
    first = measured[names[0]]
    return {**first, "imports": summarize(seconds["imports"]), "runs": measured}


def stop_check_cost(every: int, step_s: float | None, short: bool, repeats: int):
    """One stop check between 2 gloo ranks, per check and per training step
    (one check every ``every`` steps), and as a share of a ``step_s`` step."""
    check = measure_stop_check(calls=20 if short else 200, repeats=repeats)
    result = {"check_s": check, "every": every, "per_step_s": check["median"] / every}
    if step_s:
        result.update(step_s=step_s, share=result["per_step_s"] / step_s)
    return result


def format_stop_check(stop: dict) -> str:
    """The stop check's row of the benchmark table."""
    check = stop["check_s"]
    text = (
        f"{'stop check':<18} {'us':<6} check {1e6 * check['median']:.1f} "
        f"({1e6 * check['min']:.1f}-{1e6 * check['max']:.1f})  every "
        f"{stop['every']} steps: {1e6 * stop['per_step_s']:.1f} us/step"
    )
    if "share" in stop:
        text += f" = {100 * stop['share']:.3f}% of a {1e3 * stop['step_s']:.0f} ms step"
    return text
