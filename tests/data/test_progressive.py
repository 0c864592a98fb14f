"""TRAIN.PROGRESSIVE: the training crop of each epoch (FFCV's ramp), in every
decoder's batches, with loader workers, in the logs, and after a kill."""

from __future__ import annotations

import contextlib
import io
import os
import re
import time

import numpy as np
import pytest
import torch
from helpers import (
    assert_ok,
    final_model,
    import_tool,
    kill_session,
    launch_command,
    read_metrics,
    read_text,
    slow_fsync_env,
    start,
    train_net,
)
from PIL import Image

from distribuuuu.config import load_cfg
from distribuuuu.data import build_dataset, build_normalizer, build_train_loader
from distribuuuu.data.spec import SizeRamp
from distribuuuu.engine.specs import data_spec, loader_spec, size_ramp
from distribuuuu.errors import ConfigError

# --- the schedule ------------------------------------------------------------


def _ffcv(epoch: int, low: int, high: int, first: int, last: int) -> int:
    """ffcv-imagenet's get_resolution, restated (its rounding: to 32)."""
    if epoch <= first:
        return low
    if epoch >= last:
        return high
    return int(np.round(np.interp([epoch], [first, last], [low, high])[0] / 32)) * 32


def test_the_ramp_is_ffcvs_schedule():
    """FFCV's ResNet-50 16-epoch ramp (160 -> 192 over epochs 11-13), a long
    ramp whose steps round half to even, as np.round does, and ramps that
    start later."""
    assert SizeRamp(160, 192, 11, 13, 32).sizes(16) == [160] * 12 + [192] * 4
    for low, high, first, last in [
        (160, 224, 0, 9),
        (128, 256, 3, 40),
        (96, 192, 2, 7),
    ]:
        ramp = SizeRamp(low, high, first, last, 32)
        expected = [_ffcv(epoch, low, high, first, last) for epoch in range(45)]
        assert ramp.sizes(45) == expected
    assert SizeRamp(160, 224, 0, 9, 32).sizes(10) == [160] * 3 + [192] * 4 + [224] * 3


def test_rounding_is_clamped_and_the_epochs_edges_hold():
    """A size rounded to the multiple stays within [start, end] (FFCV's would
    leave it); START_EPOCH is the last epoch of the start size, END_EPOCH the
    first of the end size, and MULTIPLE 1 grows a pixel at a time."""
    assert SizeRamp(100, 120, 0, 4, 64).size(1) == 120  # 105 rounds to 128
    assert SizeRamp(70, 90, 0, 4, 64).size(1) == 70  # 75 rounds to 64
    assert SizeRamp(16, 32, 2, 4, 8).sizes(7) == [16, 16, 16, 24, 32, 32, 32]
    assert SizeRamp(20, 23, 0, 3, 1).sizes(4) == [20, 21, 22, 23]


def _cfg(*keys: str):
    base = "MODEL.ARCH resnet8 DATA.NAME synthetic DATA.SYNTHETIC_SIZE [64,16] "
    base += "TRAIN.IM_SIZE 32 TEST.IM_SIZE 32 OPTIM.MAX_EPOCH 3 TRAIN.BATCH_SIZE 8 "
    base += "TRAIN.PROGRESSIVE.START_SIZE 16 TRAIN.PROGRESSIVE.MULTIPLE 8"
    return load_cfg(None, [*base.split(), *keys])


def test_the_config_resolves_end_size_and_end_epoch_and_refuses_a_shrinking_ramp():
    ramp = size_ramp(_cfg())
    assert ramp == SizeRamp(16, 32, 0, 2, 8)
    assert size_ramp(_cfg("TRAIN.PROGRESSIVE.START_SIZE", "0")) is None
    with pytest.raises(ConfigError, match="TRAIN.PROGRESSIVE.START_SIZE"):
        _cfg("TRAIN.PROGRESSIVE.END_SIZE", "12")
    with pytest.raises(ConfigError, match="TRAIN.PROGRESSIVE.END_EPOCH"):
        _cfg("TRAIN.PROGRESSIVE.END_EPOCH", "3")


# --- the loaders' batches ----------------------------------------------------


def _sizes_by_epoch(cfg, epochs: int, first_batches: int = 0) -> list[set]:
    """The image sizes of each epoch's batches (decoded on the CPU for
    DATA.DECODER gpu); with ``first_batches``, epoch 0 is left after that
    many batches, its prefetched batches still in the workers."""
    spec = data_spec(cfg)
    loader = build_train_loader(
        loader_spec(cfg),
        build_dataset(spec, train=True),
        rank=0,
        world_size=1,
        seed=1,
        device=torch.device("cpu"),
        batch_size=cfg.TRAIN.BATCH_SIZE,
    )
    to_pixels = build_normalizer(spec, torch.device("cpu"))
    seen = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        sizes = set()
        for number, (images, _) in enumerate(loader):
            sizes.add(tuple(to_pixels(images).shape[1:]))
            if epoch == 0 and number + 1 == first_batches:
                break
        seen.append(sizes)
    return seen


def _expected(*sizes: int) -> list[set]:
    return [{(3, size, size)} for size in sizes]


def test_persistent_workers_serve_each_epochs_size_after_a_prefetched_epoch():
    """A persistent worker (started once) takes each epoch's size, also when
    the previous epoch was left with batches prefetched."""
    cfg = _cfg("TRAIN.WORKERS", "1")
    assert _sizes_by_epoch(cfg, 3, first_batches=1) == _expected(16, 24, 32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two classes of 4 JPEGs (80-110 px) as an ImageFolder, and as shards."""
    root = tmp_path_factory.mktemp("progressive")
    for split in ("train", "val"):
        for label in range(2):
            (root / "folder" / split / str(label)).mkdir(parents=True)
            for i in range(4):
                pixels = torch.randint(0, 255, (80 + 10 * i, 110 - 9 * i, 3))
                image = Image.fromarray(pixels.to(torch.uint8).numpy())
                image.save(root / "folder" / split / str(label) / f"{i}.jpg")
    with contextlib.redirect_stdout(io.StringIO()):
        make_shards = import_tool("make_shards").main
        assert make_shards([str(root / "folder"), str(root / "shards")]) == 0
    return root


@pytest.mark.parametrize("decoder", ["fused", "tensor", "pil", "gpu", "webdataset"])
def test_every_decoder_crops_each_epochs_size(folder, decoder):
    """Image files through each DATA.DECODER (gpu: the crop on the device, here
    the CPU) and WebDataset shards take the epoch's size."""
    keys = ["DATA.NAME", "imagefolder", "DATA.DECODER", decoder]
    train = test = str(folder / "folder")
    if decoder == "webdataset":
        keys = ["DATA.NAME", "webdataset", "DATA.DECODER", "tensor"]
        train = str(folder / "shards" / "train-000000.tar")
        test = str(folder / "shards" / "val-000000.tar")
    cfg = _cfg(*keys, "TRAIN.DATASET", train, "TEST.DATASET", test)
    cfg.defrost()
    cfg.MODEL.NUM_CLASSES, cfg.TRAIN.BATCH_SIZE = 2, 4
    assert _sizes_by_epoch(cfg, 3) == _expected(16, 24, 32)


# --- a run: its log, and a kill mid-ramp -------------------------------------

# 3 epochs of 6 steps of 8 images at 16, 24 and 32 px (MULTIPLE 8), a
# checkpoint every 3 steps (global: epoch 2 has one after its step 3).
RAMP_RUN = ["MODEL.ARCH", "resnet8", "DATA.NAME", "synthetic"]
RAMP_RUN += ["DATA.SYNTHETIC_SIZE", "[48,16]", "TRAIN.BATCH_SIZE", "8"]
RAMP_RUN += ["TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "OPTIM.MAX_EPOCH", "3"]
RAMP_RUN += ["TRAIN.PROGRESSIVE.START_SIZE", "16", "TRAIN.PROGRESSIVE.MULTIPLE", "8"]
RAMP_RUN += ["TRAIN.PRINT_FREQ", "3", "CHECKPOINT.PERIOD_ITERS", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("reference"))
    assert_ok(train_net(*RAMP_RUN, "OUT_DIR", out))
    return out


@pytest.mark.slow
def test_a_run_logs_and_records_each_epochs_crop(reference):
    log = read_text(reference, "log.txt")
    logged = re.findall(r"train ep (\d)/3: crop (\d+) px", log)
    assert logged == [("1", "16"), ("2", "24"), ("3", "32")]
    recorded = {(r["epoch"], r["im_size"]) for r in read_metrics(reference, "train")}
    assert recorded == {(1, 16), (2, 24), (3, 32)}


def _names_mid_epoch_2(last: str) -> bool:
    """Whether the file ``last`` names the checkpoint after epoch 2's step 3."""
    try:
        return read_text(last).startswith("ckpt_ep_0001_it_0003")
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_run_killed_mid_ramp_then_rerun_is_bitwise_identical(reference, tmp_path):
    """SIGKILL in epoch 2 (24 px), after its checkpoint mid-epoch: the rerun
    resumes there and ends bitwise where the uninterrupted run ends."""
    killed = str(tmp_path / "killed")
    args = [*RAMP_RUN, "OUT_DIR", killed]
    # Killed once `last` names epoch 2's checkpoint mid-epoch; every fsync of
    # the killed run takes 0.5 s, so its next checkpoint cannot be complete.
    proc = start(launch_command(1, args), slow_fsync_env(str(tmp_path / "slow")))
    last = os.path.join(killed, "checkpoints", "last")
    try:
        while proc.poll() is None and not _names_mid_epoch_2(last):
            time.sleep(0.02)
    finally:
        kill_session(proc)
    assert _names_mid_epoch_2(last)
    assert not os.path.exists(os.path.join(killed, "checkpoints", "ckpt_ep_0002.pth"))
    rerun = train_net(*args)
    assert_ok(rerun)
    resumed = rerun.stdout.split("resumed from ", 1)[1].split()[0]
    assert os.path.basename(resumed).startswith("ckpt_ep_0001_it_0003")
    assert re.findall(r"train ep (\d)/3: crop (\d+) px", rerun.stdout) == [
        ("2", "24"),
        ("3", "32"),
    ]
    expected, actual = final_model(reference), final_model(killed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} is not bitwise equal"
