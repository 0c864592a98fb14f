"""What agreeing on a stop request costs (for tools/benchmark.py): the time of
the check's collective (:func:`distribuuuu.distributed.all_reduce_max_int`)
between real gloo ranks on this machine, and so its cost per training step
with DIST.STOP_CHECK_STEPS."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distribuuuu.distributed import all_reduce_max_int
from distribuuuu.launch import find_free_port


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
        out = os.path.join(work, "seconds.pt")
        mp.start_processes(
            _rank_main,
            args=(ranks, find_free_port(), calls, repeats, out),
            nprocs=ranks,
            start_method="spawn",
        )
        seconds = torch.load(out, weights_only=True)
    return {
        "median": statistics.median(seconds),
        "min": min(seconds),
        "max": max(seconds),
        "runs": seconds,
        "ranks": ranks,
    }
