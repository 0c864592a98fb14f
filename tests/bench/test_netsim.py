"""Namespaced nodes (distribuuuu.bench.netsim over tools/netsim.sh): they
reach each other over links shaped as asked, and nothing of them is left
after the block: not when it ends, raises, is stopped by SIGTERM, or when
the process that made them is killed outright (the next set removes them)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import REPO, kill_session, start

from distribuuuu.bench.netsim import namespaced_nodes, remove_nodes

# A process that makes two nodes, prints their namespaces and waits.
HOLDER = (
    "import time\n"
    "from distribuuuu.bench.netsim import namespaced_nodes\n"
    "with namespaced_nodes(2, 0) as nodes:\n"
    "    print(' '.join(node.namespace for node in nodes), flush=True)\n"
    "    time.sleep(120)\n"
)
# Node 0 answers the first connection with the bytes it received.
ECHO = (
    "import socket, sys\n"
    "server = socket.create_server((sys.argv[1], 5000))\n"
    "print('listening', flush=True)\n"
    "peer, _ = server.accept()\n"
    "peer.sendall(peer.recv(64))\n"
)
SEND = (
    "import socket, sys\n"
    "with socket.create_connection((sys.argv[1], 5000), timeout=10) as s:\n"
    "    s.sendall(b'across the bridge')\n"
    "    print(s.recv(64).decode())\n"
)


def _prefix(namespace: str) -> str:
    return re.sub(r"n\d+$", "", namespace)


def _leftovers(prefix: str) -> list[str]:
    """The namespaces and links of the set ``prefix`` that exist."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    names += [line.split(": ")[1].split("@")[0] for line in links.stdout.splitlines()]
    return [name for name in names if re.fullmatch(rf"{prefix}[bhn]\d*", name)]


def test_nodes_reach_each_other_over_shaped_links_and_are_gone_after(netsim_ready):
    with namespaced_nodes(2, 100) as nodes:
        prefix = _prefix(nodes[0].namespace)
        assert sorted(_leftovers(prefix)) == sorted(
            [f"{prefix}b", f"{prefix}h0", f"{prefix}h1", *(n.namespace for n in nodes)]
        )
        qdisc = subprocess.run(
            ["tc", "qdisc", "show", "dev", nodes[1].host_link],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
        inside = nodes[1].command(["tc", "qdisc", "show", "dev", nodes[1].interface])
        assert (
            "rate 100Mbit"
            in subprocess.run(inside, capture_output=True).stdout.decode()
        )
        server = start(nodes[0].command(["python3", "-c", ECHO, nodes[0].address]))
        try:
            assert server.stdout.readline() == "listening\n"
            sent = subprocess.run(
                nodes[1].command(["python3", "-c", SEND, nodes[0].address]),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert sent.stdout == "across the bridge\n", sent.stderr
        finally:
            kill_session(server)
    assert _leftovers(prefix) == []


def test_the_nodes_are_removed_when_the_block_raises(netsim_ready):
    failing = pytest.raises(RuntimeError, match="the body failed")
    with failing, namespaced_nodes(2, 0) as nodes:
        prefix = _prefix(nodes[0].namespace)
        assert len(_leftovers(prefix)) == 5
        raise RuntimeError("the body failed")
    assert _leftovers(prefix) == []


def _hold_nodes() -> tuple[subprocess.Popen, str]:
    """A process holding two nodes; the prefix of its set."""
    holder = start([sys.executable, "-c", HOLDER])
    line = holder.stdout.readline()
    assert line, holder.communicate()[1]
    return holder, _prefix(line.split()[0])


def test_sigterm_removes_the_nodes(netsim_ready):
    holder, prefix = _hold_nodes()
    try:
        assert len(_leftovers(prefix)) == 5
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == -signal.SIGTERM  # still ended by it
        assert _leftovers(prefix) == []
    finally:
        kill_session(holder)
        remove_nodes(prefix)


def test_nodes_of_a_killed_process_are_removed_by_the_next_set(netsim_ready):
    holder, prefix = _hold_nodes()
    try:
        kill_session(holder)  # SIGKILL: nothing of the holder runs after it
        assert len(_leftovers(prefix)) == 5
        with namespaced_nodes(1, 0):
            assert _leftovers(prefix) == []
    finally:
        kill_session(holder)
        remove_nodes(prefix)


def test_a_set_is_refused_where_one_of_the_same_name_exists(netsim_ready):
    """The script does not take over (and later remove) another's nodes."""
    prefix = f"t{os.getpid()}"
    env = {**os.environ, "NETSIM_PREFIX": prefix}
    up = [f"{REPO}/tools/netsim.sh", "up", "1", "0"]
    try:
        first = subprocess.run(up, env=env, capture_output=True, text=True)
        assert first.returncode == 0, first.stderr
        again = subprocess.run(up, env=env, capture_output=True, text=True)
        assert again.returncode == 1 and f"prefix {prefix} is in use" in again.stderr
        assert sorted(_leftovers(prefix)) == [
            f"{prefix}b",
            f"{prefix}h0",
            f"{prefix}n0",
        ]
    finally:
        remove_nodes(prefix)
    assert _leftovers(prefix) == []
