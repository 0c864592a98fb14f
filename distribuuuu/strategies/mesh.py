"""The processes of a run on named axes: data parallel x pipeline x tensor
parallel (``dp`` x ``pp`` x ``tp``), and the one device mesh over them.

:class:`ParallelDims` is built once from the world size and the configured
pipeline stages and tensor-parallel size (each 1 when off); every strategy
asks it how many data-parallel replicas there are and takes its groups from
its mesh.  The ranks of one pipeline, or of one tensor-parallel group, are
neighbours: ``tp`` (or ``pp``) is the mesh's last axis.  A mesh of data
parallelism alone is the world's own, one unnamed axis, as FSDP2 builds it.
Under HSDP the data-parallel axis is two, ``replicate`` x ``shard``: groups
of ``shard`` neighbouring ranks (a node) each shard one copy of the model.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """``world_size`` processes as ``dp`` x ``pp`` x ``tp``; with ``shard``
    (HSDP), ``dp`` as ``replicate`` x ``shard``."""

    world_size: int
    pp: int = 1
    tp: int = 1
    # HSDP: the data-parallel ranks of one shard group (0: dp is one axis).
    shard: int = 0

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each reads its own batches."""
        return max(self.world_size // (self.pp * self.tp), 1)

    @property
    def replicate(self) -> int:
        """HSDP's copies of the model: its shard groups (``dp`` without HSDP)."""
        return self.dp // self.shard if self.shard else self.dp

    def check(self) -> None:
        """ValueError unless the pipeline and tensor-parallel sizes divide
        the world (the rest of it is data parallel), and HSDP's shard groups
        divide the data-parallel ranks."""
        for size, key in ((self.pp, "DIST.PIPELINE.STAGES"),
                          (self.tp, "DIST.TENSOR_PARALLEL")):  # fmt: skip
            if size > 1 and self.world_size % size:
                raise ValueError(
                    f"{key} {size} must divide the world size {self.world_size} "
                    "(the processes; the rest of it is data parallel)"
                )
        if self.shard and self.dp % self.shard:
            raise ValueError(
                f"DIST.HSDP.SHARD_SIZE: shard groups of {self.shard} processes do "
                f"not divide the world size {self.world_size}; give a divisor of "
                f"{self.dp} (0 = the processes per node, as launched)"
            )

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """The mesh's named axes and their sizes: ``dp`` (or HSDP's
        ``replicate`` and ``shard``), then ``pp`` or ``tp`` where they are on."""
        data: tuple[tuple[str, int], ...] = (("dp", self.dp),)
        if self.shard:
            data = (("replicate", self.replicate), ("shard", self.shard))
        more = (("pp", self.pp), ("tp", self.tp))
        return data + tuple((name, size) for name, size in more if size > 1)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh of this layout over the current process group (a
        collective: every rank builds it)."""
        names, sizes = zip(*self.axes)
        if len(names) == 1:
            return init_device_mesh(device_type, sizes)
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def axis(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of axis ``name`` (the data-parallel axis of a mesh of
    data parallelism alone is the mesh itself; under HSDP it is the 2-D mesh
    ``replicate`` x ``shard``)."""
    if mesh.mesh_dim_names is None and name == "dp":
        return mesh
    if name == "dp" and "shard" in (mesh.mesh_dim_names or ()):
        return mesh["replicate", "shard"]
    return mesh[name]
