"""``DIST.TENSOR_PARALLEL N``: each transformer block split over N ranks
(Megatron's column- and row-parallel layers, :mod:`distribuuuu.models.tensor_parallel`),
data parallel over the rest of the world.

The world is a 2-D mesh, data parallel x tensor parallel (``dp`` x ``tp``):
ranks ``d * N ... d * N + N - 1`` split the blocks of replica ``d`` and share
its batches, and its torch RNG state (that of rank ``d * N``), so that they
draw the same drop-path masks.  Over ``dp``, ``DIST.STRATEGY ddp`` averages
the gradients after backward (one all-reduce per step, this rank's shards
only) and ``DIST.STRATEGY fsdp`` shards each block again (2-D FSDP x TP,
PyTorch's own recipe).  The weights are DTensors, so checkpoints go through
DCP exactly as FSDP's do (sharded, re-sharded on load, read whole by the
tools).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from yacs.config import CfgNode

from distribuuuu.checkpoint import weights_in
from distribuuuu.dist import group as du
from distribuuuu.models.tensor_parallel import (
    check_tensor_parallel,
    parallelize,
    share_random_state,
)
from distribuuuu.models.vit import fuse_qkv, split_qkv
from distribuuuu.strategies.base import average_gradients, broadcast_model
from distribuuuu.strategies.fsdp import FSDPStrategy, shard_fully

logger = logging.getLogger(__name__)


class TensorParallelStrategy(FSDPStrategy):
    """Tensor parallel blocks; ddp or fsdp over the replicas."""

    name = "tensor"

    @classmethod
    def replicas(cls, cfg: CfgNode, world_size: int) -> int:
        return max(world_size // cfg.DIST.TENSOR_PARALLEL, 1)

    @classmethod
    def check_layout(cls, cfg: CfgNode, world_size: int, skeleton) -> None:
        size = cfg.DIST.TENSOR_PARALLEL
        if world_size % size:
            raise ValueError(
                f"DIST.TENSOR_PARALLEL {size} must divide the world size "
                f"{world_size} (the processes; the rest of it is data parallel)"
            )
        sequence = cfg.DIST.SEQUENCE_PARALLEL
        check_tensor_parallel(skeleton(), size, sequence, cfg.TRAIN.IM_SIZE)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        size, world = self.cfg.DIST.TENSOR_PARALLEL, du.get_world_size()
        mesh = init_device_mesh(
            self.device.type, (world // size, size), mesh_dim_names=("dp", "tp")
        )
        self.dp_group, self.dp_size = mesh.get_group("dp"), world // size
        self.tp_rank = mesh.get_local_rank("tp")
        # The ranks of a replica draw its drop-path masks alike from here on.
        share_random_state(mesh["tp"], self.device)
        model = model.to(self.device)
        broadcast_model(model)  # the replicas and the shards start from rank 0's
        parallelize(model, mesh["tp"], self.cfg.DIST.SEQUENCE_PARALLEL)
        self.sharded_replicas = self.cfg.DIST.STRATEGY == "fsdp" and self.dp_size > 1
        if self.sharded_replicas:
            offload = self.cfg.DIST.FSDP_CPU_OFFLOAD
            shard_fully(model, self.device, offload, self.amp_dtype, mesh["dp"])
        logger.info("%s", self.describe(model))
        return model

    def describe(self, model: nn.Module) -> str:
        over = "fsdp" if self.sharded_replicas else "ddp"
        sequence = ", sequence parallel" * self.cfg.DIST.SEQUENCE_PARALLEL
        return (
            f"tensor parallel ({self.cfg.DIST.TENSOR_PARALLEL} ranks per block"
            f"{sequence}) x {over} over {self.dp_size} replica(s)"
        )

    def spread(self, model: nn.Module) -> bool:
        return True

    def holds_outputs(self, model: nn.Module) -> bool:
        """The ranks of a replica all get its logits; the first one counts."""
        return self.tp_rank == 0

    # Whole state dicts carry torchvision's fused attention keys (a split
    # attention's q, k, v are DTensors, which its state_dict hook leaves apart),
    # so that best.pth and the tools load them into a plain torchvision ViT.
    def model_state_dict(self, model: nn.Module) -> dict:
        return fuse_qkv(super().model_state_dict(model))

    def load_model_state(self, model: nn.Module, weights: dict, strict=True) -> None:
        super().load_model_state(model, split_qkv(dict(weights)), strict)

    def load_model_weights(self, model, weights, path, finetune_classes=None):
        weights = split_qkv(dict(weights_in(weights)))
        return super().load_model_weights(model, weights, path, finetune_classes)

    def reduce_gradients(self, model: nn.Module) -> None:
        """Under ddp: this rank's gradient shards averaged over the replicas
        (fsdp reduce-scatters them during backward)."""
        if not self.sharded_replicas:
            params = list(model.parameters())
            average_gradients(params, self.dp_group, self.dp_size)
