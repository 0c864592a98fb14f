"""Run a function on N real gloo ranks in spawned processes (for tests)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port


def _entry(rank: int, world: int, port: int, fn, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_ranks(world: int, fn, args: tuple, out_dir: str) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; their results in order."""
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(
        _entry,
        args=(world, free_port(), fn, args, str(out_dir)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return [
        torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
        for r in range(world)
    ]
