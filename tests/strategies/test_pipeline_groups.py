"""The pipeline's collectives at the start and at the best-weight save, watched
in one process on torch's fake process group (no data moves): which tensors go
to which group, on which device, and which ranks receive the gathered stages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from distribuuuu.config import get_cfg
from distribuuuu.dist import collectives
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.models import build_model
from distribuuuu.strategies import build_strategy
from distribuuuu.strategies.pipeline import PipelineStrategy


@contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on the fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _pipeline(device: str) -> PipelineStrategy:
    cfg = get_cfg()
    cfg.MODEL.ARCH, cfg.DIST.STRATEGY = "lenet5", "pipeline"
    return build_strategy(strategy_spec(cfg, torch.device(device)))


def _lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("lenet5", 10)


def test_the_start_broadcast_hands_the_default_group_device_tensors_only(
    monkeypatch,
):
    """Rank 0's weights reach every stage over the default group, which is
    NCCL on GPUs and carries no host tensors: each tensor it is handed is on
    the training device (a host tensor there killed every GPU pipeline run at
    its start).  The meta device stands in for the GPU."""
    handed = []
    real_broadcast = dist.broadcast

    def recording_broadcast(tensor, src=None, group=None, **options):
        if group is None or group is dist.group.WORLD:
            handed.append((tensor.device.type, src))
        return real_broadcast(tensor, src, group=group, **options)

    monkeypatch.setattr(dist, "broadcast", recording_broadcast)
    model = _lenet()
    tensors = len([*model.parameters(), *model.buffers()])
    for rank in (0, 1):
        with fake_rank(rank, 2):
            _pipeline("meta").prepare_model(_lenet())
        # Every parameter and buffer, from rank 0, on the device.
        assert handed == [("meta", 0)] * tensors, f"rank {rank}"
        handed.clear()


def test_the_best_weights_gather_every_stage_on_rank_0_only(monkeypatch):
    """2 stages x 2 replicas: the stages' weights travel on the host to rank 0
    alone (gathered on every rank, they put the whole model on every GPU) and
    make there the whole model's weights, complete and in its order."""
    side_group = object()  # stands for the gloo group of the host-side checks
    monkeypatch.setattr(collectives, "_CONTROL", side_group)
    sent, receives = {}, {}

    def gather_object(obj, object_gather_list=None, dst=None, group=None, **_):
        rank = dist.get_rank()
        assert group is side_group and dst == 0, (group, dst)
        sent[rank], receives[rank] = obj, object_gather_list is not None
        if object_gather_list is not None:
            object_gather_list[:] = [sent[r] for r in range(len(object_gather_list))]

    def all_gather_object(object_list, obj, group=None):
        rank = dist.get_rank()
        sent[rank], receives[rank] = obj, True
        object_list[:] = [sent.get(r, {}) for r in range(len(object_list))]

    monkeypatch.setattr(dist, "gather_object", gather_object)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    saved = {}
    for rank in (3, 2, 1, 0):  # rank 0 last: the others' pieces are sent then
        with fake_rank(rank, 4):
            strategy = _pipeline("cpu")
            stage = strategy.prepare_model(_lenet())
            saved[rank] = strategy.model_state_dict(stage)
    assert receives == {0: True, 1: False, 2: False, 3: False}
    assert sent[2] == {} and sent[3] == {}  # the second pipeline's copy stays
    assert sent[0].keys().isdisjoint(sent[1])
    assert saved[1] == saved[2] == saved[3] == {}
    whole = _lenet().state_dict()
    assert list(saved[0]) == list(whole)
    for key, value in whole.items():
        assert saved[0][key].device.type == "cpu", key
        torch.testing.assert_close(saved[0][key], value, rtol=0, atol=0)
