"""DIST.STRATEGY pipeline: the model cut into stages runs like the whole model;
real gloo pipelines train like one process; bad layouts are refused."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torchvision
from helpers import (
    assert_ok,
    call_main,
    read_metrics,
    read_text,
    torchrun,
    train_net,
)

from distribuuuu import checkpoint as cp
from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.errors import UnsplittableModelError
from distribuuuu.models import build_model
from distribuuuu.models.chains import (
    StagePart,
    balanced_bounds,
    model_chain,
    named_bounds,
    step_sizes,
)
from distribuuuu.strategies.pipeline import plan_split

# One epoch of LeNet-5 (no BatchNorm) on the embedded digits.
LENET = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "20"]
PIPELINE = ["DIST.STRATEGY", "pipeline"]
# Runs compared weight by weight: at a gentle learning rate, one process on one
# thread as each torchrun rank is. At LR 0.1 LeNet's first epoch is chaotic:
# the float noise of summing micro-batches (or of 1 against 2 threads) grows
# to 3e-3 in the weights on an AVX2 CPU (1e-5 on an AVX-512 one); at 0.02 two
# stages end 1.5e-8 from one process.
GENTLE = [*LENET, "OPTIM.BASE_LR", "0.02"]
# A resumed run on another layout, after a second epoch: 5.4e-5 measured on an
# AVX2 CPU (the micro-batches of 4 stages against one process); entries read
# into the wrong layers would be off by 1e-1.
ATOL_RESUMED = 2e-4
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _small_vit() -> torch.nn.Module:
    return torchvision.models.VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=10)


# A model of each family the pipeline knows, at a size that runs in no time.
FAMILIES = {
    "resnet8": lambda: build_model("resnet8", 10),
    "lenet5": lambda: build_model("lenet5", 10),
    "vit_tiny_patch4": lambda: build_model("vit_tiny_patch4", 10),
    "resnet18": lambda: build_model("resnet18", 10),
    "regnet_y_400mf": lambda: build_model("regnet_y_400mf", 10),
    "efficientnet_b0": lambda: build_model("efficientnet_b0", 10),
    "mobilenet_v2": lambda: build_model("mobilenet_v2", 10),
    "mobilenet_v3_small": lambda: build_model("mobilenet_v3_small", 10),
    "convnext_tiny": lambda: build_model("convnext_tiny", 10),
    "vit": _small_vit,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stages_of_each_family_chained_compute_the_whole_model(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    steps = model_chain(model)  # raises unless it owns every tensor once
    bounds = balanced_bounds(step_sizes(model, steps), 3)
    ends = [*bounds[1:], len(steps)]
    stages = [StagePart(model, steps[a:b]) for a, b in zip(bounds, ends)]
    # Each stage keeps the whole model's names; together they are the whole.
    names = [key for stage in stages for key in stage.state_dict()]
    assert sorted(names) == sorted(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_no_stage_begins_with_a_layer_without_parameters():
    model = build_model("resnet18", 10)
    for step in model_chain(model):
        first = model.get_submodule(step.name)
        assert any(True for _ in first.parameters()), step.name


def test_the_automatic_split_minimises_the_largest_stage():
    assert balanced_bounds([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_bounds([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balanced_bounds([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5]
    assert balanced_bounds([1, 1, 1], 3) == [0, 1, 2]


def test_split_names_begin_stages_where_the_user_says():
    model = build_model("resnet18", 10)
    steps = model_chain(model)
    bounds = named_bounds(steps, ["layer3"], 2)
    assert steps[bounds[1]].name == "layer3.0"
    cfg = load_cfg(None, [*PIPELINE, "MODEL.ARCH", "resnet18"])
    cfg.defrost()
    cfg.DIST.PIPELINE.SPLIT = ["layer2.1", "layer4"]
    cfg.DIST.PIPELINE.STAGES = 3
    spec = strategy_spec(cfg)
    _, bounds = plan_split(model, spec.pipeline, spec.arch)
    assert [steps[i].name for i in bounds] == ["conv1", "layer2.1", "layer4.0"]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["layer9"], "'layer9' is not a module where a stage can begin"),
        (["layer2", "layer3"], "names 2 stage starts; the 2 stages need 1"),
        (["conv1"], "each after the one before"),
    ],
)
def test_bad_split_names_are_refused_naming_the_key(names, message):
    steps = model_chain(build_model("resnet18", 10))
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        named_bounds(steps, names, 2)
    assert "DIST.PIPELINE.SPLIT" in str(caught.value)


def test_a_model_of_another_family_is_refused():
    with pytest.raises(UnsplittableModelError, match="DIST.PIPELINE.SPLIT"):
        model_chain(build_model("alexnet", 10))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-procs", "3"], "DIST.PIPELINE.STAGES 2 must divide the world size 3"),
        (
            ["DIST.PIPELINE.STAGES", "4", "DIST.PIPELINE.MICROBATCHES", "2"],
            "DIST.PIPELINE.MICROBATCHES 2 is invalid: must be >= "
            "DIST.PIPELINE.STAGES 4 under 1f1b",
        ),
        (["DIST.PIPELINE.SPLIT", "['layer9']"], "'layer9' is not a module"),
        (["MODEL.ARCH", "alexnet"], "cannot run AlexNet as a chain of stages"),
        (["TRAIN.BATCH_SIZE", "30"], "must be a multiple of the 4 pipeline"),
        (["TRAIN.MIXED_PRECISION", "fp16"], "not supported with DIST.STRATEGY pipe"),
    ],
)
def test_bad_pipelines_exit_2_with_one_line_and_write_nothing(tmp_path, args, message):
    out = tmp_path / "out"
    model = [] if "MODEL.ARCH" in args else ["MODEL.ARCH", "resnet18"]
    procs = [] if "--num-procs" in args else ["--num-procs", "2"]
    result = call_main(*procs, *args, *PIPELINE, *model, "OUT_DIR", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]
    assert not out.exists()


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
def test_two_stages_train_like_one_process(tmp_path, one_process, schedule):
    """Micro-batch losses summed in another order leave float32 noise only."""
    args = [*GENTLE, *PIPELINE, "DIST.PIPELINE.SCHEDULE", schedule]
    assert_ok(torchrun(2, *args, "OUT_DIR", str(tmp_path)))
    _assert_same_run(str(tmp_path), one_process[64], atol=1e-5)


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
def test_resnet8_on_two_stages_learns_the_digits(tmp_path):
    args = ["MODEL.ARCH", "resnet8", "OPTIM.MAX_EPOCH", "6", *PIPELINE]
    assert_ok(torchrun(2, *args, "OUT_DIR", str(tmp_path)))
    val = read_metrics(str(tmp_path), "val")
    assert val[-1]["top1"] >= 95.0 and val[-1]["samples"] == 1000


def _parameters_mb(stdout: str) -> float:
    found = re.search(r"memory: ([\d.]+) MiB of parameters", stdout)
    assert found, stdout[-3000:]
    return float(found.group(1))


@pytest.mark.distributed
@pytest.mark.slow
def test_two_stages_hold_at_most_0_6_of_the_parameters_per_process(tmp_path):
    args = ["--dry-run", "MODEL.ARCH", "resnet20", "OUT_DIR", str(tmp_path)]
    ddp = torchrun(2, *args)
    pipeline = torchrun(2, *args, *PIPELINE)
    assert_ok(ddp), assert_ok(pipeline)
    assert _parameters_mb(pipeline.stdout) <= 0.6 * _parameters_mb(ddp.stdout)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_other_layouts(tmp_path):
    """Two stages save their pieces; the run goes on on four stages (each rank
    reads its own layers' entries) and on one process (read whole): alike."""
    first = str(tmp_path / "two_stages")
    gentle = GENTLE
    assert_ok(torchrun(2, *gentle, *PIPELINE, "OUT_DIR", first))
    on = {"four_stages": ["DIST.PIPELINE.STAGES", "4"], "one_process": []}
    for name, layout in on.items():
        out = str(tmp_path / name)
        shutil.copytree(first, out)
        args = [*gentle, "OPTIM.MAX_EPOCH", "2", *layout, "OUT_DIR", out]
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
    # And back: the one process's whole checkpoint (optimizer state by index)
    # goes on on two stages, each taking its parameters' entries.
    third = [*gentle, "OPTIM.MAX_EPOCH", "3"]
    for name in ("one_more", "two_more"):
        shutil.copytree(str(tmp_path / "one_process"), str(tmp_path / name))
    assert_ok(train_net(*third, "OUT_DIR", str(tmp_path / "one_more"), env=ONE_THREAD))
    two = torchrun(2, *third, *PIPELINE, "OUT_DIR", str(tmp_path / "two_more"))
    assert_ok(two)
    expected = _final_weights(str(tmp_path / "one_more"))
    actual = _final_weights(str(tmp_path / "two_more"))
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
    bf16 = ["TRAIN.MIXED_PRECISION", "bf16", "OUT_DIR", str(tmp_path / "bf16")]
    assert_ok(torchrun(2, "--dry-run", *more, *PIPELINE, *bf16))
    weights = os.path.join(two, cp.BEST_WEIGHTS)
    evaluated = torchrun(2, "--eval-only", *LENET, *PIPELINE, "MODEL.WEIGHTS", weights,
                         "OUT_DIR", str(tmp_path / "eval"))  # fmt: skip
    assert_ok(evaluated)
    assert "samples 1000" in evaluated.stdout
    # Whole weights (one process's best.pth) checked against the whole model,
    # each stage loading its layers.
    start = ["MODEL.WEIGHTS", os.path.join(one, cp.BEST_WEIGHTS)]
    out = ["OUT_DIR", str(tmp_path / "from_weights")]
    loaded = torchrun(2, "--dry-run", *LENET, *PIPELINE, *start, *out)
    assert_ok(loaded)
    assert "loaded weights from" in loaded.stdout
