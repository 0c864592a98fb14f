"""ddp across two nodes at two link speeds: the step ``tools/plan.py``
predicts on paper beside the one measured (for ``tools/benchmark.py --only
plan``; the issue's bound: 25%).

Each node is a network namespace whose link is shaped with ``tc tbf``
(:func:`~distribuuuu.bench.netsim.namespaced_nodes`) and runs on a core of
its own (``taskset``): a node of one process with one CPU.  The planner runs
as a user would run it, on one core too, with ``--nodes 2 --procs-per-node 1
--device cpu --inter-gbps`` the link's speed.  The measured step is the
median of the training windows after the first (``metrics.jsonl``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from distribuuuu.bench.netsim import namespaced_nodes, why_unavailable
from distribuuuu.dist.spawn import find_free_port

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
RATES_MBIT = (100, 1000)
# A model whose gradients (45 MB) cost more to all-reduce at these speeds
# than its steps cost to compute: 10 steps of global batch 64.
RUN = [
    "MODEL.ARCH", "resnet18", "DATA.NAME", "synthetic",
    "DATA.SYNTHETIC_SIZE", "[640,64]", "TRAIN.IM_SIZE", "32",
    "TEST.IM_SIZE", "32", "TEST.CROP_SIZE", "32", "TRAIN.BATCH_SIZE", "32",
    "OPTIM.MAX_EPOCH", "1",
    "TRAIN.PRINT_FREQ", "2", "DIST.STRATEGY", "ddp",
]  # fmt: skip
BOUND = 0.25


def predicted_step_s(rate_mbit: int) -> float:
    """ddp's step on paper (micro-batch 32, no accumulation), planned on
    one core."""
    cmd = ["taskset", "-c", "0", sys.executable, os.path.join(TOOLS, "plan.py")]
    cmd += ["--nodes", "2", "--procs-per-node", "1", "--device", "cpu"]
    cmd += ["--inter-gbps", str(rate_mbit / 1000), "--json", *RUN]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wanted = ("ddp", 32, 1, False)
    for row in json.loads(out)["candidates"]:
        fields = ("strategy", "micro_batch", "accum_steps", "act_ckpt")
        if tuple(row[field] for field in fields) == wanted:
            return row["step_s"]
    raise RuntimeError("tools/plan.py weighed no ddp at micro-batch 32")


def measured_step_s(rate_mbit: int, out_dir: str) -> float:
    """The median step of an epoch of ddp on two nodes whose links run at
    ``rate_mbit``, each node on a core of its own."""
    port = find_free_port()
    with namespaced_nodes(2, rate_mbit) as nodes:
        procs = []
        for rank, node in enumerate(nodes):
            cmd = ["taskset", "-c", str(rank), sys.executable]
            cmd += ["-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}"]
            cmd += ["--nproc_per_node=1", f"--master_addr={nodes[0].address}"]
            cmd += [f"--master_port={port}", os.path.join(TOOLS, "train_net.py")]
            cmd += [*RUN, "OUT_DIR", out_dir]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface}
            procs.append(
                subprocess.Popen(
                    node.command(cmd),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            errors = [proc.communicate(timeout=600)[1] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for proc, error in zip(procs, errors):
            if proc.returncode:
                raise RuntimeError(f"a node failed: {error[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        windows = [r for r in map(json.loads, f) if r.get("split") == "train"]
    return statistics.median(64 / r["img_per_s"] for r in windows[1:])


def plan_links() -> dict:
    """Per link speed: ddp's predicted and measured step and the error; or
    why it could not run here (not root, no namespaces)."""
    reason = why_unavailable()
    if reason:
        return {"skipped": reason}
    rows = {}
    for rate in RATES_MBIT:
        predicted = predicted_step_s(rate)
        with tempfile.TemporaryDirectory(prefix="distribuuuu-links-") as out_dir:
            measured = measured_step_s(rate, out_dir)
        error = predicted / measured - 1
        rows[rate] = {
            "predicted_s": predicted,
            "measured_s": measured,
            "error": error,
            "within": abs(error) <= BOUND,
        }
    return {"rows": rows, "bound": BOUND}


def format_plan_links(result: dict) -> str:
    """The result of :func:`plan_links` as text."""
    if "skipped" in result:
        return f"plan across 2 nodes: skipped ({result['skipped']})"
    lines = ["ddp across 2 nodes  link     predicted s  measured s   error"]
    for rate, row in result["rows"].items():
        lines.append(
            f"{'':<19} {rate:>4} Mbit {row['predicted_s']:>11.3f} "
            f"{row['measured_s']:>11.3f} {row['error']:>+7.1%}"
            f"{'' if row['within'] else '  (over 25%)'}"
        )
    return "\n".join(lines)
