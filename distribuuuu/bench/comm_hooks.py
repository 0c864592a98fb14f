"""DDP's communication hooks (DIST.DDP.COMM_HOOK), for tools/benchmark.py.

Two local gloo ranks train the benchmark's model under DDP with each hook:
``none`` (torch's plain all-reduce hook, which does what DDP does without
one), ``fp16`` and ``powersgd`` (compressing from the third step).  Per hook:
the bytes that go into all-reduces per optimizer step, counted at
``torch.distributed.all_reduce`` once PowerSGD compresses, and the step's
seconds, the hooks alternating repeat after repeat.  On one machine the wire
is memory, so the seconds show the hooks' own cost; the bytes are what a
slow link between nodes would carry.
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from distribuuuu.bench.overheads import on_local_ranks, summarize
from distribuuuu.models import build_model
from distribuuuu.strategies import comm_hooks
from distribuuuu.strategies.spec import CommHookSpec

HOOKS = ("none", "fp16", "powersgd")
WARMUP = 3  # steps before measuring: PowerSGD compresses from step 2


class _CountedAllReduce:
    """``torch.distributed.all_reduce`` that adds up the bytes it is given."""

    def __init__(self):
        self.bytes, self.all_reduce = 0, dist.all_reduce

    def __call__(self, tensor: torch.Tensor, *args, **kwargs):
        self.bytes += tensor.numel() * tensor.element_size()
        return self.all_reduce(tensor, *args, **kwargs)


def _hooked_model(arch: str, hook: str) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(arch, 10))
    if hook == "none":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        comm_hooks.register(model, CommHookSpec(hook, powersgd_start_iter=2))
    return model


def _on_rank(rank, ranks, port, arch, im_size, batch, steps, repeats, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks
    )
    counted = _CountedAllReduce()
    dist.all_reduce = counted
    images = torch.randn(batch, 3, im_size, im_size)
    labels = torch.randint(0, 10, (batch,))
    models = {hook: _hooked_model(arch, hook) for hook in HOOKS}

    def train(model: DistributedDataParallel, steps: int) -> None:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()

    for model in models.values():
        train(model, WARMUP)
    seconds: dict[str, list[float]] = {hook: [] for hook in HOOKS}
    sent: dict[str, int] = {}
    for repeat in range(repeats):
        for hook in HOOKS[repeat % len(HOOKS) :] + HOOKS[: repeat % len(HOOKS)]:
            dist.barrier()
            counted.bytes, start = 0, time.perf_counter()
            train(models[hook], steps)
            seconds[hook].append((time.perf_counter() - start) / steps)
            sent[hook] = counted.bytes // steps
    dist.all_reduce = counted.all_reduce
    if rank == 0:
        torch.save({"seconds": seconds, "bytes": sent}, out)
    dist.destroy_process_group()


def measure_comm_hooks(arch: str, im_size: int, batch: int, repeats: int) -> dict:
    """Bytes all-reduced and seconds per step of each hook on 2 ranks, for
    model ``arch`` at ``im_size`` px, ``batch`` images a rank."""
    with tempfile.TemporaryDirectory() as work:
        args = (arch, im_size, batch, 5, repeats)
        found = on_local_ranks(_on_rank, 2, args, work)
    hooks = {
        hook: {
            "bytes_per_step": found["bytes"][hook],
            "seconds": summarize(found["seconds"][hook]),
        }
        for hook in HOOKS
    }
    return {"model": f"{args[0]} at {args[1]} px, {args[2]} a rank", "hooks": hooks}


def format_comm_hooks(result: dict) -> str:
    """The rows: bytes per step (and their share of ``none``'s), seconds."""
    hooks = result["hooks"]
    plain = max(hooks["none"]["bytes_per_step"], 1)
    lines = [
        f"DDP comm hooks, 2 gloo ranks, {result['model']}",
        "  hook          MB all-reduced/step (share)   s/step median (min-max)",
    ]
    for hook, row in hooks.items():
        sent, took = row["bytes_per_step"], row["seconds"]
        lines.append(
            f"  {hook:<13} {sent / 2**20:10.3f} ({sent / plain:.3f})"
            f"{'':14}{took['median']:.4f} ({took['min']:.4f}-{took['max']:.4f})"
        )
    return "\n".join(lines)
