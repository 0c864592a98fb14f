"""Several nodes on one machine, for the multi-node tests and
tools/benchmark.py: :func:`namespaced_nodes` runs ``tools/netsim.sh`` (one
network namespace per node on a bridge, each link shaped with ``tc tbf``)
and always removes what it made: when the body ends or raises, at
interpreter exit, and before SIGTERM or SIGHUP end the process; a set left
by a process killed outright (SIGKILL) is removed by the next set made."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

# The script, in a checkout (tools/ beside the package).
SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "netsim.sh"
# Prefix of the sets made here: "d<pid>-<k>", which names the process that
# made them (tools/netsim.sh allows 11 characters).
_OUR_NAMESPACE = re.compile(r"^d(\d+)-(\d{1,2})n\d+$")
_COUNTER = itertools.count()
# The sets this process holds (their prefixes, oldest first).
_LIVE: list[str] = []
# Signals that end a process without unwinding: while a set is held, their
# default action waits until every set is removed.
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# What signal.signal returns: a handler, SIG_DFL/SIG_IGN, or None.
Handler = Callable[[int, FrameType | None], Any] | int | None


@dataclass(frozen=True)
class Node:
    """One namespaced node: its namespace, its address on the nodes' subnet,
    its interface (for ``GLOO_SOCKET_IFNAME``) and the host end of its link."""

    namespace: str
    address: str
    interface: str
    host_link: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node under its host name (the namespace's
        name), as ``tools/netsim.sh run`` runs it."""
        rename = 'hostname "$0" && exec "$@"'
        inside = ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--"]
        return [*inside, "sh", "-c", rename, self.namespace, *argv]


def _script(command: list[str], prefix: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NETSIM_PREFIX": prefix}
    return subprocess.run(
        [str(SCRIPT), *command], env=env, capture_output=True, text=True, check=False
    )


def _reason(result: subprocess.CompletedProcess) -> str:
    """The last line the script wrote on stderr, without its tag."""
    lines = result.stderr.strip().splitlines() or [f"exit {result.returncode}"]
    return lines[-1].split("ERROR: ", 1)[-1]


def why_unavailable() -> str:
    """Why this machine cannot make namespaced nodes ("" when it can): not
    root, no ``ip``/``tc``, or a kernel without namespaces, bridges, veth
    pairs or tbf (``tools/netsim.sh check``)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    if not SCRIPT.is_file():
        return f"no {SCRIPT} (namespaced nodes need a checkout)"
    result = _script(["check"], f"d{os.getpid()}")
    return "" if result.returncode == 0 else _reason(result)


def remove_nodes(prefix: str) -> None:
    """Remove the set ``prefix`` (its namespaces, links and bridge, ending
    what still runs in its nodes); nothing when there is none."""
    result = _script(["down"], prefix)
    if result.returncode != 0:
        raise RuntimeError(f"tools/netsim.sh down ({prefix}): {_reason(result)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_nodes() -> list[str]:
    """Remove the sets made here by processes that are gone (killed before
    they could remove them); their prefixes."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    stale = set()
    for line in listed.splitlines():
        match = _OUR_NAMESPACE.match(line.split()[0]) if line.strip() else None
        if match and not _pid_alive(int(match.group(1))):
            stale.add(f"d{match.group(1)}-{match.group(2)}")
    for prefix in sorted(stale):
        remove_nodes(prefix)
    return sorted(stale)


def _remove_live_nodes() -> None:
    """Remove every set this process still holds (at exit)."""
    while _LIVE:
        remove_nodes(_LIVE[-1])
        _LIVE.pop()


def _remove_live_nodes_then_die(signum: int, frame: FrameType | None) -> None:
    """Remove every set this process holds, then end as the signal would have."""
    for prefix in reversed(_LIVE):
        with contextlib.suppress(RuntimeError, OSError):
            remove_nodes(prefix)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _catch_teardown_signals() -> dict[signal.Signals, Handler]:
    """Remove the sets first on SIGTERM and SIGHUP where they would end the
    process outright (their default, in the main thread); the handlers
    replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    replaced: dict[signal.Signals, Handler] = {}
    for signum in _TEARDOWN_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_DFL:
            replaced[signum] = signal.signal(signum, _remove_live_nodes_then_die)
    return replaced


def _make_nodes(n: int, rate_mbit: int, prefix: str) -> list[Node]:
    result = _script(["up", str(n), str(rate_mbit)], prefix)
    if result.returncode != 0:
        raise RuntimeError(f"tools/netsim.sh up {n} {rate_mbit}: {_reason(result)}")
    nodes = []
    for index, line in enumerate(result.stdout.splitlines()):
        namespace, address, interface = line.split()
        nodes.append(Node(namespace, address, interface, f"{prefix}h{index}"))
    return nodes


@contextlib.contextmanager
def namespaced_nodes(n: int, rate_mbit: int) -> Iterator[list[Node]]:
    """``n`` nodes on one bridge, each link shaped to ``rate_mbit`` Mbit/s in
    both directions (0: unshaped); removed at the end, whatever happens.

    Needs root (see :func:`why_unavailable`). Run a command in node ``i``
    with ``nodes[i].command(argv)``; the nodes reach each other at their
    ``address`` through their ``interface``.
    """
    remove_stale_nodes()
    prefix = f"d{os.getpid()}-{next(_COUNTER) % 100}"
    replaced = _catch_teardown_signals()
    _LIVE.append(prefix)
    try:
        yield _make_nodes(n, rate_mbit, prefix)
    finally:
        try:
            remove_nodes(prefix)
            # Only once removed: else the interpreter's exit tries again.
            _LIVE.remove(prefix)
        finally:
            for signum, handler in replaced.items():
                signal.signal(signum, handler)


atexit.register(_remove_live_nodes)
