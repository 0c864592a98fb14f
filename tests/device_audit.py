"""The device audit's machinery (tests/test_device_audit.py): fake ranks of
one world in this process, the meta device, and a record of every tensor
handed to a process group.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``,
a private module: :func:`fake_store` says so when it moves) forms a world of
any size in one process whose collectives return at once without moving a
byte, and the collectives have kernels for ``meta``, a device that holds no
data.  Run on meta, a strategy hands the groups meta tensors wherever it
chose its device, and a tensor it left on the CPU stands out.  The
:class:`CollectiveAudit` (a dispatch mode) sees every collective op, from
``torch.distributed``'s calls, DDP's reducer, FSDP and ZeRO (``c10d``, whose
group it unboxes) to DTensor's functional collectives (``_c10d_functional``,
whose group it resolves by name), and records which group got tensors on
which device.

A fake group moves no values and a meta tensor holds none; where the code
reads them back, the audit answers in the peers' place:

* meta tensors made from host values (``torch.tensor(..., device=meta)``, a
  copy to meta) keep a shadow of those values on the CPU, which every op on
  them updates alike; reading a meta tensor on the host (``.item()``,
  ``.tolist()``, ``.cpu()``) answers its shadow, or zeros without one;
* a send or broadcast posts its shadows; a receive on a rank simulated later
  takes the first unread message of its source in the shapes it expects; a
  broadcast from a rank not simulated yet takes this rank's own latest post
  in those shapes (the ranks stand in for each other), and an all-gather
  fills the slots of such ranks with this rank's contribution;
* object collectives (``all_gather_object``, ``gather_object``,
  ``broadcast_object_list``, whose device torch picks from the group's
  backend) are recorded and answered alike, with the objects themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from distribuuuu.dist import collectives
from distribuuuu.dist import group as du

aten = torch.ops.aten

# The collective ops: c10d's (torch.distributed's calls, DDP's reducer, FSDP,
# ZeroRedundancyOptimizer) and the functional collectives (DTensor's).
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# What an object collective hands over: pickled bytes on a device that torch
# picks from the group's backend (the bound GPU under NCCL), not the caller.
OBJECTS = "objects"
# The group of host-side checks (gloo beside NCCL), where CPU tensors belong.
CONTROL = "control"
WORLD = "world"


def fake_store():
    """The store of torch's fake process group (a private torch module)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:
        raise AssertionError(
            f"torch {torch.__version__} no longer has its private fake process "
            "group (torch.testing._internal.distributed.fake_pg, FakeStore): "
            "the device audit forms its world of ranks in one process with it"
        ) from error
    return FakeStore()


class MetaStream(torch.cpu.Stream):
    """The CPU's stream, which orders nothing, with the numbers a
    ``torch.Stream`` has (FSDP of torch 2.15 hands them to its
    ``fsdp::record_grad_output_stream`` op, a no-op by default)."""

    stream_id = 0
    device_index = 0
    device_type = 0


# What FSDP asks of ``torch.<device type>`` (current device, streams and
# events), for meta: the CPU's streams and events, which order nothing.
META_DEVICE_MODULE = {
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "is_available": lambda: True,
    "set_device": lambda device: None,
    "Stream": MetaStream,
    "Event": torch.cpu.Event,
    "stream": torch.cpu.stream,
    "current_stream": lambda device=None: MetaStream(),
    "synchronize": torch.cpu.synchronize,
}


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """Let FSDP2 shard and run a model on meta, through two private torch
    APIs: it looks the device's module up as ``torch.<type>`` (there is no
    ``torch.meta``), and refuses to run parameters still on meta (meant to
    be materialized first) in ``FSDPParamGroup._validate_no_meta_params``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
        FSDPParamGroup,
    )

    if not hasattr(FSDPParamGroup, "_validate_no_meta_params"):
        raise AssertionError(
            "torch's private FSDPParamGroup._validate_no_meta_params is gone: "
            "the device audit must find how FSDP2 now refuses meta parameters"
        )
    module = type(torch)("torch.meta")
    module.__dict__.update(META_DEVICE_MODULE)
    with (
        mock.patch.object(torch, "meta", module, create=True),
        mock.patch.object(FSDPParamGroup, "_validate_no_meta_params", lambda _: None),
    ):
        yield


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of a fake world of ``world`` ranks, with a
    fake group for the host-side checks as a CUDA run has (gloo there)."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=fake_store())
    try:
        with mock.patch.object(collectives, "_CONTROL", dist.new_group(backend="fake")):
            yield
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class Handed:
    """The tensors one collective handed to one process group."""

    phase: str
    group: str
    op: str
    devices: tuple[str, ...]
    group_id: str = dataclasses.field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.phase}: {self.op} on {self.group} got {', '.join(self.devices)}"


class CollectiveAudit(TorchDispatchMode):
    """Records the devices of the tensors every collective hands to each group
    (see the module's docstring), and answers for the peers of a fake world.

    Set :attr:`phase` to name what runs; :meth:`name_group` gives a group a
    readable name (unnamed ones read ``ranks 0,1``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.handed: list[Handed] = []
        self.turn_start = 0
        self.names: dict[str, str] = {}
        self.shadows = WeakIdKeyDictionary()
        self.posts: dict[tuple, list[list]] = {}
        self.read: dict[tuple, set[int]] = {}
        self.objects: dict[tuple, object] = {}
        self.gathered: dict[tuple, torch.Tensor | None] = {}

    # --- what the check reads ------------------------------------------- #
    def off_device(self, device: torch.device) -> list[Handed]:
        """What reached a group other than the control group (and other than
        through an object collective) on another device than ``device``."""
        return [
            handed
            for handed in self.handed
            if handed.group != CONTROL
            and handed.devices != (OBJECTS,)
            and set(handed.devices) != {str(device)}
        ]

    def groups_used(self) -> set[tuple[str, str]]:
        """The (phase, group) pairs that saw a collective."""
        return {(handed.phase, handed.group) for handed in self.handed}

    # --- groups ---------------------------------------------------------- #
    def begin_turn(self) -> None:
        """A new fake rank joins: its groups are named afresh."""
        self.turn_start, self.names = len(self.handed), {}

    def name_group(self, group, name: str) -> None:
        """Call ``group`` ``name``, in what this turn recorded before too."""
        self.names[group.group_name] = name
        for index in range(self.turn_start, len(self.handed)):
            handed = self.handed[index]
            if handed.group_id == group.group_name:
                self.handed[index] = dataclasses.replace(handed, group=name)

    def _record(self, group, op: str, devices: tuple[str, ...]) -> None:
        group = group if group is not None else dist.group.WORLD
        label = self.label(group)
        handed = Handed(self.phase, label, op, devices, group.group_name)
        self.handed.append(handed)

    def label(self, group) -> str:
        """The name of ``group`` in the record (None: the default group)."""
        group = group if group is not None else dist.group.WORLD
        if group.group_name in self.names:
            return self.names[group.group_name]
        if group.group_name == dist.group.WORLD.group_name:
            return WORLD
        control = du.control_group()
        if control is not None and group.group_name == control.group_name:
            return CONTROL
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))

    @staticmethod
    def _group_of(func, args: tuple, kwargs: dict):
        """The group of a c10d op (an argument of type ProcessGroup, boxed as a
        ScriptObject) or of a functional collective (its ``group_name``)."""
        schema = func._schema.arguments
        named = {**dict(zip((a.name for a in schema), args)), **kwargs}
        for argument in schema:
            value = named.get(argument.name)
            if str(argument.type).endswith("ProcessGroup") and value is not None:
                return dist.ProcessGroup.unbox(value)
        if "group_name" in named:
            return dist.distributed_c10d._resolve_process_group(named["group_name"])
        return None  # wait_tensor and the like: no group

    # --- the dispatch mode ----------------------------------------------- #
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            return self._collective(func, args, kwargs)
        return self._host_values(func, args, kwargs)

    def _collective(self, func, args: tuple, kwargs: dict):
        group = self._group_of(func, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [value for value in leaves if isinstance(value, torch.Tensor)]
        if group is not None and tensors:
            devices = tuple(sorted({str(t.device) for t in tensors}))
            name = func.overloadpacket.__name__
            self._record(group, name, devices)
            self._carry_values(name, group, args)
        return func(*args, **kwargs)

    def _carry_values(self, name: str, group, args: tuple) -> None:
        """A send or broadcast posts the shadows of its tensors; a receive
        takes the first message its source posted on that channel in the
        shapes it expects, which it has not read yet.  A rank not simulated
        yet posted nothing: a broadcast then takes what this rank posted in
        those shapes as a root itself (the ranks stand in for each other).
        An all-gather gives each rank's slot the shadow that rank contributed
        last (this rank's own for ranks not simulated yet)."""
        if name == "allgather_":
            self._all_gather(group, args[0][0], args[1][0])
        if name not in ("send", "recv_", "broadcast_"):
            return
        # c10d::send(tensors, group, dstRank, ...), recv_(tensors, group,
        # srcRank, ...), broadcast_(tensors, group, root_rank, ...): ranks in
        # the group.
        tensors, ranks = args[0], tuple(dist.get_process_group_ranks(group))
        peer, me = ranks[args[2]], dist.get_rank()
        if name == "send":
            self._post((ranks, me, peer), tensors)
        elif name == "recv_":
            self._take((ranks, peer, me), tensors)
        elif peer == me:
            self._post((ranks, me, None), tensors)
        elif not self._take((ranks, peer, None), tensors):
            self._stand_in((ranks, me, None), tensors)

    def _all_gather(self, group, slots: list[torch.Tensor], mine: torch.Tensor):
        # c10d::allgather_(output_tensors, input_tensors, group, ...)
        ranks = tuple(dist.get_process_group_ranks(group))
        self.gathered[(ranks, dist.get_rank())] = self.shadows.get(mine)
        for slot, rank in zip(slots, ranks):
            value = self.gathered.get((ranks, rank), self.shadows.get(mine))
            if value is not None and value.shape == slot.shape:
                self.shadows[slot] = value

    def _post(self, channel: tuple, tensors: list[torch.Tensor]) -> None:
        message = [(t.shape, self.shadows.get(t)) for t in tensors]
        self.posts.setdefault(channel, []).append(message)

    def _take(self, channel: tuple, tensors: list[torch.Tensor]) -> bool:
        """Whether a message of ``channel`` was there for ``tensors``."""
        read = self.read.setdefault((dist.get_rank(), channel), set())
        shapes = [tensor.shape for tensor in tensors]
        for index, message in enumerate(self.posts.get(channel, [])):
            if index not in read and [shape for shape, _ in message] == shapes:
                read.add(index)
                for tensor, (_, value) in zip(tensors, message):
                    if value is not None:
                        self.shadows[tensor] = value
                return True
        return False

    def _stand_in(self, channel: tuple, tensors: list[torch.Tensor]) -> None:
        """The values of this rank's latest post on ``channel`` in the shapes
        of ``tensors``, where it knows them all."""
        shapes = [tensor.shape for tensor in tensors]
        for message in reversed(self.posts.get(channel, [])):
            values = [value for _, value in message]
            known = all(value is not None for value in values)
            if known and [shape for shape, _ in message] == shapes:
                for tensor, value in zip(tensors, values):
                    self.shadows[tensor] = value
                return

    def _host_values(self, func, args: tuple, kwargs: dict):
        """Meta tensors made from host values keep a shadow of them, which
        every op on them updates alike (a twin on the CPU); reading one on the
        host answers its shadow (zeros without one)."""
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            return self._read(args[0]).item()
        if func is aten._to_copy.default and args[0].is_meta:
            device = kwargs.get("device")
            if device is not None and device.type != "meta":
                dtype = kwargs.get("dtype") or args[0].dtype
                return self._read(args[0]).to(device=device, dtype=dtype)
        if func is aten.copy_.default and args[1].is_meta and not args[0].is_meta:
            return args[0].copy_(self._read(args[1]))
        out = func(*args, **kwargs)
        self._twin(func, args, kwargs, out)
        if func in (aten._to_copy.default, aten.copy_.default):
            made = out if func is aten._to_copy.default else args[0]
            source = args[0] if func is aten._to_copy.default else args[1]
            if made.is_meta and made.shape == source.shape:
                value = source if not source.is_meta else self.shadows.get(source)
                if value is not None:
                    self.shadows[made] = value.detach().to("cpu", made.dtype, copy=True)
        return out

    def _twin(self, func, args: tuple, kwargs: dict, out) -> None:
        """Run ``func`` on the shadows where every meta input has one."""
        leaves = pytree.tree_leaves((args, kwargs))
        metas = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_meta]
        shadowed = [tensor in self.shadows for tensor in metas]
        if not any(shadowed):
            return
        if not all(shadowed):
            if func._schema.is_mutable:  # what it wrote is unknown
                for tensor in metas:
                    self.shadows.pop(tensor, None)
            return

        def on_host(value):
            if isinstance(value, torch.Tensor) and value.is_meta:
                return self.shadows[value]
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return value

        host_args, host_kwargs = pytree.tree_map(on_host, (args, kwargs))
        twin = func(*host_args, **host_kwargs)
        for made, value in zip(pytree.tree_leaves(out), pytree.tree_leaves(twin)):
            if isinstance(made, torch.Tensor) and made.is_meta:
                self.shadows[made] = value

    def _read(self, tensor: torch.Tensor) -> torch.Tensor:
        value = self.shadows.get(tensor)
        if value is None:
            return torch.zeros(tensor.shape, dtype=tensor.dtype)
        return value

    # --- what a fake group cannot do ------------------------------------- #
    def _tensor(self, real, data, *args, **kwargs) -> torch.Tensor:
        """``torch.tensor``, whose meta tensors keep their values' shadow."""
        made = real(data, *args, **kwargs)
        if made.is_meta:
            self.shadows[made] = real(data, dtype=made.dtype)
        return made

    def _all_gather_object(self, object_list: list, obj, group=None) -> None:
        self._contribute("all_gather_object", group, obj, object_list)

    def _gather_object(
        self, obj, object_gather_list=None, dst=None, group=None, group_dst=None
    ) -> None:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        main = dst if dst is not None else ranks[group_dst or 0]
        into = object_gather_list if dist.get_rank() == main else None
        self._contribute("gather_object", group, obj, into)

    def _contribute(self, name: str, group, obj, into: list | None) -> None:
        """This rank's ``obj`` kept for the ranks simulated later; ``into``
        gets every rank's (this rank's own for those not simulated yet)."""
        self._handed_objects(name, group)
        me = dist.get_rank()
        self.objects[(name, me)] = obj
        if into is None:
            return
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        for index, rank in enumerate(ranks):
            into[index] = self.objects.get((name, rank), obj)

    def _broadcast_object_list(
        self, object_list: list, src=None, group=None, device=None, group_src=None
    ) -> None:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        source = src if src is not None else ranks[group_src or 0]
        self._handed_objects("broadcast_object_list", group)
        key = ("broadcast_object_list", source)
        if source == dist.get_rank():
            self.objects[key] = list(object_list)
        elif key in self.objects:
            object_list[:] = self.objects[key]

    def _refuse(self, name: str):
        def refuse(*args, **kwargs):
            raise AssertionError(
                f"the device audit does not answer {name} for the fake ranks; "
                "teach tests/device_audit.py what its peers would send"
            )

        return refuse

    def _handed_objects(self, name: str, group) -> None:
        self._record(group, name, (OBJECTS,))

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveAudit]:
        """The audit, active (dispatch mode, ``torch.tensor`` and the object
        collectives answered as the module's docstring says)."""
        answered = {
            "all_gather_object": self._all_gather_object,
            "broadcast_object_list": self._broadcast_object_list,
            "gather_object": self._gather_object,
        }
        refused = ("scatter_object_list",)
        refused += ("send_object_list", "recv_object_list")
        with contextlib.ExitStack() as stack:
            for module in (dist, dist.distributed_c10d):
                for name, answer in answered.items():
                    stack.enter_context(mock.patch.object(module, name, answer))
                for name in refused:
                    refusal = self._refuse(name)
                    stack.enter_context(mock.patch.object(module, name, refusal))
            tensor = functools.partial(self._tensor, torch.tensor)
            stack.enter_context(mock.patch.object(torch, "tensor", tensor))
            stack.enter_context(self)
            yield self
