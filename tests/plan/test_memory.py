"""The planner's memory per rank against real gloo ranks: ddp, fsdp and a
two-stage pipeline predicted with fake tensors in this process, then trained
for three steps by two real processes (one spawn for all three) while
MemTracker counts what each rank holds."""

from __future__ import annotations

import dataclasses

import pytest

from distribuuuu.bench.plan_accuracy import (
    Workload,
    case,
    describe,
    measure_peaks,
    tolerance,
)
from distribuuuu.plan.memory import MemoryModel

# resnet8 on 16-pixel images with AdamW and an EMA: small enough to train
# three steps in seconds, with BatchNorm, residual blocks and a chain to cut.
WORKLOAD = Workload(arch="resnet8", image_size=16, ema=True)
CASES = [
    case("ddp", 2, 16),
    case("fsdp", 2, 16),
    case("pipeline", 2, 16, pipeline_stages=2, pipeline_schedule="1f1b"),
]


@pytest.fixture(scope="module")
def memory() -> MemoryModel:
    """The planner's memory model of the workload (its traces kept)."""
    return MemoryModel(WORKLOAD.trace_spec())


@pytest.mark.slow
@pytest.mark.distributed
def test_predicted_peaks_are_within_the_tolerance_of_real_ranks(memory):
    """ddp and fsdp within 5% of the measured peak, the pipeline within 10%."""
    measured = measure_peaks(2, WORKLOAD, CASES)
    for candidate, real in zip(CASES, measured):
        assert not isinstance(real, str), f"{describe(candidate)} failed: {real}"
        predicted = memory.estimate(candidate).peak_mib
        error = predicted / real - 1
        assert abs(error) <= tolerance(candidate), (
            f"{describe(candidate)}: predicted {predicted:.2f} MiB, measured "
            f"{real:.2f} MiB ({error:+.1%})"
        )


def test_the_parts_of_an_estimate_add_up_to_its_peak(memory):
    """What the start-up table shows beside the peak: the parts a rank
    holds, which sum to it, and sharding moves each part as FSDP does (half
    the optimizer state and EMA on two ranks, the same activations)."""
    ddp, fsdp = (memory.estimate(candidate) for candidate in CASES[:2])
    for estimate in (ddp, fsdp):
        parts = dataclasses.asdict(estimate)
        held = sum(
            v for k, v in parts.items() if k.endswith("_mib") and k != "peak_mib"
        )
        assert estimate.peak_mib == pytest.approx(held)
    assert fsdp.optimizer_mib == pytest.approx(ddp.optimizer_mib / 2, rel=0.05)
    assert fsdp.ema_mib < 0.6 * ddp.ema_mib
    assert fsdp.activations_mib == pytest.approx(ddp.activations_mib)
