"""Launch detection, process-group set-up and helpers that work in one process.

Detection (first match wins; docs/launching.md):

* ``OMPI_COMM_WORLD_RANK`` (or ``_SIZE``, ``_LOCAL_RANK``) set and no ``RANK``:
  a process of Open MPI's ``mpirun``; rank, world size and local rank come from
  those three, which must all be there, and the master from ``MASTER_ADDR`` and
  ``MASTER_PORT``, which the user sets (Open MPI exports none).  It comes before
  Slurm: the ranks of an mpirun inside a Slurm allocation carry the Slurm
  variables of mpirun's daemons (or of the batch script), not their own.
* ``SLURM_PROCID`` set and no ``RANK``: a Slurm task started by ``srun``; rank,
  world size and local rank come from ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``; the master is the first host of ``SLURM_NODELIST``.  The
  batch script of a job of several tasks has the same variables but no step id
  (or the batch step's): a process started there without srun is refused, since
  the other tasks it would wait for never come.
* ``RANK`` and ``WORLD_SIZE`` set: torchrun, ``torch.distributed.launch`` or our
  own spawn; a Slurm step that runs torchrun inside lands here too.
* nothing: one process, no process group.

Every helper below works unchanged without a process group.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from distribuuuu.dist.collectives import (
    GLOO_INTERFACE_ADVICE,
    all_gather_object,
    all_reduce_max_int,
    all_reduce_max_int_with_rows,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast_bytes,
    broadcast_object,
    control_group,
    forget_control_group,
    gather_object_on_main,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
    join_control_group,
)
from distribuuuu.dist.launcher_env import mpi_place, started_by_mpirun
from distribuuuu.dist.peers import (
    forget_group,
    remember_group,
    restart_round_store,
)
from distribuuuu.dist.slurm import expand_hostlist
from distribuuuu.errors import DistributedSetupError, LaunchError

logger = logging.getLogger(__name__)

# Slurm jobs without MASTER_PORT get 20000 + (job id mod this) as the port, so
# that two jobs sharing a node do not collide.
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000


# Slurm's step ids of a job's batch script and of its "extern" step (processes
# that enter the job by ssh), as numbers and as Slurm prints them: no srun there.
_NOT_SRUN_STEPS = {"4294967294", "batch", "4294967295", "extern"}


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as detected from the environment."""

    launcher: str  # "mpi", "slurm", "torchrun", "deepspeed" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    # GPUs Slurm gave this node (SLURM_GPUS_ON_NODE); None where unknown.
    node_gpus: int | None = None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if started_by_mpirun(env):
        return LaunchInfo("mpi", *mpi_place(env))
    if "SLURM_PROCID" in env and "RANK" not in env:
        world = int(env.get("SLURM_NTASKS", "1"))
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        batch_script = step is None or step in _NOT_SRUN_STEPS
        if world > 1 and batch_script and env["SLURM_PROCID"] == "0":
            raise LaunchError(
                f"this process has the Slurm environment of task "
                f"{env['SLURM_PROCID']} of {world} (SLURM_NTASKS={world}) but was "
                f"not started by srun (it runs in the job's batch script, where "
                f"no other task will ever join it): start the tasks with srun, as "
                f"`srun python tools/train_net.py ...` (tools/slurm_train.sh does), "
                f"or submit the job with one task (sbatch -n 1)"
            )
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"])
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        port = _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get(
            "SLURM_TASKS_PER_NODE", "1"
        )
        node = int(env.get("SLURM_NODEID", "0"))
        return LaunchInfo(
            launcher="slurm",
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=tasks_on_node(tasks_per_node, node),
            master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=int(env.get("MASTER_PORT", port)),
            node_gpus=_count(env.get("SLURM_GPUS_ON_NODE", "")),
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        # torchrun and --num-procs set LOCAL_WORLD_SIZE; the deepspeed launcher
        # sets LOCAL_SIZE (and CROSS_RANK, the node's index) instead; a launcher
        # that sets only RANK and WORLD_SIZE (one process per node or container)
        # runs at least LOCAL_RANK + 1 processes here.
        deepspeed = "LOCAL_WORLD_SIZE" not in env and "CROSS_RANK" in env
        local_world = env.get("LOCAL_WORLD_SIZE", local_rank + 1)
        if deepspeed:
            local_world = env.get("LOCAL_SIZE", local_world)
        return LaunchInfo(
            launcher="deepspeed" if deepspeed else "torchrun",
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=local_rank,
            local_world_size=int(local_world),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    return LaunchInfo("none", 0, 1, 0, 1, "127.0.0.1", 0)


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks of node ``node`` (SLURM_NODEID) in Slurm's ``SLURM_TASKS_PER_NODE``.

    The value lists the nodes' counts in order, repeated runs folded as in
    ``2(x3),1``: nodes 0-2 run two tasks, node 3 one.
    """
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"bad task count {part!r} in {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[min(node, len(counts) - 1)]


def gpu_index(
    local_rank: int, local_world_size: int, visible: int, node_gpus: int | None = None
) -> int:
    """The CUDA device index of a process, given the GPUs it can see.

    One visible GPU is the process's own (a scheduler that binds one GPU to
    each task, as ``srun --gpus-per-task=1`` does, hides the others): index 0.
    Fewer than the node's ``node_gpus`` (Slurm binds a set of GPUs to each
    task: ``--gpus-per-task=2``, ``--gpu-bind=closest``): GPU ``local_rank``
    modulo the set.  Otherwise every process sees all of them: process
    ``local_rank`` takes GPU ``local_rank``, and there must be one for each
    process of the node: two processes on one GPU make NCCL abort
    ("Duplicate GPU detected"), so that launch raises LaunchError.
    """
    if visible == 1:
        return 0
    if node_gpus is not None and visible < node_gpus:
        return local_rank % visible
    if local_world_size > visible or local_rank >= visible:
        raise LaunchError(
            f"{max(local_world_size, local_rank + 1)} processes on this node "
            f"(this one has local rank {local_rank}) but {visible} GPUs are "
            f"visible to each: every process needs a GPU of its own; start at "
            f"most {visible} processes per node (torchrun --nproc-per-node "
            f"{visible}, --num-procs {visible}, srun --ntasks-per-node {visible}), "
            "give each task its own GPU (srun --gpus-per-task=1), or set DEVICE cpu"
        )
    return local_rank


def select_device(
    preference: str,
    local_rank: int,
    local_world_size: int = 1,
    node_gpus: int | None = None,
) -> torch.device:
    """The one device of this process: its GPU (see :func:`gpu_index`) or ``cpu``."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("DEVICE cuda was asked for, but CUDA is not available")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    index = gpu_index(local_rank, local_world_size, visible, node_gpus)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def backend_for(requested: str, device_type: str, cpu_collectives: bool) -> str:
    """The process-group backend string for DIST.BACKEND ``requested``.

    "" picks nccl on CUDA and gloo on CPU.  NCCL reduces CUDA tensors only:
    when the run also reduces tensors in host memory on CUDA
    (``cpu_collectives``: FSDP with CPU offload, whose gradient-norm clipping
    all-reduces the offloaded gradients), the group gets gloo for those, as
    ``cuda:nccl,cpu:gloo`` (pytorch/pytorch#148532; torchtune does the same).
    """
    backend = requested or ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and cpu_collectives:
        return "cuda:nccl,cpu:gloo"
    return backend


def cpu_threads(affinity: int, local_world_size: int, env: Mapping[str, str]) -> int:
    """Torch threads for one process: its share of the CPUs it may run on.

    Under torchrun or mpirun (or spawn, or plain python) the processes of a
    node share one CPU affinity, which is divided between them.  A Slurm task started by
    srun owns its CPUs already: ``SLURM_CPUS_PER_TASK`` of them (else its
    share of ``SLURM_CPUS_ON_NODE``), and its affinity, when Slurm binds tasks,
    is already that share and is not divided again.

    Args:
        affinity: number of CPUs this process may run on (``sched_getaffinity``).
        local_world_size: processes of the job on this node.
        env: the environment (``SLURM_*``, ``RANK``, ``OMPI_COMM_WORLD_*``).
    """
    local = max(1, local_world_size)
    srun_task = "SLURM_PROCID" in env and "RANK" not in env
    if not srun_task or started_by_mpirun(env):
        return max(1, affinity // local)
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    on_node = env.get("SLURM_CPUS_ON_NODE", "")
    if per_task.isdigit():
        share = int(per_task)
    elif on_node.isdigit():
        share = int(on_node) // local
    else:
        share = affinity // local
    return max(1, min(affinity, share))


def setup_distributed(
    backend: str = "",
    device_preference: str = "auto",
    timeout_s: float = 600,
    cpu_collectives: bool = False,
) -> tuple[LaunchInfo, torch.device]:
    """Detect the launch, pick the device and join the process group if any.

    Args:
        backend: "nccl", "gloo", or "" for nccl on CUDA and gloo on CPU.
        device_preference: "auto", "cpu" or "cuda".
        timeout_s: seconds to wait for peers at start-up and in collectives.
        cpu_collectives: the run reduces tensors in host memory on CUDA too
            (see :func:`backend_for`).
    """
    info = detect_launch()
    forget_group()  # no group joined (yet) by this run
    device = select_device(
        device_preference, info.local_rank, info.local_world_size, info.node_gpus
    )
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between the processes of this node instead of every
        # process starting one thread per core.
        affinity = len(os.sched_getaffinity(0))
        torch.set_num_threads(cpu_threads(affinity, info.local_world_size, os.environ))
    if info.world_size > 1 and not dist.is_initialized():
        os.environ["MASTER_ADDR"] = info.master_addr
        os.environ["MASTER_PORT"] = str(info.master_port)
        backend = backend_for(backend, device.type, cpu_collectives)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = restart_round_store(info, timeout)
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
            nodes = info.local_world_size < info.world_size
            advice = f"; {GLOO_INTERFACE_ADVICE}" * ("gloo" in backend and nodes)
            raise DistributedSetupError(
                f"rank {info.rank} of {info.world_size} could not join the process "
                f"group at {info.master_addr}:{info.master_port} ({backend}, "
                f"{info.launcher}) within DIST.INIT_TIMEOUT={timeout_s:g}s: "
                f"{type(error).__name__}: {reason}{advice}"
            ) from error
        remember_group(info.rank, info.world_size, timeout_s)
        try:
            join_control_group(info.rank, timeout_s)
        except DistributedSetupError:
            dist.destroy_process_group()  # run_context's cleanup has not begun
            raise
    return info, device


def cleanup_distributed() -> None:
    """Leave the process group (a no-op without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_control_group()


def release_groups() -> None:
    """Let the process groups of a finished run be destroyed now, while Python
    still runs their threads' last clean-up (after :func:`cleanup_distributed`,
    once the run's objects are unreachable).

    ``destroy_process_group`` forgets the groups, but objects may still hold
    them: an FSDP model until the garbage collector frees it, and the device
    meshes that DTensor's caches keep (their ``_pg_registry``, torch 2.14).
    A gloo group alive at interpreter exit can have a worker thread release
    the Python tensor of its last collective while the interpreter is torn
    down, which aborts the finished process ("terminate called without an
    active exception"; pytorch/pytorch#179291 describes it).
    """
    gc.collect()  # the model, in reference cycles through its hooks
    for obj in gc.get_objects():
        # By type(), not isinstance(): that would read ``__class__`` of every
        # object, and torch's deprecated reduce_op warns when asked.
        if DeviceMesh in type(obj).__mro__:
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


__all__ = [
    "LaunchInfo",
    "all_gather_object",
    "all_reduce_max_int",
    "all_reduce_max_int_with_rows",
    "all_reduce_mean",
    "all_reduce_sum",
    "backend_for",
    "barrier",
    "broadcast_bytes",
    "broadcast_object",
    "cleanup_distributed",
    "control_group",
    "cpu_threads",
    "detect_launch",
    "gather_object_on_main",
    "get_rank",
    "get_world_size",
    "gpu_index",
    "is_distributed",
    "is_main_process",
    "release_groups",
    "select_device",
    "setup_distributed",
    "tasks_on_node",
]
