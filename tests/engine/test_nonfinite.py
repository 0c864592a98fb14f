"""A run whose loss or weights turn NaN or inf stops with exit 1 and one
``error:`` line, and never saves the non-finite weights nor makes them best."""

from __future__ import annotations

import contextlib
import glob
import math
import os
from pathlib import Path

import pytest
import torch
from helpers import TINY, assert_ok, read_text, run_on_ranks, torchrun, train_net
from test_hostile import assert_one_error_line, run_hostile
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distribuuuu import checkpoint as cp
from distribuuuu.config import load_cfg
from distribuuuu.engine import trainer
from distribuuuu.engine.best import keep_best
from distribuuuu.engine.numerics import all_finite
from distribuuuu.engine.resume import save_training_checkpoint
from distribuuuu.engine.run_log import stop_on_nonfinite_loss
from distribuuuu.engine.session import run_context
from distribuuuu.engine.specs import log_spec, save_spec
from distribuuuu.errors import NonFiniteError
from distribuuuu.models import build_model
from distribuuuu.reporting.writer import MetricsWriter

# A learning rate so high that the first step sends the weights to ~1e30 and
# the second step's loss to nan (LeNet-5, synthetic data, seed 1: every time).
BLOW_UP = ["OPTIM.BASE_LR", "1e30"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _poison(tensor: torch.Tensor, value: float = math.nan) -> None:
    """Put ``value`` into the first element of ``tensor`` (of any layout)."""
    with torch.no_grad():
        tensor[(0,) * tensor.dim()] = value


def _assert_everything_saved_is_finite(out: str) -> list[str]:
    """Every checkpoint and best weights in ``out`` hold finite values; their
    file names."""
    paths = glob.glob(os.path.join(out, "checkpoints", "ckpt_*.pth"))
    paths += glob.glob(os.path.join(out, "best*.pth"))
    for path in paths:
        state = cp.load_full(path)
        tensors = [*state["model"].values(), *state.get("ema", {}).values()]
        assert _finite(tensors), f"{path} holds nan or inf"
    return sorted(os.path.basename(path) for path in paths)


# --------------------------------------------------------------------------- #
# The check itself
# --------------------------------------------------------------------------- #


def test_all_finite_checks_parameters_and_floating_buffers():
    model = build_model("resnet8", 10)  # BatchNorm: running statistics too
    tensors = [*model.parameters(), *model.buffers()]
    assert all_finite(tensors) and all_finite([])
    assert all_finite([torch.tensor([1, 2], dtype=torch.int64)])  # counters
    weight = next(model.parameters())
    _poison(weight)
    assert not all_finite(tensors)
    _poison(weight, 0.0)
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    _poison(bn.running_var, math.inf)
    assert not all_finite(tensors)
    _poison(bn.running_var, -math.inf)
    assert not all_finite([bn.running_var])


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors of ``value``: a tensor, or lists and tuples holding some."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    return []


def _map_tensors(value, change):
    """``value`` with ``change`` applied to each of its tensors."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, change) for item in value)
    return value


class _FakeGpuTensor(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` as its device and, like CUDA's
    kernels for ``stack`` and ``cat``, refuses any operation that also takes a
    tensor of another device: FSDP's CPU offload on a machine without a GPU
    (the buffers here, the parameter shards on the CPU)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=torch.device("cuda", 0)
        )

    def __init__(self, data: torch.Tensor):
        self.data_on_cpu = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors_in([*args, *kwargs.values()])
        devices = sorted({str(tensor.device) for tensor in tensors})
        if len(devices) > 1:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at "
                f"least two devices, {' and '.join(devices)}! ({func})"
            )

        def unwrap(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.data_on_cpu if isinstance(tensor, cls) else tensor

        args = _map_tensors(args, unwrap)
        kwargs = {key: _map_tensors(value, unwrap) for key, value in kwargs.items()}
        return _map_tensors(func(*args, **kwargs), cls)


def _fake_gpu(tensor: torch.Tensor) -> torch.Tensor:
    return _FakeGpuTensor(tensor.clone())


def _real_gpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.device("cuda"))


@pytest.mark.parametrize(
    "to_gpu",
    [
        _fake_gpu,
        pytest.param(_real_gpu, marks=[pytest.mark.cuda, needs_cuda]),
    ],
)
def test_all_finite_checks_tensors_on_two_devices(to_gpu):
    """Under FSDP's CPU offload a BatchNorm model's parameter shards are on the
    CPU and its buffers on the GPU: the check takes both and finds a NaN or
    an inf on either."""
    model = build_model("resnet8", 10)
    parameters = list(model.parameters())
    buffers = [to_gpu(buffer) for buffer in model.buffers()]
    assert {buffer.device.type for buffer in buffers} == {"cuda"}
    with pytest.raises(RuntimeError, match="same device"):  # as CUDA refuses
        torch.stack([parameters[0].sum(), buffers[0].sum()])
    assert all_finite([*parameters, *buffers])
    statistic = next(buffer for buffer in buffers if buffer.is_floating_point())
    statistic = getattr(statistic, "data_on_cpu", statistic)  # the fake: its values
    _poison(statistic, math.inf)
    assert not all_finite([*parameters, *buffers])
    _poison(statistic, 1.0)
    assert all_finite([*parameters, *buffers])
    _poison(parameters[0])
    assert not all_finite([*parameters, *buffers])


def _check_shards(rank: int, world: int) -> tuple[bool, bool]:
    """all_finite of an FSDP-sharded model, before and after rank 1 alone puts
    a NaN in its shard."""
    model = nn.Linear(8, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    before = all_finite(model.parameters())
    if rank == 1:
        with torch.no_grad():
            model.weight.to_local()[0, 0] = math.nan
    return before, all_finite(model.parameters())


@pytest.mark.distributed
@pytest.mark.slow
def test_all_finite_agrees_over_ranks_when_one_shard_is_nan(tmp_path):
    results = run_on_ranks(2, _check_shards, (), str(tmp_path))
    assert results == [(True, False), (True, False)]


# --------------------------------------------------------------------------- #
# The trainer's checks, on a real run state built in this process
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def _run_state(out: Path, *extra: str):
    """The log and save specs and the TrainState of a TINY run into ``out``
    (nothing trained)."""
    cfg = load_cfg(None, [*TINY, *extra, "OUT_DIR", str(out)])
    with run_context(cfg) as (info, device):
        writer = MetricsWriter(cfg.OUT_DIR, enabled=False)
        run, _, _ = trainer.build_train_state(cfg, info, device, writer)
        yield log_spec(cfg), save_spec(cfg), run


def _eval_stats(top1: float) -> tuple[dict, torch.Tensor]:
    stats = {"loss": 1.0, "top1": top1, "topk": 90.0, "samples": 101}
    return stats, torch.zeros(10, 10, dtype=torch.int64)


def test_nonfinite_weights_never_count_as_best(tmp_path):
    best = tmp_path / cp.BEST_WEIGHTS
    with _run_state(tmp_path) as (log, save, run):
        run.progress.epoch = 1
        keep_best(log, save, run, *_eval_stats(50.0))
        saved = best.read_bytes()  # finite weights: the best so far
        _poison(next(run.model.parameters()))
        run.progress.epoch = 2
        with pytest.raises(NonFiniteError, match="weights evaluated after epoch 2"):
            keep_best(log, save, run, *_eval_stats(60.0))
        assert run.progress.best_top1 == 50.0
        assert best.read_bytes() == saved
        with pytest.raises(NonFiniteError, match="by the end of epoch 2"):
            save_training_checkpoint(save, run, cp.CheckpointWriter(str(tmp_path)))
    assert not (tmp_path / cp.CHECKPOINT_DIR).exists()


def test_a_nonfinite_ema_is_neither_best_nor_saved(tmp_path):
    with _run_state(tmp_path, "MODEL.EMA", "True") as (log, save, run):
        run.progress.epoch, run.progress.consumed = 0, 64  # after 2 steps
        _poison(next(iter(run.ema.tensors().values())), math.inf)
        assert all_finite(run.model.parameters())  # the raw weights are fine
        with pytest.raises(NonFiniteError, match="by epoch 1, iteration 2"):
            save_training_checkpoint(save, run, cp.CheckpointWriter(str(tmp_path)))
        run.progress.epoch = 1
        with run.ema.swapped_in(), pytest.raises(NonFiniteError, match="EMA"):
            keep_best(log, save, run, *_eval_stats(50.0), ema=True)
        assert run.progress.best_ema_top1 == -1.0
    assert not (tmp_path / cp.BEST_EMA_WEIGHTS).exists()
    assert not (tmp_path / cp.CHECKPOINT_DIR).exists()


def test_with_a_grad_scaler_a_nonfinite_loss_is_fatal_only_with_nonfinite_weights(
    tmp_path,
):
    # fp16 loss scaling (CUDA only in a run; a CPU GradScaler behaves alike):
    # a step with overflowing gradients is skipped and the weights stay finite.
    with _run_state(tmp_path) as (_, _, run):
        run.scaler = torch.amp.GradScaler("cpu")
        window = {"loss": math.inf, "samples": 64}  # 2 steps of 32
        stop_on_nonfinite_loss(run, window, step=3)  # a warning, no error
        assert "GradScaler skipped those steps" in read_text(tmp_path, "log.txt")
        _poison(next(run.model.parameters()))
        match = r"became inf at epoch 1, iteration 4 \(or earlier, from iteration 3\)"
        with pytest.raises(NonFiniteError, match=match):
            stop_on_nonfinite_loss(run, window, step=3)


# --------------------------------------------------------------------------- #
# Real runs
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_a_loss_that_blows_up_stops_the_run_before_anything_is_saved(tmp_path):
    out = str(tmp_path / "out")
    result = train_net(*TINY, *BLOW_UP, "OUT_DIR", out, timeout=120)
    words = ["the training loss became nan at epoch 1, iteration 2", "OPTIM.BASE_LR"]
    assert_one_error_line(result, 1, words)
    assert _assert_everything_saved_is_finite(out) == []  # no best.pth either
    log = read_text(out, "log.txt")
    assert "Traceback" in log and "NonFiniteError" in log


@pytest.mark.slow
def test_a_resumed_run_that_blows_up_keeps_its_checkpoint_and_best(tmp_path):
    out = tmp_path / "out"
    assert_ok(train_net(*TINY, "OUT_DIR", str(out), timeout=120))
    again = [*TINY, "OPTIM.MAX_EPOCH", "2", *BLOW_UP]
    run_hostile(out, again, 1, ["loss became nan at epoch 2, iteration 2"])
    saved = _assert_everything_saved_is_finite(str(out))
    assert saved == ["best.pth", "ckpt_ep_0001.pth"]


@pytest.mark.slow
def test_nonfinite_weights_are_not_written_as_a_periodic_checkpoint(tmp_path):
    # No print step before the end of the epoch: the save catches the weights.
    out = str(tmp_path / "out")
    args = [*TINY, *BLOW_UP, "TRAIN.PRINT_FREQ", "100"]
    args += ["CHECKPOINT.PERIOD_ITERS", "1", "CHECKPOINT.KEEP", "0"]
    result = train_net(*args, "OUT_DIR", out, timeout=120)
    assert_one_error_line(
        result, 1, ["weights became nan or inf by epoch 1, iteration 2"]
    )
    assert _assert_everything_saved_is_finite(out) == ["ckpt_ep_0000_it_0001.pth"]
    assert read_text(out, "checkpoints", "last").strip() == "ckpt_ep_0000_it_0001.pth"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "extra", "words"),
    [
        ("ddp", [], "the training loss became nan at epoch 1, iteration 2"),
        (
            "fsdp",  # each rank checks its own shards before the save
            ["TRAIN.PRINT_FREQ", "100", "CHECKPOINT.PERIOD_ITERS", "1"],
            "weights became nan or inf by epoch 1, iteration 2",
        ),
    ],
)
def test_two_ranks_stop_together_with_one_error_line(tmp_path, strategy, extra, words):
    out = str(tmp_path / "out")
    args = [*TINY, *BLOW_UP, "DIST.STRATEGY", strategy, *extra, "OUT_DIR", out]
    result = torchrun(2, *args, timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    # torchrun adds its own report of the failed workers; ours is one line.
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and errors[0].startswith("error: ")
    assert words in errors[0]
    assert "NonFiniteError" not in result.stderr
    assert "distribuuuu" not in result.stderr
    assert "best.pth" not in _assert_everything_saved_is_finite(out)
