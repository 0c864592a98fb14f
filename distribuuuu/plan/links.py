"""The links of a machine and what a collective costs on them: the
alpha-beta model of :mod:`distribuuuu.plan.cost`.

Each collective costs ``alpha + factor x bytes / beta`` on its group's link
(Hockney's model; the factors of ring algorithms as in Thakur et al.,
"Optimization of Collective Communication Operations in MPICH", 2005, and
as nccl-tests defines bus bandwidth): an all-reduce moves ``2(n-1)/n`` of its
bytes over each link, an all-gather or reduce-scatter ``(n-1)/n`` of the
whole tensor, a broadcast and a point-to-point send all of it.  ``alpha`` is
one collective's latency, however small it is.  A group whose ranks are all
on one node uses the intra-node link; one that spans nodes uses the
inter-node link, shared by the groups of its kind that cross it at once.
"""

from __future__ import annotations

from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes per second of one Gbit/s


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha`` and ``beta`` of the alpha-beta model."""

    latency_s: float  # alpha: seconds of one collective, however small
    bytes_per_s: float  # beta: bus bandwidth, bytes per second over each link
    # The share of beta an all-gather and a reduce-scatter reach: 1 as the
    # ring algorithms go (NCCL); gloo's, measured, reach less.
    gather_share: float = 1.0
    scatter_share: float = 1.0

    @classmethod
    def of(cls, gbit_per_s: float, latency_us: float) -> Link:
        """A link of ``gbit_per_s`` Gbit/s and ``latency_us`` microseconds."""
        return cls(latency_us * 1e-6, gbit_per_s * GBIT)

    def seconds(self, moved_bytes: float, share: float = 1.0) -> float:
        """One collective that moves ``moved_bytes`` over each link, where the
        group gets ``share`` of the link's bandwidth."""
        return self.latency_s + moved_bytes / (self.bytes_per_s * share)


@dataclass(frozen=True)
class Cluster:
    """The machine a plan runs on."""

    nodes: int
    procs_per_node: int
    intra: Link  # between the processes of a node
    inter: Link  # between nodes (one link per node, shared by its processes)
    flops_per_s: float  # achieved by one device on this model: efficiency x peak
    # Collectives run beside compute on their own streams (NCCL); False where
    # they take the compute's time (gloo on the CPU: the rank waits for them,
    # or its threads take the cores that the compute keeps busy).
    overlap: bool = False
    host: Link | None = None  # device <-> host memory, for offloaded state
    # Seconds a micro-batch's forward and backward take beyond their FLOPs
    # (kernel launches, Python): what makes small micro-batches slow.
    overhead_s: float = 0.0

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node


def group_link(cluster: Cluster, size: int, stride: int = 1) -> tuple[Link, float]:
    """The link of a group of ``size`` ranks ``stride`` apart, and the share
    of its bandwidth the group gets: a group within a node has the intra-node
    link to itself; the groups that span nodes share each node's link."""
    per_node = cluster.procs_per_node
    if size * stride <= per_node or cluster.nodes == 1:
        return cluster.intra, 1.0
    in_node = max(1, min(size, per_node // stride))  # its ranks on one node
    return cluster.inter, in_node / per_node


def all_reduce_s(cluster: Cluster, nbytes: float, size: int, stride: int = 1) -> float:
    """A ring all-reduce of ``nbytes`` over ``size`` ranks."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    link, share = group_link(cluster, size, stride)
    return link.seconds(2 * (size - 1) / size * nbytes, share)


def gather_s(
    cluster: Cluster,
    nbytes: float,
    size: int,
    stride: int = 1,
    scatter: bool = False,
) -> float:
    """An all-gather (a reduce-scatter with ``scatter``) whose whole tensor
    is ``nbytes``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    link, share = group_link(cluster, size, stride)
    share *= link.scatter_share if scatter else link.gather_share
    return link.seconds((size - 1) / size * nbytes, share)


def send_s(cluster: Cluster, nbytes: float, size: int, stride: int = 1) -> float:
    """A broadcast or point-to-point send of ``nbytes`` within a group."""
    if size <= 1:
        return 0.0
    link, share = group_link(cluster, size, stride)
    return link.seconds(nbytes, share)
