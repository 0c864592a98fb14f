"""TRAIN.MIXED_PRECISION auto: what it resolves to on each kind of device (the
CUDA branch through a faked capability query), and that a CPU run saves the
resolved value."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from helpers import TINY, assert_ok, read_text, train_net

from distribuuuu.config import load_cfg
from distribuuuu.engine.session import run_context
from distribuuuu.engine.specs import run_precision, strategy_spec
from distribuuuu.strategies.chain import takes_fp16
from distribuuuu.strategies.precision import (
    auto_precision,
    resolve_auto_precision,
    resolve_precision,
)

GPU = torch.device("cuda", 1)


def capability_of(major: int, minor: int = 0):
    """A capability query answering (major, minor), recording what it was asked."""
    asked = []

    def query(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return major, minor

    query.asked = asked
    return query


@pytest.mark.parametrize(
    "capability, allowed, expected",
    [
        ((9, 0), True, "bf16"),  # H100
        ((8, 0), True, "bf16"),  # A100: the first with native bf16
        ((8, 6), False, "bf16"),  # bf16 whatever the strategy
        ((7, 5), True, "fp16"),  # T4
        ((7, 0), True, "fp16"),  # V100
        ((7, 0), False, "none"),  # a strategy refusing fp16 gets full precision
    ],
)
def test_auto_on_cuda_follows_the_device_capability(capability, allowed, expected):
    query = capability_of(*capability)
    assert auto_precision(GPU, allowed, query) == expected
    assert query.asked == [GPU]  # the run's own device, not the current one


def test_auto_is_full_precision_on_cpu_without_asking_cuda():
    def no_cuda(device):
        raise AssertionError("CUDA queried for a CPU run")

    assert auto_precision(torch.device("cpu"), True, no_cuda) == "none"


@pytest.mark.parametrize(
    "keys, allowed",
    [
        ([], True),
        (["DIST.STRATEGY", "zero1"], True),
        (["DIST.STRATEGY", "fsdp"], False),
        (["DIST.STRATEGY", "pipeline"], False),
        (["DIST.TENSOR_PARALLEL", "2", "MODEL.ARCH", "vit_tiny_patch4"], False),
    ],
)
def test_fp16_is_offered_only_to_strategies_that_take_it(keys, allowed):
    assert takes_fp16(strategy_spec(load_cfg(None, keys))) is allowed


def test_explicit_values_are_kept_and_auto_must_be_resolved():
    cfg = load_cfg(None, ["TRAIN.MIXED_PRECISION", "bf16"])
    requested = cfg.TRAIN.MIXED_PRECISION
    resolved = resolve_auto_precision(requested, torch.device("cpu"), True)
    assert resolved == "bf16" and cfg.is_frozen()
    with pytest.raises(ValueError, match="auto must be resolved"):
        resolve_precision("auto", torch.device("cpu"))


def test_auto_is_the_default_and_resolves_to_none_on_cpu():
    cfg = load_cfg(None, ["DEVICE", "cpu"])
    assert cfg.TRAIN.MIXED_PRECISION == "auto"
    with run_context(cfg, log_files=False) as (_, device):
        assert device.type == "cpu"
        assert run_precision(cfg, device) == "none" and cfg.is_frozen()


@pytest.mark.slow
def test_a_cpu_run_saves_and_logs_the_resolved_precision(tmp_path):
    out_dir = str(tmp_path)
    assert_ok(train_net(*TINY, "OUT_DIR", out_dir))
    with open(os.path.join(out_dir, "config.yaml"), encoding="utf-8") as f:
        assert yaml.safe_load(f)["TRAIN"]["MIXED_PRECISION"] == "none"
    assert "TRAIN.MIXED_PRECISION auto on cpu: none" in read_text(out_dir, "log.txt")
