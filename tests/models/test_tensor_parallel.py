"""DIST.TENSOR_PARALLEL: Megatron-style blocks on real gloo ranks compute what
one process computes; ddp and fsdp over the replicas; the ranks of a replica
draw the same drop-path masks; bad layouts refused."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import (
    assert_ok,
    call_main,
    read_metrics,
    run_on_ranks,
    run_parts,
    torchrun,
    train_net,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchvision.ops import StochasticDepth

from distribuuuu.checkpoint.format import fuse_qkv
from distribuuuu.models import build_model
from distribuuuu.models.tensor_parallel import (
    check_tensor_parallel,
    parallelize,
    share_random_state,
)
from distribuuuu.models.vit import split_torchvision_attention
from distribuuuu.strategies.gradients import average_gradients, clip_gradients

VIT = ["--cfg", "config/digits_vit_tiny.yaml", "OPTIM.MAX_EPOCH", "1"]
# One epoch of 8 steps of 64 (an eighth of the digits' time), 200 val images,
# at 16 px: 16 patches, where a step took a third of the CPU time of one at the
# digits' 28 px (49 patches; 0.39 s against 1.0-1.4 s on one thread).
VAL_SIZE = 200
SHORT = [*VIT, "DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", f"[512,{VAL_SIZE}]"]
SHORT += ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"]


def _small_torchvision_vit() -> torch.nn.Module:
    """torchvision's ViT class at a small size: 28 px, patches of 4 (50 tokens)."""
    return torchvision.models.VisionTransformer(28, 4, 2, 4, 32, 64, num_classes=10)


def test_the_split_torchvision_attention_computes_the_same_and_keeps_the_keys():
    torch.manual_seed(0)
    model = _small_torchvision_vit().eval()
    saved = model.state_dict()
    x = torch.randn(2, 3, 28, 28)
    expected = model(x)
    assert split_torchvision_attention(model) == 2
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)
    assert model.state_dict().keys() == saved.keys()  # in_proj_* as torchvision's
    plain = _small_torchvision_vit().eval()
    plain.load_state_dict(model.state_dict())  # and back into the fused layer
    torch.testing.assert_close(plain(x), expected, rtol=0, atol=1e-6)
    split = {k: v for k, v in model.named_parameters()}
    fused = fuse_qkv({k: v.detach() for k, v in split.items()})
    assert fused.keys() == {k for k, _ in plain.named_parameters()}


@pytest.mark.parametrize(
    ("arch", "size", "message"),
    [
        ("resnet20", 2, "SmallResNet has no tensor-parallel plan"),
        ("vit_tiny_patch4", 3, "must divide the model's heads 4"),
        ("vit_tiny_patch4", 8, "must divide the model's heads 4"),
    ],
)
def test_models_that_cannot_be_split_are_refused(arch, size, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        check_tensor_parallel(build_model(arch, 10), size)
    assert "DIST.TENSOR_PARALLEL" in str(caught.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-procs", "2", "MODEL.ARCH", "resnet20"], "has no tensor-parallel"),
        (["--num-procs", "3"], "DIST.TENSOR_PARALLEL 3 must divide the model's heads"),
        (["--num-procs", "3", "DIST.TENSOR_PARALLEL", "2"], "must divide the world"),
        (["DIST.STRATEGY", "pipeline"], "cannot be combined with DIST.TENSOR_PARALLEL"),
        (["TRAIN.MIXED_PRECISION", "fp16"], "not supported with DIST.TENSOR_PARALLEL"),
        (
            ["--num-procs", "2", "DIST.SEQUENCE_PARALLEL", "True"]
            + ["TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"],
            "must divide the 65 tokens (patches + class token) of 32 px images",
        ),
    ],
)
def test_bad_tensor_parallel_runs_exit_2_and_write_nothing(tmp_path, args, message):
    out = tmp_path / "out"
    size = "3" if args[:2] == ["--num-procs", "3"] else "2"
    tp = [] if "DIST.TENSOR_PARALLEL" in args else ["DIST.TENSOR_PARALLEL", size]
    arch = [] if "MODEL.ARCH" in args else ["MODEL.ARCH", "vit_tiny_patch4"]
    result = call_main(*args, *tp, *arch, "OUT_DIR", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not out.exists()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _one_step(rank: int, world: int, arch: str, dp: int, sp: bool = False) -> dict:
    """Logits, gradients (clipped) and weights after one SGD step, of one
    process and of ``world // dp`` tensor-parallel ranks x ``dp`` replicas
    (fsdp over them when ``dp`` > 1); each replica gets its half of the batch."""
    torch.manual_seed(0)
    reference = build_model(arch, 10) if arch else _small_torchvision_vit()
    model = build_model(arch, 10) if arch else _small_torchvision_vit()
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"], sequence_parallel=sp)
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    images, targets = torch.randn(8, 3, 28, 28), torch.randint(0, 10, (8,))
    replica = mesh.get_local_rank("dp")
    mine = (images.chunk(dp)[replica], targets.chunk(dp)[replica])
    results = {"rank": rank}
    for name, net, (x, t) in (
        ("one", reference, (images, targets)),
        ("tp", model, mine),
    ):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        logits = net(x)
        F.cross_entropy(logits, t).backward()
        clip_gradients(list(net.parameters()), 0.5)
        results[f"{name}_logits"] = _full(logits).detach()
        named = list(net.named_parameters())
        # fuse_qkv: the split attention's entries under torchvision's names
        results[f"{name}_grads"] = fuse_qkv({k: _full(p.grad) for k, p in named})
        optimizer.step()
        results[f"{name}_weights"] = fuse_qkv({k: _full(p) for k, p in named})
    return results


def _assert_equal_step(results: list[dict], dp: int) -> None:
    for result in results:
        logits = result["tp_logits"]
        half = result["one_logits"].chunk(dp)
        assert any(torch.allclose(logits, h, atol=1e-5, rtol=0) for h in half)
        for kind in ("grads", "weights"):
            expected, actual = result[f"one_{kind}"], result[f"tp_{kind}"]
            assert expected.keys() == actual.keys()
            for key, value in expected.items():
                torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-5)


ARCHS = ["vit_tiny_patch4", ""]  # "": torchvision's ViT
SEQUENCE_PARALLEL = [False, True]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sp", SEQUENCE_PARALLEL, ids=["", "sequence-parallel"])
def test_two_tensor_parallel_ranks_compute_one_process_step(two_ranks, arch, sp):
    _assert_equal_step(_part(two_ranks, f"one step {arch}/{sp}"), 1)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_times_tensor_parallel_on_four_ranks_computes_one_process_step(tmp_path):
    _assert_equal_step(
        run_on_ranks(4, _one_step, ("vit_tiny_patch4", 2), str(tmp_path)), 2
    )


def test_average_gradients_skips_a_single_replica():
    param = torch.nn.Parameter(torch.ones(2))
    average_gradients([param], None, 1)
    assert param.grad is None


def _val_loss(out: str) -> float:
    (val,) = read_metrics(out, "val")
    assert val["samples"] == VAL_SIZE  # each validation image once
    return val["loss"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> str:
    """OUT_DIR of an epoch of SHORT on one process, the tests' reference."""
    one = str(tmp_path_factory.mktemp("one"))
    assert_ok(train_net(*SHORT, "OUT_DIR", one))
    return one


@pytest.mark.distributed
@pytest.mark.slow
def test_an_epoch_under_tensor_parallel_ends_like_one_process(tmp_path, one_process):
    """vit_tiny_patch4, one epoch: TP 2 on 2 ranks against one process; the
    tensor-parallel ranks hold at most 0.6 of its parameters each."""
    one, tp = one_process, str(tmp_path / "tp")
    result = torchrun(2, *SHORT, "DIST.TENSOR_PARALLEL", "2", "OUT_DIR", tp)
    assert_ok(result)
    assert _val_loss(tp) == pytest.approx(_val_loss(one), rel=1e-4)
    memory = re.search(r"memory: ([\d.]+) MiB of parameters", result.stdout)
    whole = re.search(r"memory: ([\d.]+) MiB of parameters", read_log(one))
    assert float(memory.group(1)) <= 0.6 * float(whole.group(1))


def read_log(out: str) -> str:
    with open(f"{out}/log.txt", encoding="utf-8") as f:
        return f.read()


@pytest.mark.distributed
@pytest.mark.slow
def test_an_epoch_of_fsdp_times_tensor_parallel_ends_like_one_process(
    tmp_path, one_process
):
    """2 replicas (fsdp) x TP 2 on 4 ranks, 32 images per replica, against
    one process with batches of 64."""
    one, both = one_process, str(tmp_path / "both")
    layout = ["DIST.TENSOR_PARALLEL", "2", "DIST.STRATEGY", "fsdp"]
    batch = ["TRAIN.BATCH_SIZE", "32"]
    assert_ok(torchrun(4, *SHORT, *batch, *layout, "OUT_DIR", both))
    assert _val_loss(both) == pytest.approx(_val_loss(one), rel=1e-4)


def _tensor_parallel_strategy(*keys: str):
    """The strategy of a torchvision ViT under TP 2 on this process's group."""
    from distribuuuu.config import load_cfg
    from distribuuuu.engine.specs import strategy_spec
    from distribuuuu.strategies import build_strategy

    tp = ["DIST.TENSOR_PARALLEL", "2", "MODEL.ARCH", "vit_b_32"]
    cfg = load_cfg(None, [*tp, *keys])
    return cfg, build_strategy(strategy_spec(cfg, torch.device("cpu")))


def _tensor_parallel_model(strategy, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` through the chain's tensor-parallel and wrapping steps."""
    from distribuuuu.strategies.chain import split_tensors, wrap

    return wrap(strategy, split_tensors(strategy, model))


def _whole_state_round_trip(rank: int, out_dir: str) -> dict:
    """A torchvision ViT under TP 2: its whole state dict, loaded back, saved
    as a sharded checkpoint and read whole."""
    from distribuuuu import checkpoint as cp

    _, strategy = _tensor_parallel_strategy()
    torch.manual_seed(0)
    plain = _small_torchvision_vit()
    model = _tensor_parallel_model(strategy, _small_torchvision_vit())
    strategy.load_model_state(model, plain.state_dict())
    whole = strategy.model_state_dict(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = cp.CheckpointWriter(out_dir)
    entries = strategy.save_weights(model, optimizer, None, writer, "ckpt")
    path = os.path.join(out_dir, "checkpoints", "ckpt.pth")
    if rank == 0:
        torch.save({"epoch": 0, **entries}, path)
    torch.distributed.barrier()
    return {"plain": plain.state_dict(), "whole": whole, "read": cp.load_full(path)}


def _replicated(parameter: torch.Tensor) -> bool:
    """A weight every tensor-parallel rank holds whole."""
    if isinstance(parameter, DTensor):
        return all(p.is_replicate() for p in parameter.placements)
    return True


def _drop_path_steps(rank: int, sequence_parallel: bool, ours: bool = False) -> dict:
    """The whole weights of a torchvision ViT with MODEL.DROP_PATH 0.5 after
    20 SGD steps under TP 2 (the strategy's), each rank seeded apart as the
    trainer seeds it; and whether two forward passes then differ (the zero
    head of torchvision's ViT gives zero logits before).  ``ours``:
    vit_tiny_patch4 with MODEL.DROPOUT 0.5 too, 2 steps on 20 px images."""
    from distribuuuu.engine.specs import model_spec
    from distribuuuu.models import build_configured
    from distribuuuu.models.regularize import regularize

    sp = ["DIST.SEQUENCE_PARALLEL", str(sequence_parallel)]
    own = ["MODEL.ARCH", "vit_tiny_patch4", "MODEL.DROPOUT", "0.5"] * ours
    cfg, strategy = _tensor_parallel_strategy("MODEL.DROP_PATH", "0.5", *sp, *own)
    torch.manual_seed(1 + rank)  # RNG_SEED + rank
    if ours:
        model = build_configured(model_spec(cfg))
    else:
        model = _small_torchvision_vit()
        regularize(model, model_spec(cfg))
    model = _tensor_parallel_model(strategy, model)
    batch = torch.Generator().manual_seed(0)  # the same batch on both ranks
    size = 20 if ours else 28  # 26 tokens for ours, 50 for torchvision's
    images = torch.randn(8, 3, size, size, generator=batch)
    targets = torch.randint(0, 10, (8,), generator=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[torch.Tensor] = []  # per drop path call, which samples it kept
    for module in model.modules():
        if isinstance(module, StochasticDepth):
            module.register_forward_hook(lambda _, args, out: kept.append(_kept(out)))
    for _ in range(2 if ours else 20):
        optimizer.zero_grad()
        F.cross_entropy(model(images), targets).backward()
        strategy.reduce_gradients(model)
        optimizer.step()
    with torch.no_grad():
        masked = not torch.equal(model(images), model(images))
    weights = {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
        if _replicated(p)
    }
    return {"masked": masked, "weights": weights, "kept": torch.stack(kept)}


def _kept(out) -> torch.Tensor:
    """Which samples a row-wise drop path kept (a sequence shard of them too)."""
    local = out.to_local() if isinstance(out, DTensor) else out
    return local.detach().flatten(1).abs().amax(1) > 0


def _draws_after_sharing(rank: int, world: int) -> dict:
    """``torch.rand(4)`` of each rank, seeded apart, after share_random_state
    over tensor-parallel groups of ``world`` ranks, and of 1 (``world``
    data-parallel replicas)."""
    draws = {}
    for tp in (world, 1):
        torch.manual_seed(1 + rank)
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        share_random_state(mesh["tp"], torch.device("cpu"))
        draws[f"tp {tp}"] = torch.rand(4)
    return draws


def _on_two_ranks(rank: int, world: int, out_dir: str) -> dict:
    """Each part's result, or the traceback it raised (so that one failing
    part leaves the others' tests their answers): one step of each (arch,
    sequence parallel) pair of the test above, then the torchvision ViT's."""
    parts = {
        f"one step {arch}/{sp}": lambda arch=arch, sp=sp: _one_step(
            rank, world, arch, 1, sp
        )
        for arch in ARCHS
        for sp in SEQUENCE_PARALLEL
    }
    parts |= {
        "round trip": lambda: _whole_state_round_trip(rank, out_dir),
        "drop path": lambda: _drop_path_steps(rank, False),
        "drop path, sequence parallel": lambda: _drop_path_steps(rank, True),
        "drop path, ours": lambda: _drop_path_steps(rank, False, ours=True),
        "draws": lambda: _draws_after_sharing(rank, world),
    }
    return run_parts(parts)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One launch of 2 gloo ranks for the one-step tests above and the
    torchvision ViT tests below."""
    out = str(tmp_path_factory.mktemp("two_ranks"))
    return run_on_ranks(2, _on_two_ranks, (out,), out)


def _part(ranks: list[dict], name: str) -> list:
    """Each rank's result of one part; a part that raised fails the test."""
    for result in ranks:
        assert not isinstance(result[name], str), result[name]
    return [result[name] for result in ranks]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_tensor_parallel_torchvision_vit_saves_torchvision_keys(
    two_ranks,
):
    result = _part(two_ranks, "round trip")[0]
    plain = result["plain"]
    for whole in (result["whole"], result["read"]["model"]):
        assert whole.keys() == plain.keys()
        for key, value in plain.items():
            assert torch.equal(whole[key], value), key


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "part",
    ["drop path", "drop path, sequence parallel", "drop path, ours"],
    ids=["", "sequence-parallel", "vit_tiny_patch4"],
)
def test_replicated_vit_weights_stay_equal_under_tp_2_with_drop_path(two_ranks, part):
    first, second = _part(two_ranks, part)
    assert first["masked"] and second["masked"]  # the drop path drew masks
    # The ranks of a replica drop the same samples (under sequence parallelism
    # each holds other tokens of them), some and not all.
    assert torch.equal(first["kept"], second["kept"])
    assert first["kept"].any() and not first["kept"].all()
    assert first["weights"].keys() == second["weights"].keys()
    head = "head.weight" if part.endswith("ours") else "heads.head.weight"
    assert head in first["weights"]
    for key, value in first["weights"].items():
        assert torch.equal(second["weights"][key], value), key


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_ranks_draw_alike_and_replicas_apart(two_ranks):
    first, second = _part(two_ranks, "draws")
    assert torch.equal(first["tp 2"], second["tp 2"])
    assert not torch.equal(first["tp 1"], second["tp 1"])
