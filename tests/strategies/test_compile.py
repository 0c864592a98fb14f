"""MODEL.COMPILE: torch.compile in place, checkpoints without compiler
prefixes, the same accuracy as eager, under DDP too."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_ok, read_metrics, refused, torchrun, train_net

RUN = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1", "RNG_SEED", "3"]


def _best(out: str) -> dict:
    return torch.load(os.path.join(out, "best.pth"), weights_only=True)["model"]


# Two epochs whose training crop grows once (TRAIN.PROGRESSIVE): 20 then 28 px.
GROWING = ["OPTIM.MAX_EPOCH", "2", "TRAIN.PROGRESSIVE.START_SIZE", "20"]


@pytest.mark.slow
def test_compiled_training_reaches_the_eager_accuracy(tmp_path):
    """Also when the crop grows: the compiled model takes the new size (one
    more compilation, not dynamo's fall back to eager)."""
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    assert_ok(train_net(*RUN, *GROWING, "OUT_DIR", eager))
    keys = [*GROWING, "MODEL.COMPILE", "True", "OUT_DIR", compiled]
    result = train_net(*RUN, *keys)
    assert_ok(result)
    assert "MODEL.COMPILE: torch.compile" in result.stdout
    assert "crop 20 px" in result.stdout and "crop 28 px" in result.stdout
    assert "recompile_limit" not in result.stdout + result.stderr
    (_, a), (_, b) = read_metrics(eager, "val"), read_metrics(compiled, "val")
    assert abs(a["top1"] - b["top1"]) <= 0.3
    assert _best(compiled).keys() == _best(eager).keys()  # no _orig_mod.


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_ddp_and_fsdp_train_and_save_plain_keys(tmp_path, strategy):
    out = str(tmp_path)
    keys = ["MODEL.COMPILE", "True", "DIST.STRATEGY", strategy]
    assert_ok(torchrun(2, *RUN, *keys, "OUT_DIR", out))
    assert read_metrics(out, "val")[-1]["samples"] == 1000
    assert not any("_orig_mod" in key for key in _best(out))


def test_compile_is_refused_where_the_model_is_not_one_module(tmp_path):
    line = refused(
        str(tmp_path / "out"), "MODEL.COMPILE", "True", "DIST.STRATEGY", "dp"
    )
    assert "MODEL.COMPILE True is invalid: is supported with DIST.STRATEGY ddp" in line


@pytest.mark.slow
def test_compile_in_place_compiles_the_forward_and_keeps_the_keys(monkeypatch):
    """Dynamo captures the forward; its graphs go to dynamo's eager backend
    here (what inductor makes of them, the runs above show), and the setting
    compile_in_place changes is put back after the test."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from distribuuuu.models import build_model
    from distribuuuu.strategies.chain import compile_in_place

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module,
        "compile",
        lambda self, **options: compile_module(self, backend="eager", **options),
    )
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", False)
    model = build_model("lenet5", 10)
    keys = list(model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_in_place(model, "default")
    model(torch.randn(2, 3, 28, 28))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured the forward
    assert list(model.state_dict()) == keys


def test_each_training_crop_may_compile_once_more():
    """A canary of dynamo's recompile_limit, a private setting: a long
    TRAIN.PROGRESSIVE ramp raises it by its number of sizes, so that none of
    them falls back to eager when torch renames or drops it."""
    import torch._dynamo

    from distribuuuu.strategies.chain import allow_recompiles

    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        allow_recompiles(20)
        assert config.recompile_limit >= 8 + 19
    finally:
        config.recompile_limit = before
