"""Collectives that work unchanged in one process, and the gloo group of the
run's host-side checks (the control group).

Every function is a no-op, or returns its input, without a process group of
more than one process.  :mod:`distribuuuu.dist.group` joins the groups and
re-exports these names, so callers use them as ``du.barrier()`` and so on.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from distribuuuu.dist.peers import backend_reason
from distribuuuu.errors import DistributedSetupError

# Where gloo fails to connect nodes, the usual cause and cure.
GLOO_INTERFACE_ADVICE = (
    "gloo connects through the network interface of this node's host name, "
    "which must reach the other nodes (not resolve to 127.0.x.x): name the "
    "interface with GLOO_SOCKET_IFNAME (e.g. GLOO_SOCKET_IFNAME=eth0, as "
    "NCCL_SOCKET_IFNAME does for NCCL)"
)


def is_distributed() -> bool:
    """True inside a process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the job (1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_main_process() -> bool:
    """True on rank 0, the process that logs and writes shared files."""
    return get_rank() == 0


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every process (a no-op in one process); ``group``: another
    group of every process than the default one."""
    if is_distributed():
        dist.barrier(group=group)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all processes in place and return it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over all processes in place and return it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def all_reduce_max_int(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest ``value`` over all processes (through a CPU group, so that
    a GPU run does not wait on its CUDA stream for it): the control group, or
    ``group``, a gloo group of every process."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group or _CONTROL)
    return int(tensor.item())


def all_reduce_max_int_with_rows(
    value: int, row: Sequence[float]
) -> tuple[int, list[list[float]]]:
    """The largest ``value`` over all processes and every process's ``row``
    (numbers >= 0, as many on every rank) in rank order: one all-reduce, as
    :func:`all_reduce_max_int`'s, of a tensor where each rank fills its row."""
    rank, world, width = get_rank(), get_world_size(), len(row)
    tensor = torch.zeros(1 + world * width, dtype=torch.float64)
    tensor[0], start = value, 1 + rank * width
    tensor[start : start + width] = torch.tensor(row, dtype=torch.float64)
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_CONTROL)
    values = tensor.tolist()
    rows = [values[1 + r * width : 1 + (r + 1) * width] for r in range(world)]
    return int(values[0]), rows


# The gloo group of the host-side checks when the default group cannot reduce
# CPU tensors (NCCL); None when it can, or without a process group.
_CONTROL: dist.ProcessGroup | None = None


def join_control_group(rank: int, timeout_s: float) -> None:
    """Form the gloo group of the host-side checks (stop requests, the save
    barrier, finite checks) now, with every rank, if the default group has
    no CPU backend; raise DistributedSetupError if it cannot form in time.

    Formed at start-up rather than at the first check, so that a node whose
    gloo cannot reach the others fails here, in one clear line, instead of
    hanging in the middle of the first epoch.
    """
    global _CONTROL
    _CONTROL = None
    if "cpu:" in dist.get_backend_config():
        return  # the default group reduces CPU tensors itself
    try:
        # Every rank is a member: never new_group's NON_GROUP_MEMBER.
        _CONTROL = cast(
            dist.ProcessGroup,
            dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            ),
        )
    except (RuntimeError, ValueError) as error:
        raise DistributedSetupError(
            f"rank {rank}: the gloo group of the run's host-side checks could not "
            f"form within DIST.INIT_TIMEOUT={timeout_s:g}s "
            f"({backend_reason(str(error))}); {GLOO_INTERFACE_ADVICE}"
        ) from error


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather one picklable object from every process, in rank order (over
    ``group``, a group of every process, when given)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object_on_main(obj: Any) -> list[Any] | None:
    """Gather one picklable object from every process on rank 0, in rank
    order; None on the other ranks.  It travels through host memory (over
    the gloo group of the host-side checks where the default group is NCCL),
    so a large object, a model's weights, never passes through a GPU."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=_CONTROL)
    return out


def broadcast_object(
    obj: Any, src: int = 0, group: dist.ProcessGroup | None = None
) -> Any:
    """Return rank ``src``'s ``obj`` on every process (over ``group``, a group
    of every process, when given)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank ``src``'s ``data`` (None on the other ranks) on every process, as
    raw bytes (nothing pickled) through host memory: over the gloo group of
    the host-side checks where the default group is NCCL."""
    if not is_distributed():
        return data or b""
    sending = get_rank() == src
    if sending and data is None:
        raise ValueError(f"rank {src} broadcasts, but has no bytes")
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src, group=_CONTROL)
    count = int(size.item())
    if count == 0:
        return b""
    if data is not None and sending:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buffer = torch.empty(count, dtype=torch.uint8)
    dist.broadcast(buffer, src, group=_CONTROL)
    return buffer.numpy().tobytes() if not sending else bytes(data or b"")


def forget_control_group() -> None:
    """Drop the control group (its process group is being destroyed)."""
    global _CONTROL
    _CONTROL = None


def control_group() -> dist.ProcessGroup | None:
    """The gloo group of the host-side checks; None where the default group
    reduces CPU tensors itself, or without a process group."""
    return _CONTROL
