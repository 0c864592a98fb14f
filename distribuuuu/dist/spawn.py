"""``--num-procs N``: start N local processes without a launcher.

The parent picks a free port, then starts N workers with
``torch.multiprocessing`` (spawn).  Each worker gets the environment torchrun
would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so the rest of the program cannot tell the difference.  When a
worker fails, the others are terminated and the failure is raised here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_as_rank(
    local_rank: int, num_procs: int, port: int, func: Callable, args: tuple
) -> None:
    """``func(*args)`` as rank ``local_rank`` of ``num_procs`` local processes,
    with the environment torchrun would give it (no process group yet)."""
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(num_procs),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(num_procs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    func(*args)


def spawn(num_procs: int, func: Callable[..., Any], args: tuple = ()) -> None:
    """Run ``func(*args)`` in ``num_procs`` new processes and wait for all.

    Raises ``torch.multiprocessing.ProcessRaisedException`` or
    ``ProcessExitedException`` when a worker fails; the other workers are
    terminated before it returns.
    """
    port = find_free_port()
    mp.start_processes(
        run_as_rank,
        args=(num_procs, port, func, args),
        nprocs=num_procs,
        join=True,
        start_method="spawn",
    )
