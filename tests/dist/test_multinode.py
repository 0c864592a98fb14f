"""Two nodes on one machine (tools/netsim.sh: a network namespace each, on a
bridge, each link shaped to 1000 Mbit/s): ``torchrun --nnodes 2`` in each
node trains one epoch of each strategy across them, over their links, and
evaluates every validation sample exactly once."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import (
    TINY,
    TINY_VAL_SIZE,
    TRAIN_NET,
    kill_session,
    read_metrics,
    read_text,
    start,
)

# (DIST.STRATEGY, processes per node, what the start-up report says of it).
# hsdp shards within a node and replicates across the two.
RUNS = [
    ("ddp", 1, "strategy ddp"),
    ("fsdp", 1, "strategy fsdp"),
    ("hsdp", 2, "hsdp (2 replicas x 2 shards)"),
    ("pipeline", 1, "strategy pipeline (2 stages x 1 data-parallel"),
]
# What each node sends the other in the epoch at least: LeNet's parameters
# in float32 (measured: 0.4 MB under the pipeline, activations and their
# gradients at its cut; 1-2 MB of gradients or shards under the others).
MIN_BYTES_SENT = 62_006 * 4


def _bytes_sent(node) -> int:
    """Bytes that left ``node`` over its link (its link's host end received)."""
    path = f"/sys/class/net/{node.host_link}/statistics/rx_bytes"
    return int(read_text(path))


def _torchrun_on_nodes(nodes, nproc: int, port: int, args: list[str]):
    """``torchrun --nnodes N ... train_net.py ARGS`` in each node, the master
    node 0; their results (each killed with all it started on failure)."""
    procs = []
    for rank, node in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        cmd += [f"--nnodes={len(nodes)}", f"--node_rank={rank}"]
        cmd += [f"--nproc_per_node={nproc}", f"--master_addr={nodes[0].address}"]
        cmd += [f"--master_port={port}", TRAIN_NET, *args]
        env = {"GLOO_SOCKET_IFNAME": node.interface}
        procs.append(start(node.command(cmd), env=env))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            results.append(
                subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            )
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun on {len(nodes)} nodes did not end within 300 s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_session(proc)
    return results


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "nproc", "described"), RUNS, ids=[r[0] for r in RUNS]
)
def test_two_nodes_train_an_epoch_and_count_every_val_sample_once(
    two_nodes, tmp_path, strategy, nproc, described
):
    out = str(tmp_path)
    sent = [_bytes_sent(node) for node in two_nodes]
    port = 29400 + [run[0] for run in RUNS].index(strategy)
    args = [*TINY, "DIST.STRATEGY", strategy, "OUT_DIR", out]
    for node, result in zip(
        two_nodes, _torchrun_on_nodes(two_nodes, nproc, port, args)
    ):
        assert result.returncode == 0, f"{node.namespace}: {result.stderr[-3000:]}"
    (val,) = read_metrics(out, "val")
    assert val["samples"] == TINY_VAL_SIZE
    world = 2 * nproc
    log = read_text(out, "log.txt")
    assert f"launch: torchrun, rank 0 of {world}," in log
    assert f"{world} process(es) on 2 node(s)" in log
    assert f"master {two_nodes[0].address}:{port}" in log and described in log
    for node, before in zip(two_nodes, sent):
        assert _bytes_sent(node) - before > MIN_BYTES_SENT, node.namespace
    # The last rank, on the other node, logged the same validation line.
    assert _val_line(out, "log.txt") == _val_line(out, f"log_rank{world - 1}.txt")


def _val_line(out: str, name: str) -> str:
    lines = read_text(out, name).splitlines()
    return next(line for line in lines if "val ep 1/1" in line).split("] ", 1)[1]
