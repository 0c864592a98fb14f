"""When other processes of the job fail: a collective that timed out or lost
its peers told in one line naming the ranks that did not answer, and the key
space that keeps a torchrun restart round from meeting the failed round's.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from distribuuuu.errors import PeerLostError

if TYPE_CHECKING:  # imported for the annotations only
    from distribuuuu.dist.group import LaunchInfo


# The group joined by setup_distributed: rank, world size, timeout and its
# store, kept beyond cleanup_distributed so that a failure can still be told.
_GROUP: dict[str, Any] = {}
# Words of gloo's and NCCL's errors when a peer does not answer in time, and
# when its connection is gone.
_TIMEOUT_WORDS = ("timed out", "timeout", "pair closure")
_LOST_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def remember_group(rank: int, world_size: int, timeout_s: float) -> None:
    """Keep what :func:`peer_failure` needs of the group just joined."""
    try:  # the c10d store the group was formed through (not a public name)
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # without it, only the names of ranks are lost
        store = None
    _GROUP.clear()
    _GROUP.update(rank=rank, world_size=world_size, timeout_s=timeout_s, store=store)


def forget_group() -> None:
    """No group joined (yet) by this run."""
    _GROUP.clear()


def peer_failure(error: BaseException) -> PeerLostError | None:
    """``error`` told in one line, when a collective timed out or lost a peer.

    For a gloo or NCCL error of a time-out or a closed connection in the group
    that :func:`setup_distributed` joined, the answer names DIST.INIT_TIMEOUT
    and the ranks that did not answer: every rank that meets such an error
    marks itself in the group's store, and waits a few seconds for the others
    to do the same; those that never do are stopped, dead or hung.  Any other
    error gives None.
    """
    text = str(error)
    lowered = text.lower()
    from_backend = isinstance(error, getattr(dist, "DistError", ())) or any(
        word in lowered for word in ("gloo", "nccl", "processgroup")
    )
    timed_out = any(word in lowered for word in _TIMEOUT_WORDS)
    lost = any(word in lowered for word in _LOST_WORDS)
    if not (_GROUP and isinstance(error, RuntimeError) and from_backend):
        return None
    if not (timed_out or lost):
        return None
    rank, world = _GROUP["rank"], _GROUP["world_size"]
    silent, why = _silent_ranks(_GROUP["store"], rank, world, _GROUP["timeout_s"])
    reason = backend_reason(text)
    if timed_out:
        what = (
            f"rank {rank}: a collective waited DIST.INIT_TIMEOUT="
            f"{_GROUP['timeout_s']:g}s for the other processes ({reason})"
        )
    else:
        what = f"rank {rank}: lost the connection to the other processes ({reason})"
    if why:
        who = f"{_name_ranks(silent)} did not answer or could not be asked ({why})"
    elif silent:
        who = f"{_name_ranks(silent)} did not answer (stopped, dead or hung)"
    else:
        who = "every other rank answered (they waited in different collectives?)"
    first = failed_peer()
    if first:
        who += f"; the first to fail: {first}"
    failure = PeerLostError(f"{what}; {who}")
    failure.__cause__ = error
    return failure


def backend_reason(text: str) -> str:
    """The first line of a backend's error without its ``[file.cc:NN]`` prefix."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return re.sub(r"^\[[^\]]*\]\s*", "", first)


def _name_ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _attempt_key(name: str) -> str:
    """A key of this attempt of the job: a restart (torchrun --max-restarts,
    Slurm requeue) may share the store with a failed attempt, whose keys must
    not count."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt += "." + os.environ.get("SLURM_RESTART_COUNT", "0")
    return f"distribuuuu/{name}/{attempt}/"


def announce_failure(message: str) -> None:
    """Tell the other ranks, through the group's store, that this rank fails
    with ``message`` (the first rank to fail is the one they name)."""
    store = _GROUP.get("store")
    if store is None:
        return
    key = _attempt_key("failure")
    try:
        if store.add(key + "count", 1) == 1:
            store.set(key + "message", message)
    except Exception:  # the store is gone: the peers learn it from the backend
        pass


def failed_peer() -> str | None:
    """The message of a rank that announced its failure, or None (also when
    the store cannot be asked)."""
    store = _GROUP.get("store")
    if store is None:
        return None
    key = _attempt_key("failure") + "message"
    try:
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:  # gone or stopped: the backend's error tells the rest
        pass
    return None


def _silent_ranks(
    store: Any, rank: int, world_size: int, timeout_s: float
) -> tuple[list[int], str]:
    """The ranks that did not mark themselves failed, and why they may be unknown.

    Marks ``rank`` in ``store``, then waits up to 5 s (less for a shorter
    timeout) for every other rank's mark.
    """
    others = [r for r in range(world_size) if r != rank]
    if store is None:
        return others, "no store to ask"
    key = _attempt_key("peer_failure")
    wait_s = min(5.0, max(1.0, timeout_s))
    try:
        # The store may live in a stopped process: never wait on it for long.
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        store.set(key + str(rank), "1")
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in others if not store.check([key + str(r)])]
            if not silent or time.monotonic() >= deadline:
                return silent, ""
            time.sleep(0.1)
    except Exception as error:  # the store is gone or stopped
        return others, f"the job's store did not answer: {type(error).__name__}"


def restart_round_store(
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
