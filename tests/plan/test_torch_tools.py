"""Canaries of the torch tools the planner relies on, private ones among them:
each fails naming the tool when a torch release changes what the planner
reads of it (MemTracker's categories and internals, the fake process group,
FlopCounterMode's counts)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distribuuuu.plan.tracing import PeakTracker, fake_tensors, fake_world

MIB = 2**20


@contextlib.contextmanager
def names(tool: str):
    """Fail naming ``tool`` and this torch when the block raises."""
    try:
        yield
    except Exception as error:  # a changed private API fails in any way
        pytest.fail(
            f"{tool} changed in torch {torch.__version__}: {type(error).__name__}: "
            f"{error} (distribuuuu.plan.tracing relies on it)"
        )


def _step(tracker: PeakTracker, model: nn.Module, batch: int) -> tuple[int, ...]:
    """Two steps and a backward; what ``tracker`` counts held at the end."""
    optimizer = torch.optim.AdamW(model.parameters())
    tracker.track_external(model, optimizer)
    with tracker:
        tracker.restart(recording=True)
        for _ in range(2):  # the second step holds the first's optimizer state
            images = torch.ones(batch, 256)
            model(images).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        model(images).sum().backward()  # the root called again
    return tracker.current()


def test_mem_tracker_counts_a_fake_step_by_category():
    """After two AdamW steps and a backward, a 256 x 256 linear layer's
    parameters, gradients and AdamW's two states are 0.25 MiB each, in their
    categories, and its input and output were 1 MiB of activations each, on
    fake tensors;
    the tracker without module hooks counts the same peak."""
    with names("torch.distributed._tools.mem_tracker.MemTracker"), fake_tensors():
        tracker = PeakTracker()
        held = _step(tracker, nn.Linear(256, 256, bias=False), batch=1024)
        parameters, gradients, optimizer = (x / MIB for x in held[:3])
        activations = max(point[3] for point in tracker.points) / MIB
        bare = PeakTracker(modules=False)
        _step(bare, nn.Linear(256, 256, bias=False), batch=1024)
        total, bare_total = (
            max(sum(point) for point in t.points) / MIB for t in (tracker, bare)
        )
    assert parameters == pytest.approx(0.25)
    assert gradients == pytest.approx(0.25)
    assert optimizer == pytest.approx(0.5, abs=0.01)  # and AdamW's step counts
    assert activations == pytest.approx(2.0, abs=0.01)  # 1024 x 256 in and out
    assert bare_total == pytest.approx(total)


def test_the_fake_process_group_plays_one_rank_of_a_world():
    """Rank 1 of 4 in this one process: the world answers as four, and a
    collective returns at once, its tensor's shape kept."""
    with names("torch.testing._internal.distributed.fake_pg"), fake_world(4, 1):
        rank, world = dist.get_rank(), dist.get_world_size()
        shards = [torch.empty(3) for _ in range(world)]
        dist.all_gather(shards, torch.ones(3))
        total = torch.ones(5)
        dist.all_reduce(total)
    assert (rank, world) == (1, 4)
    assert [s.shape for s in shards] == [torch.Size([3])] * 4
    assert total.shape == torch.Size([5])
    assert not dist.is_initialized()


def test_flop_counter_counts_products_on_the_meta_device():
    """A (64 x 128) @ (128 x 32) product is 2 x 64 x 128 x 32 FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    with names("torch.utils.flop_counter.FlopCounterMode"):
        a = torch.empty(64, 128, device="meta")
        b = torch.empty(128, 32, device="meta")
        with FlopCounterMode(display=False) as counter:
            torch.mm(a, b)
        flops = counter.get_total_flops()
    assert flops == 2 * 64 * 128 * 32
