"""The step profiler (TRAIN.PROFILE_STEPS): each rank's trace is Chrome /
Perfetto JSON holding the profiled steps' operators, the log has the top
operators and the data-wait share; one profile per launch, none by default."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import TINY, assert_ok, read_text, refused, torchrun, train_net
from torch.profiler import ProfilerActivity

from distribuuuu.config import load_cfg
from distribuuuu.engine.profiling import (
    DATA_LABEL,
    STEP_LABEL,
    plan_steps,
    profiler_activities,
    trace_path,
)
from distribuuuu.engine.trainer import train_model
from distribuuuu.logger import setup_logging

# TINY with 512 training images: 8 steps on each of 2 processes, room for
# 1 skipped + 1 warm-up + 5 profiled steps.
TINY_512 = [*TINY, "DATA.SYNTHETIC_SIZE", "[512,101]"]
TABLE = "top 15 operators by self CPU time:"


def read_trace(out_dir: str, rank: int) -> list[dict]:
    """The events of rank ``rank``'s trace, checked to be trace-event JSON."""
    with open(trace_path(out_dir, rank), encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    assert all({"ph", "ts", "name"} <= event.keys() for event in events)
    return events


def spans(events: list[dict], name: str) -> list[tuple[float, float]]:
    """(start, end) in microseconds of the complete events called ``name``."""
    return [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"] == name and e["ph"] == "X"
    ]


def within(inner: tuple[float, float], outers: list[tuple[float, float]]) -> bool:
    return any(start <= inner[0] and inner[1] <= end for start, end in outers)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """A 2-process DDP run of TINY_512 profiling 5 steps; its OUT_DIR and output."""
    out = str(tmp_path_factory.mktemp("ddp"))
    result = torchrun(2, *TINY_512, "TRAIN.PROFILE_STEPS", "5", "OUT_DIR", out)
    assert_ok(result)
    return out, result.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_writes_a_trace_of_the_profiled_steps(ddp_run):
    out, _ = ddp_run
    assert sorted(os.listdir(os.path.join(out, "profile"))) == [
        "rank0.pt.trace.json",
        "rank1.pt.trace.json",
    ]
    for rank in (0, 1):
        events = read_trace(out, rank)
        steps = spans(events, STEP_LABEL)
        assert len(steps) == 5
        convolutions = spans(events, "aten::convolution")
        # LeNet-5's two convolutions in each profiled step's forward
        assert len(convolutions) == 10
        assert all(within(conv, steps) for conv in convolutions)
        waits = spans(events, DATA_LABEL)
        assert len(waits) == 5 and all(within(wait, steps) for wait in waits)
        assert any(e["name"].startswith("ProfilerStep#") for e in events)


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_logs_its_top_operators_and_data_wait(ddp_run):
    out, stdout = ddp_run
    for log in (stdout, read_text(out, "log.txt"), read_text(out, "log_rank1.txt")):
        assert log.count(TABLE) == 1
        table = log.split(TABLE)[1]
        assert "Self CPU %" in table and "aten::" in table
        assert "profiled 5 step(s)" in log
        assert "waiting for data" in log and "% of the step time" in log
        assert "steps left" not in log
    assert "rank1.pt.trace.json" in read_text(out, "log_rank1.txt")


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_profiles_what_a_short_epoch_has_with_one_warning(tmp_path):
    # TINY: 4 steps on each of 2 processes, fewer than 1 + 1 + 5.
    out = str(tmp_path)
    args = ("DIST.STRATEGY", "fsdp", "TRAIN.PROFILE_STEPS", "5", "OUT_DIR", out)
    result = torchrun(2, *TINY, *args)
    assert_ok(result)
    for rank in (0, 1):
        assert len(spans(read_trace(out, rank), STEP_LABEL)) == 4
    warnings = [line for line in result.stdout.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "4 steps left" in warnings[0], result.stdout
    assert TABLE in result.stdout


# Four steps of 16 images an epoch, trained in this process.
SMALL = ["MODEL.ARCH", "lenet5", "MODEL.DUMMY_INPUT", "True"]
SMALL += ["DATA.SYNTHETIC_SIZE", "[64,8]", "TRAIN.BATCH_SIZE", "16"]


def _train_in_process(out_dir: str, *opts: str) -> None:
    try:
        train_model(load_cfg(None, [*SMALL, "OUT_DIR", out_dir, *opts]))
    finally:
        setup_logging(None, 1)  # close the log file, leave no handler behind


def test_off_by_default_and_once_per_launch_when_resumed(tmp_path):
    out = str(tmp_path)
    _train_in_process(out, "OPTIM.MAX_EPOCH", "1")
    assert not os.path.exists(os.path.join(out, "profile"))
    assert "profil" not in read_text(out, "log.txt")
    # A resumed launch profiles its first epoch (the run's second) only.
    _train_in_process(out, "OPTIM.MAX_EPOCH", "3", "TRAIN.PROFILE_STEPS", "2")
    assert read_text(out, "log.txt").count("profiled 2 step(s)") == 1
    assert len(spans(read_trace(out, 0), STEP_LABEL)) == 2


@pytest.mark.parametrize("value", ["-1", "2.5", "many"])
def test_a_bad_value_is_refused(tmp_path, value):
    error = refused(str(tmp_path / "out"), *TINY, "TRAIN.PROFILE_STEPS", value)
    assert "TRAIN.PROFILE_STEPS" in error


def test_a_short_epoch_keeps_the_profiled_steps_first():
    assert plan_steps(5, 100) == (1, 1, 5)
    assert plan_steps(5, 6) == (0, 1, 5)
    assert plan_steps(5, 4) == (0, 0, 4)


def test_cuda_kernels_are_recorded_on_a_cuda_device_only():
    cpu, cuda = ProfilerActivity.CPU, ProfilerActivity.CUDA
    assert profiler_activities(torch.device("cpu")) == [cpu]
    assert profiler_activities(torch.device("cuda", 1)) == [cpu, cuda]


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_run_logs_the_top_operators_by_cuda_time(tmp_path):
    out = str(tmp_path)
    args = ("DEVICE", "cuda", "TRAIN.PROFILE_STEPS", "3", "OUT_DIR", out)
    result = train_net(*TINY, *args)
    assert_ok(result)
    table = result.stdout.split("top 15 operators by self CUDA time:")[1]
    assert "Self CUDA" in table
    events = read_trace(out, 0)
    assert len(spans(events, STEP_LABEL)) == 3
    assert any(e.get("cat") == "kernel" for e in events)
