"""What FSDP's own machinery costs on this machine, beyond the bytes its
collectives carry: DTensor's dispatch in the optimizer's step, per sharded
parameter tensor; and, in the forward and backward passes, the work around
each gather and reduction (hooks, copies in and out of the flat buffers,
DTensor conversions), per collective.

On a CPU this work takes the cores the compute uses, and it dominates the
wire for small units: on the 2-core test machine each of vit_tiny_patch4's
FSDP units cost about 3 ms per gather or reduction with gloo, of which a
small all-reduce's latency is 0.3-1 ms.  Both are measured on the live
process group (collectives: every rank calls them) with tensors so small
that the wire carries almost nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from distribuuuu.plan.timing import median_s

# The units, and the width of their layers, of the model whose FSDP passes
# are timed against its plain copy's.
PROBE_UNITS, PROBE_WIDTH = 4, 8
# Each unit (reshard after forward) gathers its parameters for the forward,
# again for the backward, and reduce-scatters its gradients.
COLLECTIVES_PER_UNIT = 3


def _world_size() -> int:
    """Ranks of the process group; 1 without one."""
    initialized = dist.is_available() and dist.is_initialized()
    return dist.get_world_size() if initialized else 1


def measure_sharded_tensor_s(
    device: torch.device,
    optimizer_class: Callable[[list], torch.optim.Optimizer] = torch.optim.AdamW,
    tensors: int = 8,
) -> float:
    """Seconds an optimizer step spends per parameter sharded as a DTensor
    over the world (as FSDP's are): small tensors, so that DTensor's
    dispatch is what is timed.  0 without a process group of more than one
    rank.  A collective (the world's mesh): every rank calls it."""
    size = _world_size()
    if size <= 1:
        return 0.0
    mesh = init_device_mesh(device.type, (size,))
    params = []
    for _ in range(tensors):
        whole = torch.zeros(64 * size, device=device)
        param = nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)]))
        param.grad = distribute_tensor(torch.zeros_like(whole), mesh, [Shard(0)])
        params.append(param)
    optimizer = optimizer_class(params)
    return median_s(optimizer.step, device, repeats=3) / tensors


def _probe_model(tensors_per_unit: float, device: torch.device) -> nn.Sequential:
    """:data:`PROBE_UNITS` units of as many small linear layers as hold
    ``tensors_per_unit`` parameter tensors (a weight and a bias each),
    initialized without drawing from the caller's RNG."""
    layers = max(round(tensors_per_unit / 2), 1)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        units = [
            nn.Sequential(*(nn.Linear(PROBE_WIDTH, PROBE_WIDTH) for _ in range(layers)))
            for _ in range(PROBE_UNITS)
        ]
        return nn.Sequential(*units).to(device)


def measure_sharded_unit_s(
    device: torch.device, tensors_per_unit: float, repeats: int = 3
) -> float:
    """Seconds FSDP2's forward and backward passes spend per unit of
    ``tensors_per_unit`` parameter tensors sharded over the world, wire
    latency included: a small model's passes, each unit sharded, against
    its plain copy's.  0 without a process group of more than one rank.  A
    collective (the world's mesh): every rank calls it."""
    size = _world_size()
    if size <= 1:
        return 0.0
    plain = _probe_model(tensors_per_unit, device)
    sharded = _probe_model(tensors_per_unit, device)
    mesh = init_device_mesh(device.type, (size,))
    for unit in sharded:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    images = torch.zeros(1, PROBE_WIDTH, device=device)

    def passes(model: nn.Module) -> Callable[[], None]:
        return lambda: model(images).sum().backward()

    dist.barrier()
    sharded_s = median_s(passes(sharded), device, repeats)
    plain_s = median_s(passes(plain), device, repeats)
    return max(sharded_s - plain_s, 0.0) / PROBE_UNITS
