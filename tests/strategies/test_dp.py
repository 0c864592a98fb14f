"""DIST.STRATEGY dp: DataParallel keeps the model on the GPU chosen for the
process, and that GPU stays current (fakes of torch.cuda and DataParallel:
DataParallel runs on CUDA only, and there is no GPU here)."""

from __future__ import annotations

import pytest
import torch
from fake_devices import FakeCuda, GpuShyLinear

from distribuuuu.config import get_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.strategies import dp


def _prepare(monkeypatch, gpus: int, index: int, makes_current=None):
    """The dp strategy on cuda:``index`` of ``gpus`` prepares a model; the
    model, and what DataParallel was given.  ``makes_current``: a GPU the fake
    DataParallel makes current on the way, as a library gone astray would."""
    FakeCuda(gpus, current=index).install(monkeypatch)
    given = {}

    def data_parallel(module, device_ids=None, output_device=None):
        given.update(module=module, device_ids=device_ids, output_device=output_device)
        if makes_current is not None:
            torch.cuda.set_device(makes_current)
        return module

    monkeypatch.setattr(dp, "AutocastDataParallel", data_parallel)
    cfg = get_cfg()
    cfg.DIST.STRATEGY = "dp"
    model = GpuShyLinear()
    spec = strategy_spec(cfg, torch.device("cuda", index))
    dp.DataParallelStrategy(spec).prepare_model(model)
    return model, given


def test_dataparallel_leads_with_the_gpu_the_model_is_on(monkeypatch):
    """The module lives on DataParallel's first device and the outputs are
    gathered there: it is the process's GPU, cuda:1 of 3, not cuda:0."""
    model, given = _prepare(monkeypatch, gpus=3, index=1)
    assert model.moved_to == torch.device("cuda", 1) and given["module"] is model
    assert given["device_ids"] == [1, 0, 2] and given["output_device"] == 1
    assert torch.cuda.current_device() == 1


def test_a_gpu_dataparallel_makes_current_other_than_ours_is_an_error(monkeypatch):
    with pytest.raises(RuntimeError) as caught:
        _prepare(monkeypatch, gpus=2, index=1, makes_current=0)
    assert "DataParallel made cuda:0 the current device" in str(caught.value)
    assert "not cuda:1, the one chosen for it" in str(caught.value)


def test_the_usual_gpu_0_keeps_dataparallels_order():
    assert dp.gpus_from(torch.device("cuda", 0), 3) == [0, 1, 2]
