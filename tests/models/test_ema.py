"""Weight EMA and precise BatchNorm: what they compute, what a run evaluates and
saves, and that a resumed run continues the same average."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from helpers import (
    assert_ok,
    read_metrics,
    read_text,
    run_on_ranks,
    strategy_for,
    torchrun,
    train_net,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distribuuuu import checkpoint as cp
from distribuuuu.models import build_model
from distribuuuu.models.ema import ModelEma, warmed_up_decay
from distribuuuu.models.syncbn import recompute_bn_statistics
from distribuuuu.strategies.gradients import step_optimizer

# resnet8 (BatchNorm: buffers are averaged too) on a few synthetic images:
# 4 steps per epoch, a checkpoint every 3 steps, every checkpoint kept.
RUN = [
    "MODEL.ARCH",
    "resnet8",
    "DATA.NAME",
    "synthetic",
    "DATA.SYNTHETIC_SIZE",
    "[48,16]",
    "TRAIN.BATCH_SIZE",
    "12",
    "TRAIN.PRINT_FREQ",
    "4",
    "OPTIM.MAX_EPOCH",
    "2",
    "MODEL.EMA",
    "True",
    "CHECKPOINT.PERIOD_ITERS",
    "3",
    "CHECKPOINT.KEEP",
    "0",
]


def _checkpoint(out: str, name: str | None = None) -> dict:
    """A training checkpoint of the run (the newest by default), read whole."""
    name = name or read_text(out, "checkpoints", "last").strip()
    return cp.load_full(os.path.join(out, "checkpoints", name))


def _continue_from(reference: str, name: str, out: str) -> None:
    """``out`` as a run interrupted right after checkpoint ``name`` of
    ``reference`` was written (a sharded one with its shards)."""
    checkpoints = os.path.join(out, "checkpoints")
    os.makedirs(checkpoints)
    source = os.path.join(reference, "checkpoints", name)
    shutil.copy(source, checkpoints)
    if os.path.isdir(cp.sharded_dir(source)):
        shutil.copytree(cp.sharded_dir(source), cp.sharded_dir(f"{checkpoints}/{name}"))
    with open(os.path.join(checkpoints, "last"), "w", encoding="utf-8") as f:
        f.write(name + "\n")


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{key} differs"


def test_decay_warms_up_as_tensorflow_does():
    assert warmed_up_decay(0.9998, 0) == pytest.approx(0.1)
    assert warmed_up_decay(0.9998, 90) == pytest.approx(0.91)
    assert warmed_up_decay(0.9998, 10**6) == 0.9998


def test_a_step_the_grad_scaler_skips_leaves_the_ema_alone():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    ema = ModelEma(model, decay=0.5, warmup=False)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.full((1, 3), float("inf"))).sum()).backward()
    assert not step_optimizer(model, optimizer, scaler, 0.0, check_skip=True).taken
    assert torch.equal(model.weight, before)  # GradScaler skipped the step
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    assert step_optimizer(model, optimizer, scaler, 0.0, check_skip=True).taken
    ema.step()
    assert ema.counters() == {"steps": 1, "updates": 1}
    torch.testing.assert_close(ema.tensors()["weight"], (before + model.weight) / 2)


@pytest.mark.slow
def test_run_evaluates_saves_and_resumes_the_ema(tmp_path):
    reference, resumed = str(tmp_path / "reference"), str(tmp_path / "resumed")
    args = [*RUN, "TRAIN.PRECISE_BN", "2"]
    assert_ok(train_net(*args, "OUT_DIR", reference))
    val, val_ema = read_metrics(reference, "val"), read_metrics(reference, "val_ema")
    assert [r["epoch"] for r in val_ema] == [1, 2]
    assert [r["loss"] for r in val_ema] != [r["loss"] for r in val]
    final = _checkpoint(reference)
    assert final["ema_counters"] == {"steps": 8, "updates": 8}
    assert not torch.equal(
        final["ema"]["stem.0.weight"], final["model"]["stem.0.weight"]
    )

    # best_ema.pth: the EMA weights (and their precise BN statistics) of its
    # best evaluation, loadable like best.pth.
    best = max(val_ema, key=lambda r: (r["top1"], -r["epoch"]))
    saved = cp.load_file(os.path.join(reference, cp.BEST_EMA_WEIGHTS))
    assert saved["epoch"] == best["epoch"]
    at_best = _checkpoint(reference, cp.checkpoint_name(best["epoch"]))["ema"]
    for key, value in at_best.items():
        if "running_" not in key:
            assert torch.equal(saved["model"][key], value), key
    check = str(tmp_path / "check")
    weights = os.path.join(reference, cp.BEST_EMA_WEIGHTS)
    assert_ok(
        train_net("--eval-only", *RUN, "MODEL.WEIGHTS", weights, "OUT_DIR", check)
    )
    (evaluated,) = read_metrics(check, "val")
    assert evaluated["loss"] == pytest.approx(best["loss"], rel=1e-6)

    # Interrupted after step 2 of epoch 2, resumed: the same EMA, bitwise.
    _continue_from(reference, "ckpt_ep_0001_it_0002.pth", resumed)
    result = train_net(*args, "OUT_DIR", resumed)
    assert_ok(result)
    assert "EMA restored (6 updates)" in result.stdout
    again = _checkpoint(resumed)
    _assert_equal(again["ema"], final["ema"])
    _assert_equal(again["model"], final["model"])
    assert again["best_ema_top1"] == final["best_ema_top1"]


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_run_on_two_ranks_resumes_on_one_process(tmp_path):
    """LeNet-5 (no BatchNorm) trains the same on 2 x 6 and 1 x 12 images."""
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    args = [
        "MODEL.ARCH",
        "lenet5",
        "DATA.NAME",
        "synthetic",
        "DATA.SYNTHETIC_SIZE",
        "[48,16]",
        "TRAIN.BATCH_SIZE",
        "6",
        "OPTIM.MAX_EPOCH",
        "2",
        "MODEL.EMA",
        "True",
        "MODEL.EMA_EVERY",
        "2",
        "CHECKPOINT.PERIOD_ITERS",
        "3",
        "CHECKPOINT.KEEP",
        "0",
    ]
    assert_ok(torchrun(2, *args, "DIST.STRATEGY", "fsdp", "OUT_DIR", two))
    assert [r["world_size"] for r in read_metrics(two, "val_ema")] == [2, 2]
    final = _checkpoint(two)  # its EMA from the shards, read whole
    assert final["ema_counters"] == {"steps": 8, "updates": 4}
    assert final["ema"].keys() == build_model("lenet5", 10).state_dict().keys()
    _continue_from(two, "ckpt_ep_0001_it_0002.pth", one)
    result = train_net(*args, "OUT_DIR", one)
    assert_ok(result)
    assert "EMA restored (3 updates)" in result.stdout
    again = _checkpoint(one)
    for key, value in final["ema"].items():
        torch.testing.assert_close(again["ema"][key], value, msg=key)


def _ema_under_fsdp(rank: int, world: int, directory: str) -> dict:
    """Three SGD steps of LeNet-5 under FSDP with an EMA; the same by hand on a
    plain copy fed the whole batch; the EMA saved and loaded both ways."""
    torch.manual_seed(0)
    plain = build_model("lenet5", 10)
    torch.manual_seed(0)  # the same initial weights
    fsdp = strategy_for("fsdp")
    model_state_dict = fsdp.model_state_dict
    model = fsdp.prepare_model(build_model("lenet5", 10))
    ema = ModelEma(model, decay=0.6, warmup=True, every=1)
    expected = {n: t.clone() for n, t in plain.state_dict().items()}
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        images = torch.randn(2 * world, 3, 28, 28, generator=generator)
        targets = torch.randint(0, 10, (2 * world,), generator=generator)
        part = slice(2 * rank, 2 * rank + 2)
        F.cross_entropy(model(images[part]), targets[part]).backward()
        F.cross_entropy(plain(images), targets).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        ema.step()
        decay = min(0.6, (1 + step) / (10 + step))
        for name, value in plain.state_dict().items():
            expected[name].lerp_(value, 1 - decay)
    raw = model_state_dict(model)
    model.eval()
    with torch.no_grad():
        model(images)  # FSDP keeps the root's gathered parameters after it
        with ema.swapped_in():
            outputs = model(images)
            averaged = {n: t.clone() for n, t in model_state_dict(model).items()}
    restored = model_state_dict(model)
    # Saved as shards, loaded back; saved whole, loaded as shards.
    dcp.save({"ema": ema.tensors()}, checkpoint_id=directory)
    from_shards, from_whole = (ModelEma(model, 0.6, True) for _ in range(2))
    from_shards.load_shards(directory, ema.counters())
    whole = {name: t.full_tensor() for name, t in ema.tensors().items()}
    from_whole.load(whole, ema.counters())
    loaded = []
    for other in (from_shards, from_whole):
        with other.swapped_in():
            loaded.append(model_state_dict(model))
    return {"expected": expected, "raw": raw, "averaged": averaged,
            "restored": restored, "loaded": loaded, "images": images,
            "outputs": outputs}  # fmt: skip


def _fsdp_ema_and_precise_bn(rank: int, world: int, directory: str) -> dict:
    return {"ema": _ema_under_fsdp(rank, world, directory),
            "bn": _precise_bn(rank, world)}  # fmt: skip


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> list[dict]:
    """The results of both 2-rank checks below, from one spawn of 2 processes."""
    tmp = tmp_path_factory.mktemp("ranks")
    return run_on_ranks(2, _fsdp_ema_and_precise_bn, (str(tmp / "dcp"),), tmp)


@pytest.mark.slow
def test_ema_of_fsdp_shards_matches_the_average_by_hand(on_two_ranks):
    result = on_two_ranks[0]["ema"]
    expected = result["expected"]
    assert result["averaged"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result["averaged"][name], value, msg=name)
    _assert_equal(result["restored"], result["raw"])
    for name, value in result["raw"].items():
        assert not torch.equal(result["averaged"][name], value), name
    for loaded in result["loaded"]:
        _assert_equal(loaded, result["averaged"])
    # The model evaluated inside computes with the EMA weights.
    plain = build_model("lenet5", 10).eval()
    plain.load_state_dict(expected)
    with torch.no_grad():
        torch.testing.assert_close(result["outputs"], plain(result["images"]))


def _precise_bn(rank: int, world: int) -> dict:
    """Precise BN of a DDP model over 3 batches per rank, and the true average
    of every rank's batches by hand (each rank's batches shifted differently)."""

    def batches(r: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(r)
        return [torch.randn(4, 2, 3, 3, generator=generator) * (1 + r) + r
                for _ in range(3)]  # fmt: skip

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))
    model = DistributedDataParallel(model.eval())
    norm = model.module[0]
    count = recompute_bn_statistics(model.module, batches(rank))
    everything = [x for r in range(world) for x in batches(r)]
    return {
        "count": count,
        "mean": norm.running_mean,
        "var": norm.running_var,
        "last": model.module[2].running_var,
        "expected_mean": torch.stack([x.mean((0, 2, 3)) for x in everything]).mean(0),
        "expected_var": torch.stack([x.var((0, 2, 3)) for x in everything]).mean(0),
        "momentum": norm.momentum,
        "tracked": int(norm.num_batches_tracked),
        "training": model.module.training,
    }


def test_precise_bn_is_the_true_average_and_the_same_on_every_rank(on_two_ranks):
    results = [result["bn"] for result in on_two_ranks]
    for result in results:
        assert result["count"] == 3
        torch.testing.assert_close(result["mean"], result["expected_mean"])
        torch.testing.assert_close(result["var"], result["expected_var"])
        assert (result["momentum"], result["tracked"]) == (0.1, 0)
        assert not result["training"]
    for key in ("mean", "var", "last"):
        assert torch.equal(results[0][key], results[1][key]), key
    assert not torch.equal(results[0]["last"], torch.ones(2))  # recomputed too
