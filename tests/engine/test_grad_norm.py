"""The global gradient norm logged at print steps: clip_grad_norm_'s value
under every strategy, measured at print steps only, in metrics.jsonl and
tensorboard, and the spike warning."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, assert_ok, call_main, read_metrics, torchrun, train_net
from tensorboard.backend.event_processing import event_accumulator
from torch import nn

from distribuuuu.reporting.meters import GradSpikeWatch
from distribuuuu.strategies import base, gradients

# One step of a global batch of 64 (LeNet-5, no BatchNorm: the same gradient
# however the batch is split), its norm logged.
ONE_STEP = [*TINY, "DATA.SYNTHETIC_SIZE", "[64,101]", "TRAIN.PRINT_FREQ", "1"]
# OPTIM.CLIP_GRAD_NORM on but never reached: the norm is clip_grad_norm_'s.
CLIPPED = ("OPTIM.CLIP_GRAD_NORM", "1e9")
VIT = ("MODEL.ARCH", "vit_tiny_patch4", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8")


def _norm(out_dir: str) -> float:
    (record,) = read_metrics(out_dir, "train")
    return record["grad_norm"]


def test_the_norm_is_clip_grad_norms_over_tensors_of_several_meshes():
    """Plain gradients: ``gradient_norm`` is what ``clip_gradients`` (torch's
    clip_grad_norm_) returns, without clipping."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    model(torch.randn(6, 5)).square().sum().backward()
    params = list(model.parameters())
    measured = gradients.gradient_norm(params)
    grads = [p.grad.clone() for p in params]
    assert torch.equal(measured, gradients.clip_gradients(params, 1e9))
    expected = torch.nn.utils.clip_grad_norm_(params, 1e9)
    assert torch.equal(measured, expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))


@pytest.mark.distributed
@pytest.mark.slow
def test_every_strategy_logs_the_norm_clip_grad_norm_gives_one_process(tmp_path):
    """The first step's norm on 2 ranks, each strategy measuring it its own
    way (DDP's reduced gradients, FSDP's and tensor parallelism's DTensors,
    the pipeline's stages, DeepSpeed's ZeRO), equals to 1e-6 the norm that
    ``clip_grad_norm_`` returns for the same batch in one process."""
    runs = {
        "lenet5": (1, [*CLIPPED, "TRAIN.BATCH_SIZE", "64"]),
        "vit": (1, [*VIT, *CLIPPED, "TRAIN.BATCH_SIZE", "64"]),
        "ddp": (2, []),
        "zero1": (2, ["DIST.STRATEGY", "zero1"]),
        "fsdp": (2, ["DIST.STRATEGY", "fsdp"]),
        "pipeline": (2, ["DIST.STRATEGY", "pipeline", "TRAIN.BATCH_SIZE", "64"]),
        "tensor": (2, [*VIT, "DIST.TENSOR_PARALLEL", "2", "TRAIN.BATCH_SIZE", "64"]),
    }
    try:
        import deepspeed  # noqa: F401

        runs["deepspeed"] = (2, ["DIST.STRATEGY", "deepspeed"])
    except ImportError:
        pass
    norms = {}
    for name, (nproc, keys) in runs.items():
        out = str(tmp_path / name)
        args = [*ONE_STEP, *keys, "OUT_DIR", out]
        assert_ok(torchrun(nproc, *args) if nproc > 1 else train_net(*args))
        norms[name] = _norm(out)
    assert norms["lenet5"] > 0 and norms["vit"] > 0
    for name, norm in norms.items():
        reference = norms["vit" if name in ("vit", "tensor") else "lenet5"]
        assert norm == pytest.approx(reference, rel=1e-6, abs=0), (name, norms)


def test_the_norm_is_measured_at_print_steps_only_and_logged(tmp_path, monkeypatch):
    """8 steps printing every 3rd (and the last): three measurements, no
    work (no host sync, no collective) on the other steps; grad_norm in
    metrics.jsonl and tensorboard."""
    measured = []
    gradient_norm = base.gradient_norm

    def counted(params):
        measured.append(len(params))
        return gradient_norm(params)

    monkeypatch.setattr(base, "gradient_norm", counted)
    out = tmp_path / "out"
    result = call_main(*TINY, "TRAIN.PRINT_FREQ", "3", "OUT_DIR", str(out))
    assert result.returncode == 0, result.stderr
    train = read_metrics(str(out), "train")
    assert [r["iter"] for r in train] == [3, 6, 8] and len(measured) == 3
    assert all(r["grad_norm"] > 0 for r in train)
    events = event_accumulator.EventAccumulator(str(out / "tb"))
    events.Reload()
    shown = [event.value for event in events.Scalars("train/grad_norm")]
    assert shown == pytest.approx([r["grad_norm"] for r in train])


def test_a_spike_past_the_median_is_told_once():
    watch = GradSpikeWatch(warmup=3)
    assert [watch.update(norm, 10.0) for norm in (1.0, 2.0, 1.5, 14.0)] == [None] * 4
    assert watch.update(20.0, 10.0) == 1.75  # past 10 x the median of 1, 2, 1.5, 14
    assert watch.update(1e6, 10.0) is None  # once
    off = GradSpikeWatch(warmup=1)
    assert [off.update(norm, 0.0) for norm in (1.0, 1e9)] == [None, None]
    assert GradSpikeWatch(warmup=1).update(float("nan"), 10.0) is None
