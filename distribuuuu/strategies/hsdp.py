"""``DIST.STRATEGY hsdp``: hybrid sharding.  FSDP within each group of
neighbouring ranks (a node, by default), and the groups replicas of each other.

The processes form a 2-D mesh ``replicate`` x ``shard``
(:class:`~distribuuuu.strategies.mesh.ParallelDims` with ``shard``), and
FSDP2's ``fully_shard`` given that mesh does the rest: each block's
parameters are gathered and its gradients reduce-scattered within a shard
group only (the fast links of a node), and each rank's gradient shard is then
all-reduced with the same shard of the other groups.  Memory per rank is
FSDP's over ``DIST.HSDP.SHARD_SIZE`` ranks instead of over the world; what
crosses the slow links between nodes is one all-reduce of a shard per step.

Everything else is FSDP's (:class:`~distribuuuu.strategies.fsdp.FSDPStrategy`):
rank 0's model to start from, ``DIST.FSDP_CPU_OFFLOAD``, gradient accumulation,
and sharded checkpoints through DCP, which re-shards on load, so that a
checkpoint of hsdp resumes under fsdp, ddp or one process, and theirs under
hsdp.  Tensor parallelism is not combined with it (a 3-D mesh).
"""

from __future__ import annotations

from torch import nn

from distribuuuu.dist import group as du
from distribuuuu.strategies.fsdp import FSDPStrategy
from distribuuuu.strategies.mesh import ParallelDims
from distribuuuu.strategies.registry import register
from distribuuuu.strategies.spec import FP16, MICRO_BATCH_AUTO, SYNCBN, StrategySpec


def shard_size(spec: StrategySpec) -> int:
    """Processes per shard group: DIST.HSDP.SHARD_SIZE, or for 0 the processes
    on this node (as pre-flight or the planner says, else as launched)."""
    if spec.hsdp_shard_size:
        return spec.hsdp_shard_size
    return spec.local_world_size or du.detect_launch().local_world_size


@register
class HSDPStrategy(FSDPStrategy):
    """FSDP2 ``fully_shard`` per block over a 2-D mesh; sharded checkpoints."""

    name = "hsdp"
    takes_tensor_parallel = False
    refused = {
        SYNCBN: "DIST.STRATEGY hsdp",
        FP16: "DIST.STRATEGY hsdp; use bf16",
        MICRO_BATCH_AUTO: "DIST.STRATEGY hsdp (its forward and backward gather "
        "and scatter the shards: no rank can try a step alone)",
    }

    @classmethod
    def parallel_dims(cls, spec: StrategySpec, world_size: int) -> ParallelDims:
        """The world as ``replicate`` x ``shard`` (checked by pre-flight:
        the shard groups must divide it)."""
        return ParallelDims(world_size, shard=shard_size(spec))

    def describe(self, model: nn.Module) -> str:
        dims = self.dims
        return f"hsdp ({dims.replicate} replicas x {dims.shard} shards)"
