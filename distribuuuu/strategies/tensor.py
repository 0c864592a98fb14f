"""``DIST.TENSOR_PARALLEL N``: each transformer block split over N ranks
(Megatron's column- and row-parallel layers, :mod:`distribuuuu.models.tensor_parallel`),
data parallel over the rest of the world.

Not a strategy of its own but a step of the preparation chain
(:mod:`distribuuuu.strategies.chain`), before the strategy of the replicas
(``DIST.STRATEGY`` ddp or fsdp) wraps or shards the model.  The world is the
mesh ``dp`` x ``tp``: ranks ``d * N ... d * N + N - 1`` split the blocks of
replica ``d`` and share its batches, and its torch RNG state (that of rank
``d * N``), so that they draw the same drop-path masks.  The weights are
DTensors, so checkpoints go through DCP exactly as FSDP's do (sharded,
re-sharded on load, read whole by the tools); whole state dicts carry
torchvision's fused attention keys (a split attention's q, k, v are DTensors,
which its state_dict hook leaves apart), so that best.pth and the tools load
them into a plain torchvision ViT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distribuuuu.checkpoint.format import fuse_qkv
from distribuuuu.models.tensor_parallel import (
    check_tensor_parallel,
    parallelize,
    share_random_state,
)
from distribuuuu.models.vit import split_qkv
from distribuuuu.strategies.broadcast import broadcast_model
from distribuuuu.strategies.spec import FP16, MICRO_BATCH_AUTO, StrategySpec


class TensorParallel:
    """The blocks of each replica split over the ``tp`` axis of the mesh."""

    # What tensor parallelism refuses, as a strategy declares it.
    refused = {
        FP16: "DIST.TENSOR_PARALLEL; use bf16",
        MICRO_BATCH_AUTO: "DIST.TENSOR_PARALLEL (the split blocks exchange "
        "activations in every forward: no rank can try a step alone)",
    }

    def __init__(self, spec: StrategySpec):
        self.size = spec.tensor_parallel
        # Built with its strategy, once the device is chosen: never None.
        self.device = cast(torch.device, spec.device)
        self.sequence_parallel = spec.sequence_parallel
        self.rank = 0  # in the tensor-parallel group, once applied

    @staticmethod
    def check_layout(spec: StrategySpec, skeleton: Callable[[], nn.Module]) -> None:
        """ValueError unless the model (``skeleton()``) has a plan that
        splits it over ``spec.tensor_parallel`` ranks."""
        size, sequence = spec.tensor_parallel, spec.sequence_parallel
        check_tensor_parallel(skeleton(), size, sequence, spec.image_size)

    def apply(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """``model`` on this process's device with rank 0's weights, its
        blocks split over ``mesh``'s ``tp`` axis (in place)."""
        self.rank = mesh.get_local_rank("tp")
        # The ranks of a replica draw its drop-path masks alike from here on.
        share_random_state(mesh["tp"], self.device)
        model = model.to(self.device)
        broadcast_model(model)  # the replicas and the shards start from rank 0's
        parallelize(model, mesh["tp"], self.sequence_parallel)
        return model

    def describe(self, replicas: int, over: str) -> str:
        """A few words for the start-up report: ``over`` (ddp or fsdp) is
        what spreads the ``replicas``."""
        sequence = ", sequence parallel" * self.sequence_parallel
        return (
            f"tensor parallel ({self.size} ranks per block{sequence}) x {over} "
            f"over {replicas} replica(s)"
        )

    def whole_keys(self, state: dict) -> dict:
        """A whole state dict of the split model in the plain model's keys."""
        return fuse_qkv(state)

    def split_keys(self, weights: dict) -> dict:
        """Whole weights of the plain model in the split model's keys."""
        return split_qkv(dict(weights))
