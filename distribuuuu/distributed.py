"""Launch detection, process-group set-up and helpers that work in one process.

Detection (first match wins), as in ARCHITECTURE.md:

* ``SLURM_PROCID`` set and no ``RANK``: a Slurm task started by ``srun``; rank,
  world size and local rank come from ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``; the master is the first host of ``SLURM_NODELIST``.
* ``RANK`` and ``WORLD_SIZE`` set: torchrun, ``torch.distributed.launch`` or our
  own spawn; a Slurm step that runs torchrun inside lands here too.
* nothing: one process, no process group.

Every helper below works unchanged without a process group.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Slurm jobs without MASTER_PORT get 20000 + (job id mod this) as the port, so
# that two jobs sharing a node do not collide.
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000


class DistributedSetupError(RuntimeError):
    """The process group could not be formed (peers missing, port taken, ...)."""


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as detected from the environment."""

    launcher: str  # "slurm", "torchrun" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``node[01-03,07],gpu-[1-2]-ib``.

    Follows Slurm's grammar: comma-separated host expressions, each with any
    number of bracket groups of comma-separated numbers and ``lo-hi`` ranges;
    the zero padding of ``lo`` is kept.
    """
    hosts: list[str] = []
    for expr in _split_top_level(hostlist):
        hosts += _expand_expr(expr)
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def _expand_expr(expr: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", expr)
    if match is None:
        return [expr]
    head, tail = expr[: match.start()], expr[match.end() :]
    out = []
    for item in match.group(1).split(","):
        bounds = item.strip().split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            numbers = [bounds[0]]
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
            width = len(bounds[0])
            lo, hi = int(bounds[0]), int(bounds[1])
            if hi < lo:
                raise ValueError(f"descending range {item!r} in hostlist {expr!r}")
            numbers = [str(n).zfill(width) for n in range(lo, hi + 1)]
        else:
            raise ValueError(f"bad range {item!r} in hostlist {expr!r}")
        for number in numbers:
            out += _expand_expr(head + number + tail)
    return out


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if "SLURM_PROCID" in env and "RANK" not in env:
        world = int(env.get("SLURM_NTASKS", "1"))
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"])
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        port = _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get(
            "SLURM_TASKS_PER_NODE", "1"
        )
        return LaunchInfo(
            launcher="slurm",
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=int(re.match(r"\d+", tasks_per_node).group()),
            master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=int(env.get("MASTER_PORT", port)),
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return LaunchInfo(
            launcher="torchrun",
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    return LaunchInfo("none", 0, 1, 0, 1, "127.0.0.1", 0)


def select_device(preference: str, local_rank: int) -> torch.device:
    """The one device of this process: ``cuda:LOCAL_RANK`` or ``cpu``."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("DEVICE cuda was asked for, but CUDA is not available")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def setup_distributed(
    backend: str = "", device_preference: str = "auto", timeout_s: float = 600
) -> tuple[LaunchInfo, torch.device]:
    """Detect the launch, pick the device and join the process group if any.

    Args:
        backend: "nccl", "gloo", or "" for nccl on CUDA and gloo on CPU.
        device_preference: "auto", "cpu" or "cuda".
        timeout_s: seconds to wait for peers at start-up and in collectives.
    """
    info = detect_launch()
    device = select_device(device_preference, info.local_rank)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between the processes of this node instead of every
        # process starting one thread per core.
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // max(1, info.local_world_size)))
    if info.world_size > 1 and not dist.is_initialized():
        os.environ["MASTER_ADDR"] = info.master_addr
        os.environ["MASTER_PORT"] = str(info.master_port)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = _restart_round_store(info, timeout)
            dist.init_process_group(
                backend=backend,
                init_method=None if store else "env://",
                store=store,
                rank=info.rank,
                world_size=info.world_size,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        except (RuntimeError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise DistributedSetupError(
                f"rank {info.rank} of {info.world_size} could not join the process "
                f"group at {info.master_addr}:{info.master_port} ({backend}, "
                f"{info.launcher}) within DIST.INIT_TIMEOUT={timeout_s:g}s: "
                f"{type(error).__name__}: {reason}"
            ) from error
    return info, device


def _restart_round_store(
    info: LaunchInfo, timeout: datetime.timedelta
) -> dist.Store | None:
    """torchrun's store, with a key space of this restart round; None elsewhere.

    torchrun keeps one store (its agent's) for every round of ``--max-restarts``,
    so the keys the failed round wrote (gloo's addresses, the start-up barrier)
    are still there: restarted workers read them and try to connect to dead
    peers (pytorch/pytorch#135712).  A prefix per TORCHELASTIC_RESTART_COUNT
    keeps the rounds apart.  That count is kept by each node's agent, and
    agents whose own workers did not fail do not count, so the prefix is used
    on one node only.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if info.local_world_size != info.world_size:
        return None
    store = dist.TCPStore(
        info.master_addr,
        info.master_port,
        info.world_size,
        is_master=False,
        timeout=timeout,
    )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distribuuuu/restart_{restart}/", store)


def cleanup_distributed() -> None:
    """Leave the process group (a no-op without one)."""
    global _CONTROL_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL_GROUP = None


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


def barrier() -> None:
    """Wait for every process (a no-op in one process)."""
    if is_distributed():
        dist.barrier()


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


def all_reduce_max_int(value: int) -> int:
    """The largest ``value`` over all processes (through a CPU group, so that
    a GPU run does not wait on its CUDA stream for it)."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group())
    return int(tensor.item())


_CONTROL_GROUP = None


def _control_group():
    global _CONTROL_GROUP
    if dist.get_backend() == "gloo":
        return None  # the default group already runs on the CPU
    if _CONTROL_GROUP is None:  # created on first use, by every rank together
        _CONTROL_GROUP = dist.new_group(backend="gloo")
    return _CONTROL_GROUP


def requeue_slurm_job() -> bool:
    """Ask Slurm to requeue this job (``scontrol requeue $SLURM_JOB_ID``)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        logger.warning("DIST.REQUEUE True, but this is not a Slurm job")
        return False
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("could not requeue Slurm job %s: %s", job_id, error)
        return False
    if result.returncode != 0:
        logger.warning("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
    return result.returncode == 0


def all_gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from every process, in rank order."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every process."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
