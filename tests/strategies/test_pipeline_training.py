"""DIST.STRATEGY pipeline: real gloo pipelines train like one process (every
schedule, two pipelines side by side, accumulation, clipping and the EMA) and
their checkpoints go on on other layouts (the stages themselves:
test_pipeline.py)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import (
    assert_ok,
    read_metrics,
    read_text,
    run_launched,
    torchrun,
    train_net,
)

from distribuuuu import checkpoint as cp

# One epoch of LeNet-5 (no BatchNorm) on 1,024 synthetic images (16 steps of
# 64), validated on 1,000: these tests compare weights, not what was learnt
# (the embedded digits took seconds to load in each process, and 63 steps).
LENET = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "20"]
LENET += ["DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", "[1024,1000]"]
PIPELINE = ["DIST.STRATEGY", "pipeline"]
# Runs compared weight by weight: at a gentle learning rate, one process on one
# thread as each torchrun rank is. At LR 0.1 LeNet's first epoch is chaotic:
# the float noise of summing micro-batches (or of 1 against 2 threads) grows
# to 3e-3 in the weights on an AVX2 CPU (1e-5 on an AVX-512 one); at 0.02 two
# stages end 1.5e-8 from one process (on the digits and on LENET's images).
GENTLE = [*LENET, "OPTIM.BASE_LR", "0.02"]
# A resumed run on another layout, after a second epoch: 5.4e-5 measured on an
# AVX2 CPU on the digits (the micro-batches of 4 stages against one process),
# 1.5e-8 on LENET's images; entries read into the wrong layers would be off by
# 1e-1.
ATOL_RESUMED = 2e-4
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _final_weights(out_dir: str) -> dict:
    name = read_text(out_dir, "checkpoints", "last").strip()
    return cp.load_full(os.path.join(out_dir, "checkpoints", name))["model"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """LeNet-5 trained one epoch by one process, global batches 64 and 128."""
    runs = {}
    for batch in (64, 128):
        out = str(tmp_path_factory.mktemp(f"one{batch}"))
        args = [*GENTLE, "TRAIN.BATCH_SIZE", str(batch), "OUT_DIR", out]
        assert_ok(train_net(*args, env=ONE_THREAD))
        runs[batch] = out
    return runs


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """The OUT_DIR of GENTLE on 2 stages under a schedule (each run once; the
    resume test goes on from a copy of the default schedule's, 1f1b)."""
    runs: dict[str, str] = {}

    def run(schedule: str) -> str:
        if schedule not in runs:
            out = str(tmp_path_factory.mktemp(schedule))
            args = [*GENTLE, *PIPELINE, "DIST.PIPELINE.SCHEDULE", schedule]
            assert_ok(torchrun(2, *args, "OUT_DIR", out))
            runs[schedule] = out
        return runs[schedule]

    return run


def _assert_same_run(out: str, reference: str, atol: float) -> None:
    expected, actual = _final_weights(reference), _final_weights(out)
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=atol)
    # The best weights, the stages gathered on rank 0: the whole model's.
    best = cp.load_file(os.path.join(out, cp.BEST_WEIGHTS))["model"]
    expected = cp.load_file(os.path.join(reference, cp.BEST_WEIGHTS))["model"]
    assert list(best) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(best[key], value, rtol=1e-5, atol=atol)
    (val,) = read_metrics(out, "val")
    assert val["samples"] == 1000  # every validation image counted once


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_two_stages_train_like_one_process(two_stages, one_process, schedule):
    """Micro-batch losses summed in another order leave float32 noise only."""
    _assert_same_run(two_stages(schedule), one_process[64], atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_pipelines_of_two_stages_train_like_one_process(tmp_path, one_process):
    """4 ranks: 2 stages x 2 data-parallel replicas of 64 images each."""
    result = torchrun(4, *GENTLE, *PIPELINE, "OUT_DIR", str(tmp_path))
    assert_ok(result)
    assert "64 per replica x 1 accumulation step(s) x 2 replica(s)" in result.stdout
    _assert_same_run(str(tmp_path), one_process[128], atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_other_layouts(
    tmp_path, two_stages, one_process
):
    """Two stages save their pieces; the run goes on on four stages (each rank
    reads its own layers' entries) and on one process (read whole): alike."""
    first = two_stages("1f1b")  # copied, not changed
    on = {"four_stages": ["DIST.PIPELINE.STAGES", "4"], "one_process": []}
    for name, layout in on.items():
        out = str(tmp_path / name)
        shutil.copytree(first, out)
        args = [*GENTLE, "OPTIM.MAX_EPOCH", "2", *layout, "OUT_DIR", out]
        if layout:
            result = torchrun(4, *args, *PIPELINE)
        else:
            result = train_net(*args, env=ONE_THREAD)
        assert_ok(result)
        assert "resumed from" in result.stdout
    expected = _final_weights(str(tmp_path / "one_process"))
    actual = _final_weights(str(tmp_path / "four_stages"))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-4, atol=ATOL_RESUMED)
    # And back: one process's whole checkpoint (optimizer state by index) goes
    # on on two stages, each taking its parameters' entries.  The checkpoint is
    # the one-process run's first epoch, which ends where the two stages' ends
    # (1.5e-8: test_two_stages_train_like_one_process), so the run that went on
    # from the latter on one process above is the one to match (a launch less
    # than a one-process rerun of its own).
    two_more = str(tmp_path / "two_more")
    shutil.copytree(one_process[64], two_more)
    args = [*GENTLE, "OPTIM.MAX_EPOCH", "2", *PIPELINE, "OUT_DIR", two_more]
    two = torchrun(2, *args)
    assert_ok(two)
    assert f"resumed from {two_more}" in two.stdout
    actual = _final_weights(two_more)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-4, atol=ATOL_RESUMED)


@pytest.mark.distributed
@pytest.mark.slow
def test_accumulation_clipping_and_ema_under_a_pipeline(tmp_path):
    """Gradient accumulation, clipping by the norm over both stages and the
    EMA give the weights (and EMA) one process gets; bf16 and --eval-only run."""
    more = [
        *GENTLE,
        "TRAIN.BATCH_SIZE",
        "32",
        "TRAIN.ACCUM_STEPS",
        "2",
        "OPTIM.CLIP_GRAD_NORM",
        "0.5",
        "MODEL.EMA",
        "True",
    ]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert_ok(train_net(*more, "OUT_DIR", one, env=ONE_THREAD))
    assert_ok(torchrun(2, *more, *PIPELINE, "OUT_DIR", two))
    _assert_same_run(two, one, atol=1e-5)
    name = read_text(one, "checkpoints", "last").strip()
    expected = cp.load_full(os.path.join(one, "checkpoints", name))["ema"]
    actual = cp.load_full(os.path.join(two, "checkpoints", name))["ema"]
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-5)
    weights = os.path.join(two, cp.BEST_WEIGHTS)
    evaluated = torchrun(2, "--eval-only", *LENET, *PIPELINE, "MODEL.WEIGHTS", weights,
                         "OUT_DIR", str(tmp_path / "eval"))  # fmt: skip
    assert_ok(evaluated)
    assert "samples 1000" in evaluated.stdout
    # One dry run for two checks: bf16 runs, and whole weights (one process's
    # best.pth) are checked against the whole model, each stage loading its
    # layers.
    bf16 = ["TRAIN.MIXED_PRECISION", "bf16", "OUT_DIR", str(tmp_path / "bf16")]
    start = ["MODEL.WEIGHTS", os.path.join(one, cp.BEST_WEIGHTS)]
    loaded = torchrun(2, "--dry-run", *more, *PIPELINE, *bf16, *start)
    assert_ok(loaded)
    assert "loaded weights from" in loaded.stdout


def _count_training_images(args: list[str], out: str) -> None:
    """Train ``args`` as this rank (torchrun's environment), then write how
    many training images its data set served to ``out/images<rank>``."""
    from distribuuuu.config import load_cfg
    from distribuuuu.data.datasets import SyntheticDataset
    from distribuuuu.engine.trainer import train_model

    served = []
    get_image = SyntheticDataset.__getitem__

    def counted(self, index: int):
        if self.seed == 0:  # the training set's (1: the validation set's)
            served.append(index)
        return get_image(self, index)

    SyntheticDataset.__getitem__ = counted  # type: ignore[method-assign]
    train_model(load_cfg(None, args))
    with open(os.path.join(out, f"images{os.environ['RANK']}"), "w") as f:
        f.write(str(len(served)))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_later_stage_reads_no_image_and_mixes_as_one_process(tmp_path):
    """Under CutMix and MixUp the second stage's loader serves labels only
    (no training image read, in its process: TRAIN.WORKERS 0) and mixes them
    as the first stage mixes its images: the weights of one process."""
    mixing = ["TRAIN.MIXUP_ALPHA", "0.8", "TRAIN.CUTMIX_ALPHA", "1.0"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    args = [*GENTLE, *mixing, "TRAIN.WORKERS", "0"]
    assert_ok(train_net(*args, "OUT_DIR", one, env=ONE_THREAD))
    run_launched(2, _count_training_images, ([*args, *PIPELINE, "OUT_DIR", two], two))
    reads = [int(read_text(two, f"images{rank}")) for rank in range(2)]
    assert reads[0] >= 1024 and reads[1] == 0
    _assert_same_run(two, one, atol=1e-5)
