"""TRAIN.MICRO_BATCH auto: the probe's split, restored exactly; a step out of
memory mid-run ends its job with one line and leaves the next split for the
rerun; what cannot be probed is refused.

On a CPU running out of memory is a SIGKILL, not an exception: the runs here
raise ``torch.OutOfMemoryError`` from a backward hook instead, on one rank,
above a batch size (:data:`OOM_WRAPPER`, a script the test writes that
patches the trainer's model builder and then runs tools/train_net.py).
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
import yaml
from helpers import (
    TINY,
    TRAIN_NET,
    assert_ok,
    final_model,
    read_text,
    refused,
    run_python,
    strategy_for,
    torchrun,
    torchrun_argv,
)
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.engine import micro_batch
from distribuuuu.engine.micro_batch import (
    TRIED_STEPS,
    MicroBatchFit,
    MicroBatchSpec,
    adopt_record,
    read_record,
    smaller_split,
    step_out_of_memory,
    write_record,
)
from distribuuuu.engine.state import BatchPlan
from distribuuuu.errors import NoMicroBatchFitsError

# Rank RANK's model raises torch.OutOfMemoryError in the backward of a batch
# larger than ABOVE, once it ran AFTER training forward passes (the probe runs
# TRIED_STEPS per micro-batch it tries).  Test code only: the package has no
# such hook.
OOM_WRAPPER = """\
import os, runpy, sys
import torch
from distribuuuu.engine import trainer

RANK, ABOVE, AFTER = {rank}, {above}, {after}
build = trainer.build_configured


def out_of_memory(grad):
    raise torch.OutOfMemoryError("injected by the test: out of memory")


def build_configured(spec):
    model = build(spec)
    passes = [0]

    def watch(module, inputs, output):
        if torch.is_grad_enabled() and output.requires_grad:
            passes[0] += 1
            if output.shape[0] > ABOVE and passes[0] > AFTER:
                output.register_hook(out_of_memory)  # late in the backward

    if int(os.environ.get("RANK", "0")) == RANK:
        next(model.children()).register_forward_hook(watch)
    return model


trainer.build_configured = build_configured
sys.argv = [{train_net!r}, *sys.argv[1:]]
runpy.run_path({train_net!r}, run_name="__main__")
"""

# helpers.TINY's one epoch of synthetic images, 128 of them at 16 px, with
# resnet8 (BatchNorm); each test sets TRAIN.BATCH_SIZE.
RUN = [*TINY, "MODEL.ARCH", "resnet8", "DATA.SYNTHETIC_SIZE", "[128,40]"]
RUN += ["TRAIN.IM_SIZE", "16", "TRAIN.PRINT_FREQ", "4"]


def oom_wrapper(tmp_path, rank: int, above: int, after: int = 0) -> str:
    """The script that runs tools/train_net.py with the failing hook."""
    path = tmp_path / f"oom_rank{rank}_above{above}_after{after}.py"
    text = OOM_WRAPPER.format(rank=rank, above=above, after=after, train_net=TRAIN_NET)
    path.write_text(text)
    return str(path)


def torchrun_script(script: str, *args: str):
    return run_python(torchrun_argv(2, list(args), script=script), timeout=300)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def run_config(out: str) -> dict:
    return yaml.safe_load(read_text(out, "config.yaml"))


# --------------------------------------------------------------------------- #
# The split: halving rounds up and keeps each process's samples per step
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "split, expected",
    [
        ((16, 1), (8, 2)),
        ((6, 1), (3, 2)),  # 3 x 2 keeps 6
        ((3, 2), (2, 3)),  # half of 3, rounded up, divides 6
        ((5, 1), (1, 5)),  # neither 3 nor 2 divides 5
        ((7, 2), (2, 7)),  # neither 4 nor 3 divides 14
        ((1, 8), None),
    ],
)
def test_the_next_split_keeps_the_samples_per_step(split, expected):
    assert smaller_split(*split) == expected
    if expected:
        assert expected[0] * expected[1] == split[0] * split[1]


# --------------------------------------------------------------------------- #
# The probe, in this process: what it tried is undone bit for bit
# --------------------------------------------------------------------------- #
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        x = self.drop(torch.relu(self.norm(self.conv(x))))
        return self.head(x.flatten(1))


def _fails_above(model: nn.Module, above: int) -> None:
    def out_of_memory(grad):
        raise torch.OutOfMemoryError("injected by the test")

    def watch(module, inputs, output):
        if torch.is_grad_enabled() and output.shape[0] > above:
            output.register_hook(out_of_memory)

    model.conv.register_forward_hook(watch)


def _everything(model: nn.Module, optimizer) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "momentum": [s["momentum_buffer"].clone() for s in optimizer.state.values()],
        "lr": [group["lr"] for group in optimizer.param_groups],
        "training": [m.training for m in model.modules()],
        "grads": [p.grad for p in model.parameters()],
        "draws": (torch.rand(3), random.random(), np.random.rand()),
    }


def _assert_same(before: dict, after: dict) -> None:
    for key in before["model"]:
        assert torch.equal(before["model"][key], after["model"][key]), key
    assert len(before["momentum"]) == len(after["momentum"])
    for old, new in zip(before["momentum"], after["momentum"]):
        assert torch.equal(old, new)
    assert before["lr"] == after["lr"] and before["training"] == after["training"]
    assert all(grad is None for grad in after["grads"])
    assert torch.equal(before["draws"][0], after["draws"][0])
    assert before["draws"][1:] == after["draws"][1:]


@pytest.mark.parametrize("above", [4, 0])
def test_the_probe_restores_weights_statistics_optimizer_and_rng(above):
    torch.manual_seed(0)
    model, strategy = Small(), strategy_for("ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 3, 8, 8)).sum().backward()  # a step before: momentum
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.norm.eval()  # a flag the probe's train() must not keep
    _fails_above(model, above)
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    before = _everything(model, optimizer)
    torch.set_rng_state(state[0]), random.setstate(state[1])
    np.random.set_state(state[2])
    spec = MicroBatchSpec(image_size=8, num_classes=10, out_dir="/nonexistent")
    fit = MicroBatchFit(spec, strategy, model, optimizer)
    asked = BatchPlan(16, 1, 1)
    if above:
        assert fit.plan(asked, None, "global") == BatchPlan(4, 4, 1)
    else:
        with pytest.raises(NoMicroBatchFitsError, match="16 on rank 0; 8 on"):
            fit.plan(asked, None, "global")
    _assert_same(before, _everything(model, optimizer))


def test_a_resumed_run_keeps_its_checkpoints_split_without_probing(tmp_path):
    spec = MicroBatchSpec(image_size=8, num_classes=10, out_dir=str(tmp_path))
    fit = MicroBatchFit(spec, None, None, None)  # nothing to probe with
    saved = BatchPlan(4, 4, 2, 0.5)
    assert fit.plan(BatchPlan(16, 1, 2), saved, "global") == saved
    # On one process the global batch stays: 8 x 4, not the asked 16 x 1.
    assert fit.plan(BatchPlan(16, 1, 1), saved, "global") == BatchPlan(8, 4, 1, 0.5)
    write_record(str(tmp_path), 2, 8)
    assert fit.plan(BatchPlan(16, 1, 2), saved, "global") == BatchPlan(2, 8, 2, 0.5)


# --------------------------------------------------------------------------- #
# The record a step out of memory leaves: written atomically, read as untrusted
# --------------------------------------------------------------------------- #
def test_a_step_out_of_memory_records_the_next_split(tmp_path):
    error = step_out_of_memory(BatchPlan(6, 2, 4), str(tmp_path))
    assert "rank 0 ran out of device memory" in str(error)
    assert "records 3 x 4" in str(error)
    assert read_record(str(tmp_path)) == (3, 4)
    adopted = adopt_record(BatchPlan(6, 2, 4, 0.5), str(tmp_path))
    assert adopted == BatchPlan(3, 4, 4, 0.5)
    # Another run's samples per step, or a larger split: kept as planned.
    assert adopt_record(BatchPlan(8, 1, 4), str(tmp_path)) == BatchPlan(8, 1, 4)
    assert adopt_record(BatchPlan(2, 6, 4), str(tmp_path)) == BatchPlan(2, 6, 4)
    at_one = step_out_of_memory(BatchPlan(1, 4, 1), str(tmp_path / "other"))
    assert "a micro-batch of 1 is the smallest" in str(at_one)
    assert not os.path.exists(tmp_path / "other")
    off = step_out_of_memory(BatchPlan(6, 2, 4), "")
    assert "set TRAIN.MICRO_BATCH auto" in str(off)


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        b'{"batch_per_rank": true, "accum": 2}',
        b'{"batch_per_rank": 0, "accum": 2}',
        b'{"batch_per_rank": 2.0, "accum": 2}',
        b"[" * 4000,
        b'{"batch_per_rank": 1, "accum": 2, "pad": "' + b"x" * 5000 + b'"}',
    ],
)
def test_an_unusable_record_is_ignored(tmp_path, content):
    (tmp_path / micro_batch.RECORD).write_bytes(content)
    plan = BatchPlan(2, 1, 1)
    assert adopt_record(plan, str(tmp_path)) == plan


def test_a_record_that_is_a_link_or_a_fifo_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"batch_per_rank": 1, "accum": 2}))
    os.symlink(target, tmp_path / micro_batch.RECORD)
    with pytest.raises(OSError):
        read_record(str(tmp_path))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / micro_batch.RECORD)
    with pytest.raises(ValueError, match="not a regular file"):
        read_record(str(fifo))  # and it did not wait for a writer
    assert adopt_record(BatchPlan(2, 1, 1), str(tmp_path)) == BatchPlan(2, 1, 1)
    write_record(str(tmp_path / "new"), 1, 2)
    assert read_record(str(tmp_path / "new")) == (1, 2)


# --------------------------------------------------------------------------- #
# Refused before anything is written (exit 2)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "keys, words",
    [
        (["TRAIN.MICRO_BATCH", "4"], "choose one of"),
        (["DIST.STRATEGY", "fsdp"], "not supported with DIST.STRATEGY fsdp"),
        (["DIST.STRATEGY", "hsdp"], "not supported with DIST.STRATEGY hsdp"),
        (["DIST.STRATEGY", "zero1"], "not supported with DIST.STRATEGY zero1"),
        (["DIST.STRATEGY", "dp"], "not supported with DIST.STRATEGY dp"),
        (["DIST.STRATEGY", "pipeline"], "not supported with DIST.STRATEGY pipeline"),
        (["DIST.STRATEGY", "deepspeed"], "not supported with DIST.STRATEGY deepspeed"),
        (
            ["DIST.TENSOR_PARALLEL", "2", "MODEL.ARCH", "vit_tiny_patch4"],
            "not supported with DIST.TENSOR_PARALLEL",
        ),
        (["MODEL.SYNCBN", "True"], "MODEL.SYNCBN"),
        (["DIST.STRATEGY", "auto"], "DIST.STRATEGY auto"),
    ],
)
def test_what_cannot_be_probed_is_refused(tmp_path, keys, words):
    line = refused(str(tmp_path / "out"), "TRAIN.MICRO_BATCH", "auto", *keys)
    assert "TRAIN.MICRO_BATCH" in line and words in line


# --------------------------------------------------------------------------- #
# Real runs: 2 gloo ranks under torchrun, rank 1 out of memory
# --------------------------------------------------------------------------- #
@pytest.mark.slow
def test_a_probed_run_is_bitwise_a_run_started_with_its_split(tmp_path):
    auto, direct = str(tmp_path / "auto"), str(tmp_path / "direct")
    script = oom_wrapper(tmp_path, rank=1, above=4)
    args = [*RUN, "TRAIN.BATCH_SIZE", "16", "TRAIN.MICRO_BATCH", "auto"]
    probed = torchrun_script(script, *args, "OUT_DIR", auto)
    assert_ok(probed)
    assert "out of memory at a micro-batch of 16 on rank 1; 8 on rank 1; 4 x 4" in (
        probed.stdout
    )
    train = run_config(auto)["TRAIN"]
    assert (train["BATCH_SIZE"], train["ACCUM_STEPS"]) == (4, 4)
    split = ["TRAIN.BATCH_SIZE", "4", "TRAIN.ACCUM_STEPS", "4"]
    assert_ok(torchrun(2, *RUN, *split, "OUT_DIR", direct))
    expected, actual = final_model(direct), final_model(auto)
    assert expected.keys() == actual.keys()
    for key in expected:  # BatchNorm's running statistics and counts included
        assert torch.equal(expected[key], actual[key]), key


@pytest.mark.slow
def test_a_step_out_of_memory_mid_run_ends_the_job_and_the_rerun_adopts_a_split(
    tmp_path,
):
    out = str(tmp_path / "out")
    # The probe (TRIED_STEPS forwards) and 4 steps pass; the 5th runs out.
    script = oom_wrapper(tmp_path, rank=1, above=4, after=TRIED_STEPS + 4)
    args = [*RUN, "TRAIN.BATCH_SIZE", "8", "TRAIN.MICRO_BATCH", "auto"]
    args += ["CHECKPOINT.PERIOD_ITERS", "2", "CHECKPOINT.KEEP", "0", "OUT_DIR", out]
    failed = torchrun_script(script, *args)
    assert failed.returncode == 1, failed.stderr[-3000:]
    # One line from rank 1.  Rank 0, waiting for it, usually ends at
    # torchrun's SIGTERM without a word; if its watchdog reads rank 1's
    # failure from the store first, it says so in its own one line.
    lines, where = error_lines(failed), failed.stderr[-3000:]
    ran_out = [line for line in lines if line.startswith("error: rank 1 ran out")]
    assert len(ran_out) == 1, where
    assert "of device memory in a training step" in ran_out[0]
    assert "at a micro-batch of 8 x 1 accumulation steps" in ran_out[0]
    assert "records 4 x 2" in ran_out[0]
    others = [line for line in lines if line not in ran_out]
    assert len(others) <= 1, where
    assert all(
        line.startswith("error: rank 0 stopped: rank 1 failed") for line in others
    )
    # The last checkpoint is the one before, whole (its checksums verified).
    found = cp.find_resume_checkpoint(out, checksums=True)
    assert found is not None and found[0].endswith("ckpt_ep_0000_it_0004.pth")
    assert (found[1]["batch_per_rank"], found[1]["accum"]) == (8, 1)
    assert read_record(out) == (4, 2)
    rerun = torchrun_script(script, *args)
    assert_ok(rerun)
    assert "resumed from" in rerun.stdout and "micro_batch.json records" in (
        rerun.stdout
    )
    train = run_config(out)["TRAIN"]
    assert (train["BATCH_SIZE"], train["ACCUM_STEPS"]) == (4, 2)
    last = cp.find_resume_checkpoint(out, checksums=True)
    assert last is not None and last[0].endswith("ckpt_ep_0001.pth")
    assert (last[1]["batch_per_rank"], last[1]["accum"]) == (4, 2)


@pytest.mark.slow
def test_when_a_micro_batch_of_1_runs_out_of_memory_the_run_fails_clearly(tmp_path):
    # In the probe: nothing fits.
    probed = str(tmp_path / "probed")
    always = oom_wrapper(tmp_path, rank=0, above=0)
    args = [*RUN, "TRAIN.MICRO_BATCH", "auto", "CHECKPOINT.PERIOD_ITERS", "2"]
    result = run_python([always, *args, "TRAIN.BATCH_SIZE", "4", "OUT_DIR", probed])
    assert result.returncode == 1, result.stderr[-3000:]
    assert error_lines(result) == [
        "error: TRAIN.MICRO_BATCH auto: every micro-batch ran out of memory (4 on "
        "rank 0; 2 on rank 0; 1 on rank 0): the model does not fit the device"
    ]
    assert cp.list_checkpoints(probed) == []
    # Mid-run, after a checkpoint: the probe and 2 steps of 1 image pass.
    later = oom_wrapper(tmp_path, rank=0, above=0, after=TRIED_STEPS + 2)
    out = str(tmp_path / "out")
    result = run_python([later, *args, "TRAIN.BATCH_SIZE", "1", "OUT_DIR", out])
    assert result.returncode == 1, result.stderr[-3000:]
    lines = error_lines(result)
    assert len(lines) == 1 and "a micro-batch of 1 is the smallest" in lines[0]
    found = cp.find_resume_checkpoint(out, checksums=True)
    assert found is not None and found[0].endswith("ckpt_ep_0000_it_0002.pth")
    assert read_record(out) is None
