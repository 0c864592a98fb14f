"""Strategies and memory: ZeRO-1 and FSDP equal DDP, resume anywhere, and use
less memory; activation checkpointing changes nothing but memory."""

from __future__ import annotations

import copy
import io
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_ok,
    read_metrics,
    run_on_ranks,
    strategy_for,
    torchrun,
    train_net,
)
from torch import nn

from distribuuuu.inference.read import read_checkpoint
from distribuuuu.models import build_model
from distribuuuu.models.recompute import enable_activation_checkpointing
from distribuuuu.strategies.zero1 import consolidate_on_rank_0, shard_optimizer

STEPS, BATCH = 4, 6  # optimizer steps; samples per rank per step
# Image size by model: LeNet-5's layers want 28 px; resnet8 takes any size, and
# a step at 16 px costs a quarter of one at 28.
IM_SIZE = {"lenet5": 28, "resnet8": 16}


def _batches(world: int, size: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        images = torch.randn(world * BATCH, 3, size, size, generator=generator)
        yield images, torch.randint(0, 10, (world * BATCH,), generator=generator)


def _prepared(arch: str, strategy: str, act_ckpt: bool, seed: int = 0) -> tuple:
    """The strategy, its model of ``seed`` and SGD with momentum over it."""
    torch.manual_seed(seed)
    model = build_model(arch, 10)
    if act_ckpt:
        enable_activation_checkpointing(model)
    spread = strategy_for(strategy)
    if strategy == "zero1":  # as the chain runs it by default (CHANNELS_LAST)
        model = model.to(memory_format=torch.channels_last)
    model = spread.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy == "zero1":
        strides = [param.stride() for param in model.parameters()]
        optimizer = shard_optimizer(optimizer)
        _assert_bucket_views_in_their_layouts(model, strides)
    return spread, model, optimizer


def _run_steps(rank: int, model: nn.Module, optimizer, batches) -> None:
    for images, targets in batches:
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        F.cross_entropy(model(images[part]), targets[part]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _states(spread, model: nn.Module, optimizer) -> dict:
    """The whole model and optimizer state (collectives for ZeRO and FSDP:
    rank 0 gets everything)."""
    return {
        "model": spread.model_state_dict(model),
        "optimizer": spread.optimizer_state_dict(model, optimizer),
    }


def _train(rank: int, world: int, arch: str, strategy: str, act_ckpt: bool) -> dict:
    """K steps of SGD with momentum; the whole model and optimizer state."""
    spread, model, optimizer = _prepared(arch, strategy, act_ckpt)
    _run_steps(rank, model, optimizer, _batches(world, IM_SIZE[arch]))
    if strategy == "zero1":
        assert 0 < len(optimizer.optim.state) < len(list(model.parameters()))
    return _states(spread, model, optimizer)


def _zero1_resumed(rank: int, world: int) -> dict:
    """resnet8 under ZeRO-1: the first 2 of :func:`_train`'s steps, their
    state saved (torch.save) and loaded into a model and optimizer built from
    another seed, then the last 2 steps."""
    batches = list(_batches(world, IM_SIZE["resnet8"]))
    spread, model, optimizer = _prepared("resnet8", "zero1", False)
    _run_steps(rank, model, optimizer, batches[:2])
    saved = io.BytesIO()
    torch.save(_states(spread, model, optimizer), saved)
    shared = [saved.getvalue()]
    torch.distributed.broadcast_object_list(shared)  # rank 0's: the whole state
    state = torch.load(io.BytesIO(shared[0]), weights_only=True)
    spread, model, optimizer = _prepared("resnet8", "zero1", False, seed=1)
    spread.load_model_state(model, state["model"])
    # torch's ZeroRedundancyOptimizer.load_state_dict empties other ranks' state
    spread.load_optimizer_state(model, optimizer, copy.deepcopy(state["optimizer"]))
    _run_steps(rank, model, optimizer, batches[2:])
    return {"saved": state, "resumed": _states(spread, model, optimizer)}


def _assert_bucket_views_in_their_layouts(model: nn.Module, strides: list) -> None:
    """ZeRO-1's parameters are views of one buffer per rank (2 storages in
    all), each in the strides it had: the convolutions' channels-last."""
    params = list(model.parameters())
    assert len({param.untyped_storage().data_ptr() for param in params}) == 2
    assert [param.stride() for param in params] == strides
    assert any(p.dim() == 4 and not p.is_contiguous() for p in params)


def _momentum_by_name(arch: str, state: dict) -> dict:
    """Momentum buffers of an optimizer state keyed by index or by name."""
    names = [name for name, _ in build_model(arch, 10).named_parameters()]
    return {
        key if isinstance(key, str) else names[key]: value["momentum_buffer"]
        for key, value in state["state"].items()
    }


# (model, strategy, activation checkpointing), each compared with plain DDP.
CASES = [
    ("lenet5", "zero1", False),
    ("resnet8", "zero1", False),
    ("lenet5", "fsdp", False),
    ("resnet8", "fsdp", True),
]


def _train_every_case(rank: int, world: int) -> dict:
    """Every strategy of CASES and DDP beside it, in one process group."""
    runs = {}
    for arch, strategy, act_ckpt in [(a, "ddp", False) for a, _, _ in CASES] + CASES:
        key = (arch, strategy, act_ckpt)
        if key not in runs:
            runs[key] = _train(rank, world, arch, strategy, act_ckpt)
    return {"/".join(map(str, key)): value for key, value in runs.items()}


def _zero1_adamw_step(rank: int, world: int) -> dict:
    """Two AdamW steps of a linear layer, sharded by ZeRO-1 and plain."""
    del rank, world
    weights = []
    for sharded in (True, False):
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
        if sharded:
            optimizer = shard_optimizer(optimizer)
        for _ in range(2):
            layer(torch.ones(2, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        weights.append(layer.weight.detach().clone())
    return {"sharded": weights[0], "plain": weights[1]}


def _zero1_consolidations(rank: int, world: int) -> dict:
    """The whole AdamW state after 2 steps of ZeRO-1, consolidated on rank 0
    by torch (``consolidate_state_dict``) and by ours, which fills the private
    attribute that torch's ``state_dict()`` reads."""
    del world
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    for _ in range(2):
        model(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    consolidate_on_rank_0(optimizer)  # first: torch's fills nothing for it
    ours = optimizer.state_dict() if rank == 0 else {}
    optimizer.consolidate_state_dict(to=0)
    return {"torch": optimizer.state_dict() if rank == 0 else {}, "ours": ours}


def _on_two_ranks(rank: int, world: int) -> dict:
    """:func:`_train_every_case` and :func:`_shard_models_of_different_seeds`
    in one process group; a part that raised keeps its traceback (its tests
    fail with it, the other part's get their answers)."""
    parts = {
        "train": _train_every_case,
        "shard": _shard_models_of_different_seeds,
        "adamw": _zero1_adamw_step,
        "consolidate": _zero1_consolidations,
        "resume": _zero1_resumed,
    }
    results = {}
    for name, part in parts.items():
        try:
            results[name] = part(rank, world)
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of :func:`_on_two_ranks`: one launch of 2 gloo ranks."""
    out = tmp_path_factory.mktemp("strategies")
    return run_on_ranks(2, _on_two_ranks, (), out)


def _part(ranks: list[dict], name: str) -> list:
    """Each rank's result of one part; a part that raised fails the test."""
    for result in ranks:
        assert not isinstance(result[name], str), result[name]
    return [result[name] for result in ranks]


@pytest.fixture(scope="module")
def trained_on_two_ranks(two_ranks) -> dict:
    """Rank 0's results of :func:`_train_every_case` on 2 gloo ranks."""
    return _part(two_ranks, "train")[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch, strategy, act_ckpt", CASES)
def test_sharded_strategies_reach_the_parameters_of_ddp(
    trained_on_two_ranks, arch, strategy, act_ckpt
):
    """Training-mode BatchNorm (resnet8) normalises with the batch statistics of
    each rank under both strategies, so its parameters must agree as well."""
    ddp = trained_on_two_ranks[f"{arch}/ddp/False"]
    other = trained_on_two_ranks[f"{arch}/{strategy}/{act_ckpt}"]
    for key, value in ddp["model"].items():
        if "running_" in key or "num_batches" in key:
            continue  # DDP broadcasts rank 0's BN statistics, FSDP keeps its own
        torch.testing.assert_close(other["model"][key], value, msg=key)
    expected = _momentum_by_name(arch, ddp["optimizer"])
    actual = _momentum_by_name(arch, other["optimizer"])
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, msg=name)


def _shard_models_of_different_seeds(rank: int, world: int) -> dict:
    """Each rank builds the model from its own seed, as training runs do
    (seed + rank), then FSDP shards it; the whole model gathered on rank 0."""
    torch.manual_seed(rank)
    model = build_model("resnet8", 10)
    first = copy.deepcopy(model.state_dict())
    spread = strategy_for("fsdp")
    return {
        "first": first,
        "sharded": spread.model_state_dict(spread.prepare_model(model)),
    }


@pytest.mark.slow
def test_fsdp_starts_from_rank_0s_model(two_ranks):
    results = _part(two_ranks, "shard")
    first, sharded = results[0]["first"], results[0]["sharded"]
    assert sharded.keys() == first.keys()
    for key, value in first.items():
        assert torch.equal(sharded[key], value), key
    weight = next(key for key in first if key.endswith("weight"))
    assert not torch.equal(results[1]["first"][weight], first[weight])  # 2 seeds


# A small ResNet on a few synthetic images at 16 px (a step costs a quarter of
# one at the default 28 px; what a resume or a reshard keeps does not depend on
# the image size).
TRAIN_SIZE = 48
SMALL = [
    "MODEL.ARCH", "resnet8", "DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE",
    f"[{TRAIN_SIZE}, 32]", "TRAIN.BATCH_SIZE", "12", "TRAIN.PRINT_FREQ", "2",
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
]  # fmt: skip


def _resume(out: str, ranks: int, epochs: int, *args: str) -> None:
    """Continue the run in ``out`` up to ``epochs`` on ``ranks`` processes."""
    args = (*SMALL, *args, "OPTIM.MAX_EPOCH", str(epochs), "OUT_DIR", out)
    result = torchrun(ranks, *args) if ranks > 1 else train_net(*args)
    assert_ok(result)
    assert "resumed from" in result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_zero1_checkpoints_resume_on_2_and_on_1_process(tmp_path):
    out = str(tmp_path)
    first = torchrun(2, *SMALL, "DIST.STRATEGY", "zero1", "MODEL.ACT_CKPT", "True",
                     "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out)  # fmt: skip
    assert_ok(first)
    assert "ZeRO-1: optimizer state sharded over 2 ranks" in first.stdout
    assert "activation checkpointing: 3 blocks recompute" in first.stdout
    state = torch.load(f"{out}/checkpoints/ckpt_ep_0001.pth", weights_only=True)
    parameters = list(build_model("resnet8", 10).parameters())
    assert len(state["optimizer"]["state"]) == len(parameters)  # consolidated
    # Two more epochs: one on 2 ranks, one on a single process without ZeRO.
    _resume(out, 2, 2, "DIST.STRATEGY", "zero1")
    _resume(out, 1, 3)
    val = read_metrics(out, "val")
    assert [r["epoch"] for r in val] == [1, 2, 3]
    assert [r["world_size"] for r in val] == [2, 2, 1]
    assert all(r["train_samples"] == TRAIN_SIZE for r in val)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_checkpoints_resume_on_2_reshard_on_3_and_resume_on_1(tmp_path):
    """Sharded (DCP) checkpoints of FSDP with host offload, activation
    checkpointing and bf16: saved on 2 ranks, resumed on 2, then on 3, then on
    one plain process."""
    out = str(tmp_path)
    fsdp = [
        "DIST.STRATEGY",
        "fsdp",
        "DIST.FSDP_CPU_OFFLOAD",
        "True",
        "MODEL.ACT_CKPT",
        "True",
        "TRAIN.MIXED_PRECISION",
        "bf16",
    ]
    first = torchrun(2, *SMALL, *fsdp, "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out)
    assert_ok(first)
    assert "parameters and gradients kept in host memory" in first.stdout
    shards = f"{out}/checkpoints/ckpt_ep_0001.dcp"
    assert sorted(os.listdir(shards)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = torch.load(f"{out}/checkpoints/ckpt_ep_0001.pth", weights_only=True)
    assert "model" not in state and state["sharded"] == "ckpt_ep_0001.dcp"
    # 32 validation images on 3 ranks in batches of 5: 3, 3 and 2 batches, and
    # every sharded forward is a collective (the last rank adds an empty one).
    _resume(out, 2, 2, *fsdp)
    _resume(out, 3, 3, *fsdp, "TEST.BATCH_SIZE", "5")
    _resume(out, 1, 4)
    val = read_metrics(out, "val")
    assert [r["epoch"] for r in val] == [1, 2, 3, 4]
    assert [r["world_size"] for r in val] == [2, 2, 3, 1]
    assert [r["samples"] for r in val] == [32, 32, 32, 32]
    # The sharded checkpoint of 3 ranks reads whole, as every tool sees it.
    whole = read_checkpoint(f"{out}/checkpoints/ckpt_ep_0003.pth")
    expected = build_model("resnet8", 10).state_dict()
    assert whole.weights.keys() == expected.keys()
    assert all(whole.weights[k].shape == v.shape for k, v in expected.items())


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_strategies_report_less_peak_memory_than_ddp(tmp_path):
    """AlexNet (61 M parameters): its SGD momentum is 244 MB on every DDP rank
    and half of that with ZeRO-1 on 2 ranks; FSDP also halves the parameters
    and gradients.  Keep the 2 steps: with one, DDP's peak was ~70 MiB lower
    and ZeRO-1's fuller rank came within 10 MiB of it (the largest layer, 38 M
    of the 57 M parameters, is one tensor, so the shards are uneven)."""
    peaks = {}
    for strategy in ("ddp", "zero1", "fsdp"):
        out = str(tmp_path / strategy)
        result = torchrun(
            2, "MODEL.ARCH", "alexnet", "DATA.NAME", "synthetic",
            "DATA.SYNTHETIC_SIZE", "[8, 4]", "TRAIN.BATCH_SIZE", "2",
            "TRAIN.IM_SIZE", "64", "TEST.IM_SIZE", "64", "OPTIM.MAX_EPOCH", "1",
            "DIST.STRATEGY", strategy, "OUT_DIR", out,
        )  # fmt: skip
        assert_ok(result)
        (val,) = read_metrics(out, "val")
        peaks[strategy] = val["peak_mem_mb"]
    print("peak memory per rank (MiB):", peaks)
    assert max(peaks["zero1"]) < min(peaks["ddp"])
    assert max(peaks["fsdp"]) < min(peaks["ddp"])


@pytest.mark.parametrize("arch", ["resnet8", "resnet18"])
def test_activation_checkpointing_changes_nothing_but_memory(arch):
    torch.manual_seed(0)
    plain = build_model(arch, 10)
    recomputed = copy.deepcopy(plain)
    assert enable_activation_checkpointing(recomputed) > 0
    images, targets = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    losses = []
    for model in (plain, recomputed):
        loss = F.cross_entropy(model(images), targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    # Same names, and BatchNorm statistics updated once, not twice.
    expected = plain.state_dict()
    for key, value in recomputed.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=key)


def _replicate_doubled(model: nn.Module) -> nn.Module:
    """What DataParallel's ``replicate`` makes for another GPU, on the CPU:
    every module copied by ``_replicate_for_data_parallel`` (its ``__dict__``
    copied), children relinked, parameters replaced, by their double here."""
    replicas = {m: m._replicate_for_data_parallel() for m in model.modules()}
    for module, replica in replicas.items():
        for name, child in module._modules.items():
            replica._modules[name] = replicas[child]
        for name, param in module._parameters.items():
            replica._parameters[name] = None if param is None else param.detach() * 2
    return replicas[model]


def test_checkpointed_blocks_of_a_replica_run_the_replicas_weights():
    """MODEL.ACT_CKPT under DIST.MODE dp: each replica's blocks must compute
    with that replica's weights (on its GPU), not with the original's."""
    torch.manual_seed(0)
    model = build_model("resnet8", 10).eval()
    doubled = copy.deepcopy(model)
    with torch.no_grad():
        for param in doubled.parameters():
            param.mul_(2)
    assert enable_activation_checkpointing(model) > 0
    replica = _replicate_doubled(model)
    images = torch.randn(2, 3, 32, 32, requires_grad=True)
    torch.testing.assert_close(replica(images), doubled(images))


def test_timm_activation_checkpointing_updates_batchnorm_statistics_once(
    monkeypatch,
):
    """timm's own switch recomputes without our frozen statistics, so a BatchNorm
    would count each step twice; our wrapping of timm's blocks must not."""
    pytest.importorskip("timm")
    from distribuuuu.models import recompute

    calls = []

    def counted_checkpoint(*args, **kwargs):
        calls.append(args[0])
        return torch.utils.checkpoint.checkpoint(*args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counted_checkpoint)
    torch.manual_seed(0)
    plain = build_model("timm/resnet10t", 3)
    recomputed = copy.deepcopy(plain)
    blocks = enable_activation_checkpointing(recomputed)
    images, targets = torch.randn(4, 3, 32, 32), torch.randint(0, 3, (4,))
    for model in (plain, recomputed):
        F.cross_entropy(model(images), targets).backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    expected = plain.state_dict()
    statistics = [key for key in expected if ".running_" in key or "num_batches" in key]
    assert statistics
    for key in statistics:
        torch.testing.assert_close(recomputed.state_dict()[key], expected[key], msg=key)
    assert int(expected["bn1.num_batches_tracked"]) == 1
    # Checkpointing was on: each of the 4 BasicBlocks ran through our checkpoint.
    assert blocks == len(calls) == 4


def test_timm_model_with_batchnorm_and_no_known_blocks_is_not_checkpointed(caplog):
    """timm's own switch would update its BatchNorm statistics twice per step:
    the run goes on without activation checkpointing, and says why."""
    pytest.importorskip("timm")
    model = build_model("timm/efficientvit_b0", 3)
    assert enable_activation_checkpointing(model) == 0
    assert "statistics twice" in caplog.text
    images, targets = torch.randn(2, 3, 64, 64), torch.tensor([0, 1])
    F.cross_entropy(model(images), targets).backward()
    tracked = {k: v for k, v in model.state_dict().items() if "num_batches" in k}
    assert tracked and all(int(count) == 1 for count in tracked.values())


@pytest.mark.parametrize(
    "arch, switched, warning",
    [
        ("timm/pvt_v2_b0", 4, None),  # its 4 stages checkpoint their blocks
        ("timm/coat_lite_tiny", 0, "timm does not support"),  # timm refuses
    ],
)
def test_timm_switch_for_models_without_running_statistics(
    caplog, arch, switched, warning
):
    """A timm model without known blocks or running statistics gets timm's own
    activation checkpointing, where timm supports it for that model."""
    pytest.importorskip("timm")
    model = build_model(arch, 3)
    assert enable_activation_checkpointing(model) == switched
    on = [m for m in model.modules() if getattr(m, "grad_checkpointing", False)]
    assert len(on) == switched
    if warning:
        assert warning in caplog.text


@pytest.mark.slow
def test_zero1_shards_adamw_and_steps_as_adamw_does(two_ranks):
    """torch's AdamW records an argument among its defaults that it refuses
    (decoupled_weight_decay): ZeRO-1 rebuilds it all the same."""
    for result in _part(two_ranks, "adamw"):
        torch.testing.assert_close(result["sharded"], result["plain"])


@pytest.mark.slow
def test_zero1_resumes_bitwise_from_its_checkpoint_state(
    two_ranks, trained_on_two_ranks
):
    """resnet8, channels-last, under ZeRO-1 with parameters as bucket views:
    2 steps, the checkpoint's state loaded into a new model and optimizer, 2
    more steps end bitwise where 4 uninterrupted steps do.  The checkpoint
    keeps the layout it had without bucket views: each weight and momentum
    in its parameter's strides (channels-last convolutions)."""
    state = _part(two_ranks, "resume")[0]
    uninterrupted = trained_on_two_ranks["resnet8/zero1/False"]
    for part in ("model", "optimizer"):
        expected, resumed = uninterrupted[part], state["resumed"][part]
        if part == "optimizer":
            expected, resumed = expected["state"], resumed["state"]
        assert resumed.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0)
    saved = state["saved"]
    laid_out = build_model("resnet8", 10).to(memory_format=torch.channels_last)
    momentum = _momentum_by_name("resnet8", saved["optimizer"])
    for name, param in laid_out.named_parameters():
        assert saved["model"][name].stride() == param.stride(), name
        assert momentum[name].stride() == param.stride(), name


@pytest.mark.slow
def test_zero1_consolidates_on_rank_0_as_torch_does(two_ranks):
    """The checkpoint's optimizer state: ours (one gather to rank 0) equals
    torch's consolidation, every tensor of both ranks' shards included."""
    consolidated = _part(two_ranks, "consolidate")[0]
    theirs, ours = consolidated["torch"], consolidated["ours"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys() == set(range(4))
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys()
        for name, value in state.items():
            assert torch.equal(ours["state"][index][name], value), (index, name)
