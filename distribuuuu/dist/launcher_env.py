"""What the launchers put in the environment, read without importing torch.

Which rank a launcher gave this process (torchrun's ``RANK``, Open MPI's
``OMPI_COMM_WORLD_RANK``, Slurm's ``SLURM_PROCID``), for the checks made
before torch is loaded, and the place of a process that Open MPI's
``mpirun`` started.  :func:`distribuuuu.dist.group.detect_launch` reads the
whole launch; docs/launching.md has its table.
"""

from __future__ import annotations

from collections.abc import Mapping

from distribuuuu.errors import LaunchError

# The rank variables, in the order launch detection trusts them: a torchrun
# that mpirun or srun started sets RANK for its own workers, and mpirun inside
# a Slurm allocation leaves Slurm's variables (of its daemons) to its ranks.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")

# What Open MPI exports to every process mpirun starts, and which of it a
# launch needs; the local size defaults to the local rank + 1.
MPI_RANK, MPI_SIZE, MPI_LOCAL_RANK = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)
MPI_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
MPI_VARIABLES = (MPI_RANK, MPI_SIZE, MPI_LOCAL_RANK)

# How a user hands mpirun's ranks the rendezvous, for the errors below.
_MPI_EXAMPLE = (
    "export MASTER_ADDR=<rank 0's host> MASTER_PORT=<a free port> and pass both "
    "to every rank (mpirun -x MASTER_ADDR -x MASTER_PORT ...; on one node "
    "MASTER_ADDR=127.0.0.1); see docs/launching.md#open-mpi"
)


def launched_rank(env: Mapping[str, str]) -> str | None:
    """The rank a launcher gave this process, as written; None without one."""
    return next((env[name] for name in RANK_VARIABLES if name in env), None)


def started_by_mpirun(env: Mapping[str, str]) -> bool:
    """True for a process of Open MPI's mpirun (and not a torchrun it started)."""
    return "RANK" not in env and any(name in env for name in MPI_VARIABLES)


def mpi_place(env: Mapping[str, str]) -> tuple[int, int, int, int, str, int]:
    """Rank, world size, local rank, local world size, master address and port
    of a process that mpirun started; raise LaunchError naming what is missing.

    Open MPI exports no rendezvous address: the user sets MASTER_ADDR and
    MASTER_PORT (a job of one process needs neither).
    """
    missing = [name for name in MPI_VARIABLES if name not in env]
    if missing:
        present = ", ".join(name for name in MPI_VARIABLES if name in env)
        raise LaunchError(
            f"a partial Open MPI environment: {present} set but {missing[0]} "
            f"missing; start the processes with mpirun, or unset the "
            f"OMPI_COMM_WORLD_* variables to run one process"
        )
    rank, world, local_rank = (_number(env, name) for name in MPI_VARIABLES)
    local_world = local_rank + 1
    if MPI_LOCAL_SIZE in env:
        local_world = _number(env, MPI_LOCAL_SIZE)
    if world == 1:
        return rank, world, local_rank, local_world, "127.0.0.1", 0
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise LaunchError(
                f"mpirun started this process as rank {rank} of {world} but "
                f"{name} is not set: Open MPI exports no rendezvous address; "
                f"{_MPI_EXAMPLE}"
            )
    return rank, world, local_rank, local_world, env["MASTER_ADDR"], _port(env)


def _number(env: Mapping[str, str], name: str) -> int:
    if not env[name].isdigit():
        raise LaunchError(f"{name}={env[name]!r} is not a number")
    return int(env[name])


def _port(env: Mapping[str, str]) -> int:
    port = env["MASTER_PORT"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"MASTER_PORT={port!r} is not a TCP port (1-65535)")
    return int(port)
