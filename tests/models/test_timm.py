"""timm's models through the registry, on timm's own tiny test architectures:
they learn the digits and resume bitwise, FSDP shards them one unit per timm
block on 2 ranks and reaches the one-process step, activation checkpointing
recomputes them to the same gradients; plain names torchvision lacks are
timm's, and without timm such a name is refused naming the extra."""

from __future__ import annotations

import copy
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_ok,
    read_metrics,
    refused,
    run_on_ranks,
    strategy_for,
    train_net,
)

from distribuuuu.checkpoint import load_full
from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import model_spec
from distribuuuu.inference.read import KIND_STATE_DICT, Checkpoint, inference_cfg
from distribuuuu.models import (
    build_configured,
    build_model,
    find_blocks,
    model_library,
)
from distribuuuu.models.recompute import enable_activation_checkpointing

timm = pytest.importorskip("timm")

# One epoch of timm's 0.1 M-parameter EfficientNet on the embedded digits
# (62 steps of 64), its blocks recomputed, a checkpoint every 20 steps, all kept.
RUN = [
    "MODEL.ARCH",
    "timm/test_efficientnet",
    "MODEL.ACT_CKPT",
    "True",
    "OPTIM.MAX_EPOCH",
    "1",
    "TRAIN.PRINT_FREQ",
    "20",
    "CHECKPOINT.PERIOD_ITERS",
    "20",
    "CHECKPOINT.KEEP",
    "0",
]
# timm's test models: a ViT (LayerNorm), an EfficientNet and a ByobNet
# (BatchNorm); the ViT's position embedding made for 32 px.
TINY = {
    "test_vit": {"img_size": 32},
    "test_efficientnet": {},
    "test_byobnet": {},
}


def _tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(f"timm/{arch}", 10, **TINY[arch])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, str]:
    """OUT_DIR and stdout of the one-epoch run of RUN."""
    out = str(tmp_path_factory.mktemp("timm_run"))
    result = train_net(*RUN, "OUT_DIR", out)
    assert_ok(result)
    return out, result.stdout


@pytest.mark.slow
def test_a_timm_model_learns_the_digits(trained):
    out, stdout = trained
    assert "model: timm/test_efficientnet built by timm" in stdout
    assert "activation checkpointing: 5 blocks recompute" in stdout
    losses = [r["loss"] for r in read_metrics(out, "train")]
    assert losses[-1] < 0.7 * losses[0]
    assert read_metrics(out, "val")[-1]["top1"] > 50  # chance: 10


@pytest.mark.slow
def test_a_timm_model_resumes_bitwise(trained, tmp_path):
    """Rerun from the step-20 checkpoint alone: the end is bitwise the end of
    the uninterrupted run."""
    out, _ = trained
    name = "ckpt_ep_0000_it_0020.pth"
    os.makedirs(tmp_path / "checkpoints")
    shutil.copy(os.path.join(out, "checkpoints", name), tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "last").write_text(name)
    rerun = train_net(*RUN, "OUT_DIR", str(tmp_path))
    assert_ok(rerun)
    assert "resumed from" in rerun.stdout
    expected = load_full(os.path.join(out, "checkpoints", "ckpt_ep_0001.pth"))
    actual = load_full(str(tmp_path / "checkpoints" / "ckpt_ep_0001.pth"))
    assert expected["model"].keys() == actual["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(value, actual["model"][key]), key


def _fsdp_step(rank: int, world: int) -> dict:
    """Each tiny model sharded by the FSDP strategy: its units, and the
    parameters after one SGD step on this rank's half of a batch."""
    from torch.distributed.fsdp import FSDPModule

    results = {}
    for arch in TINY:
        model = _tiny(arch)
        names = {id(m): n for n, m in model.named_modules()}
        blocks = [(names[id(b)], type(b).__name__) for b in find_blocks(model)]
        spread = strategy_for("fsdp")
        model = spread.prepare_model(model)
        units = [
            (name, type(module).__name__)
            for name, module in model.named_modules()
            if isinstance(module, FSDPModule)
        ]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(1)
        images = torch.randn(8, 3, 32, 32, generator=generator)
        targets = torch.randint(0, 10, (8,), generator=generator)
        half = slice(rank * 4, rank * 4 + 4)
        F.cross_entropy(model(images[half]), targets[half]).backward()
        optimizer.step()
        results[arch] = {
            "blocks": blocks,
            "units": units,
            "state": spread.model_state_dict(model),
        }
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_shards_timm_models_one_unit_per_block(tmp_path):
    results = run_on_ranks(2, _fsdp_step, (), str(tmp_path))[0]
    for arch, result in results.items():
        plain = _tiny(arch)
        blocks = result["blocks"]
        # Every repeated block of timm's model is found: the ViT's depth, the
        # EfficientNet's and ByobNet's one block per stage.
        stages = plain.blocks if hasattr(plain, "blocks") else plain.stages
        assert len(blocks) == sum(
            len(s) if isinstance(s, torch.nn.Sequential) else 1 for s in stages
        )
        assert len({cls for _, cls in blocks}) > 1 or arch == "test_vit"
        # FSDP's units are those blocks, each its own class, plus the root.
        root = ("", "FSDP" + type(plain).__name__)
        assert result["units"] == [root] + [(n, "FSDP" + c) for n, c in blocks]
        if arch == "test_vit":  # no BatchNorm: the step of the whole batch
            optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
            generator = torch.Generator().manual_seed(1)
            images = torch.randn(8, 3, 32, 32, generator=generator)
            targets = torch.randint(0, 10, (8,), generator=generator)
            F.cross_entropy(plain(images), targets).backward()
            optimizer.step()
            for key, value in plain.state_dict().items():
                torch.testing.assert_close(
                    result["state"][key], value, rtol=1e-5, atol=1e-6
                )


@pytest.mark.parametrize("arch", list(TINY))
def test_activation_checkpointing_of_timm_blocks_gives_the_same_gradients(arch):
    """MODEL.ACT_CKPT's recomputation: every block runs its forward twice,
    the gradients and BatchNorm statistics are those of a plain step."""
    plain = _tiny(arch)
    recomputed = copy.deepcopy(plain)
    blocks = find_blocks(recomputed)
    assert enable_activation_checkpointing(recomputed) == len(blocks) > 0
    calls = []
    layers = torch.nn.Conv2d | torch.nn.Linear
    inner = next(m for m in blocks[0].modules() if isinstance(m, layers))
    inner.register_forward_hook(lambda *_: calls.append(1))
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([0, 1, 2, 3])
    for model in (plain, recomputed):
        F.cross_entropy(model(images), targets).backward()
    assert len(calls) == 2  # the forward pass, then the recomputation
    gradients = {n: p.grad for n, p in recomputed.named_parameters()}
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(gradients[name], parameter.grad, rtol=0, atol=0)
    buffers = dict(recomputed.named_buffers())
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffers[name], buffer), name


def test_plain_names_torchvision_lacks_are_timm_models():
    assert model_library("regnetx_160") == "timm"
    assert model_library("resnet50") == "torchvision"  # both have it
    assert model_library("timm/resnet50") == "timm"
    assert model_library("botnet50") == "distribuuuu"
    model = build_model("resnet10t", 3)  # timm's only
    assert type(model).__module__ == "timm.models.resnet"
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    # The regularisation keys reach it through timm's own arguments.
    cfg = load_cfg(None, ["MODEL.ARCH", "resnet10t", "MODEL.DROP_PATH", "0.1",
                          "MODEL.DROPOUT", "0.3"])  # fmt: skip
    model = build_configured(model_spec(cfg))
    assert model.drop_rate == 0.3
    assert any(type(m).__name__ == "DropPath" for m in model.modules())


def test_without_timm_a_timm_name_is_refused_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm fails
    out = str(tmp_path / "out")
    for arch in ("regnetx_160", "timm/resnet10t"):
        line = refused(out, "MODEL.ARCH", arch)
        assert f"MODEL.ARCH {arch!r}" in line
        assert "pip install 'distribuuuu[timm]'" in line
    assert "did you mean resnet18?" in refused(out, "MODEL.ARCH", "resnet181")
    # The tools, given the weights of a timm model (predict, export, ...)
    weights = Checkpoint("w.pth", KIND_STATE_DICT, {}, {})
    with pytest.raises(ValueError, match=r"not installed: pip install 'distribu"):
        inference_cfg(weights, opts=["MODEL.ARCH", "regnetx_160"])
