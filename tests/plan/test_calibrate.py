"""Calibration: measuring this machine leaves the model as it was, and the
figures on paper come from the flags and the datasheet, or a clear error."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from distribuuuu.models import build_model
from distribuuuu.plan.calibrate import (
    DeviceSpeed,
    calibrate,
    measure_model_speed,
    paper_calibration,
)
from distribuuuu.plan.flops import count_flops
from distribuuuu.plan.sharding_costs import measure_sharded_unit_s
from distribuuuu.plan.tracing import fake_world


def test_calibrating_leaves_the_model_as_it_was():
    """BatchNorm's running statistics, the gradients and the RNG are those
    of before: a run that calibrates trains as one that does not."""
    torch.manual_seed(0)
    model = build_model("resnet8", 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    flops = count_flops(functools.partial(build_model, "resnet8", 10), 28)
    measured = calibrate(
        model,
        flops,
        image_size=28,
        device=torch.device("cpu"),
        procs_per_node=1,
        batch=8,
    )
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    # The figures are this machine's (and its load's): only their sense holds.
    assert measured.source == "measured" and measured.efficiency > 0
    assert measured.flops_per_s > 0 and measured.optimizer_s > 0
    assert measured.inter.bytes_per_s == float("inf")  # one process: no link


def test_a_gpu_on_paper_takes_its_datasheet_and_the_flags():
    paper = paper_calibration(
        "NVIDIA H100",
        nodes=2,
        procs_per_node=8,
        inter_gbps=400,
        latency_us=10,
        amp_dtype=torch.bfloat16,
    )
    assert paper.peak_flops == pytest.approx(989.5e12)  # dense bf16
    assert paper.intra.bytes_per_s == pytest.approx(450e9)  # NVLink, one way
    assert paper.inter.bytes_per_s == pytest.approx(50e9)  # 400 Gbit/s
    assert paper.inter.latency_s == pytest.approx(10e-6)
    assert paper.host.bytes_per_s == pytest.approx(64e9)  # PCIe Gen5, one way
    cluster = paper.cluster(2, 8)
    assert cluster.overlap and cluster.world == 16
    assert paper.source == "paper" and 0 < paper.efficiency < 1


def test_paper_refuses_what_it_cannot_know():
    with pytest.raises(ValueError, match="--inter-gbps"):
        paper_calibration("A100", nodes=2, procs_per_node=8)
    with pytest.raises(ValueError, match="--intra-gbps"):
        paper_calibration("cpu", nodes=1, procs_per_node=2)
    with pytest.raises(ValueError, match="'NVIDIA A10G': not in the planner's"):
        paper_calibration("NVIDIA A10G", nodes=1, procs_per_node=1)
    one = paper_calibration("cpu", nodes=2, procs_per_node=1, inter_gbps=0.1)
    assert one.inter.bytes_per_s == pytest.approx(12.5e6) and one.peak_flops > 0


def test_a_cpu_on_paper_runs_as_fast_as_this_one_was_measured():
    """``tools/plan.py --device cpu`` plans with this CPU's own speed on the
    model where it measured it, not an assumed share of its peak."""
    speed = DeviceSpeed(
        peak_flops=50e9, efficiency=0.6, overhead_s=0.01, optimizer_s=0.02
    )
    paper = paper_calibration(
        "cpu", nodes=2, procs_per_node=1, inter_gbps=1, speed=speed
    )
    cluster = paper.cluster(2, 1)
    assert cluster.flops_per_s == pytest.approx(30e9)
    assert (cluster.overhead_s, paper.optimizer_s) == (0.01, 0.02)
    assert not cluster.overlap and cluster.host is None


class _Sized(nn.Module):
    """A linear model that records the batches it sees and, like a device
    that holds no more, runs out of memory above ``most`` images."""

    def __init__(self, most: int):
        super().__init__()
        self.layer, self.most, self.seen = nn.Linear(48, 10), most, []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(images))
        if len(images) > self.most:
            raise torch.OutOfMemoryError("out of memory (a test's device)")
        return self.layer(images.flatten(1))


@pytest.mark.parametrize("most, largest", [(64, 32), (8, 6)])
def test_the_speed_is_measured_up_to_the_run_s_batch_where_memory_holds_it(
    most, largest
):
    """The line ends at the run's micro-batch (32), where the time an image
    takes is the run's; a device without memory for it ends it at 6."""
    model = _Sized(most)
    flops_per_s, overhead = measure_model_speed(
        model, 1e6, image_size=4, device=torch.device("cpu"), batch=32
    )
    assert flops_per_s > 0 and overhead >= 0
    assert max(b for b in model.seen if b <= most) == largest
    assert all(p.grad is None for p in model.parameters())


def test_fsdp_s_machinery_is_timed_without_a_draw_from_the_rng():
    """Over a world of 2 (the fake process group: collectives return at
    once), FSDP's passes cost more than the plain copy's, which is FSDP's
    own work; the probe's layers take their weights without moving the
    caller's RNG.  Without a process group there is nothing to time."""
    assert measure_sharded_unit_s(torch.device("cpu"), 16) == 0.0
    rng = torch.get_rng_state()
    with fake_world(2, 0):
        per_unit = measure_sharded_unit_s(torch.device("cpu"), 16)
    assert per_unit > 0
    assert torch.equal(torch.get_rng_state(), rng)
