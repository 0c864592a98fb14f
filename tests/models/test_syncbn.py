"""CPU SyncBN and DDP equal one process over the global batch (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from helpers import run_on_ranks, strategy_for
from torch import nn

from distribuuuu.models.syncbn import GroupSyncBatchNorm

# Samples per rank: unequal on purpose.
SPLITS = {2: [4, 3], 3: [3, 2, 2]}


def _batchnorm_case(total: int):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(total, 5, 4, 3, generator=generator) * 3 + 1
    upstream = torch.randn(total, 5, 4, 3, generator=generator)  # dL/dy
    bn = nn.BatchNorm2d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=generator)
        bn.bias.uniform_(-1, 1, generator=generator)
    return x, upstream, bn


def _syncbn_rank(rank: int, world: int) -> dict:
    sizes = SPLITS[world]
    x, upstream, bn = _batchnorm_case(sum(sizes))
    start = sum(sizes[:rank])
    part = slice(start, start + sizes[rank])
    sync = GroupSyncBatchNorm.convert_sync_batchnorm(bn).train()
    x_part = x[part].clone().requires_grad_()
    y = sync(x_part)
    (y * upstream[part]).sum().backward()
    return {
        "y": y.detach(),
        "grad_x": x_part.grad,
        "grad_weight": sync.weight.grad,
        "grad_bias": sync.bias.grad,
        "running_mean": sync.running_mean,
        "running_var": sync.running_var,
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_syncbn_matches_batchnorm_over_the_global_batch(tmp_path, world):
    results = run_on_ranks(world, _syncbn_rank, (), tmp_path)
    x, upstream, bn = _batchnorm_case(sum(SPLITS[world]))
    x = x.clone().requires_grad_()
    y = bn.train()(x)
    (y * upstream).sum().backward()
    cat = lambda key: torch.cat([r[key] for r in results])  # noqa: E731
    torch.testing.assert_close(cat("y"), y.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cat("grad_x"), x.grad, rtol=1e-4, atol=1e-5)
    # Affine gradients are per rank; DDP sums (averages) them.
    for key, expected in (("grad_weight", bn.weight.grad), ("grad_bias", bn.bias.grad)):
        total = sum(r[key] for r in results)
        torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-5)
    for r in results:
        torch.testing.assert_close(r["running_mean"], bn.running_mean)
        torch.testing.assert_close(r["running_var"], bn.running_var)


def test_convert_and_revert_keep_state_dict_keys():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm1d(2))
    keys = list(model.state_dict())
    sync = GroupSyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(sync[1], GroupSyncBatchNorm)
    assert list(sync.state_dict()) == keys
    plain = GroupSyncBatchNorm.revert_sync_batchnorm(sync)
    assert type(plain[1]) is nn.BatchNorm2d and type(plain[2]) is nn.BatchNorm1d
    assert list(plain.state_dict()) == keys


def test_single_process_is_plain_batchnorm():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    sync = GroupSyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(3))
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(sync(x), bn(x))
    torch.testing.assert_close(sync.running_var, bn.running_var)


# ---- DDP with SyncBN on W ranks == one process with BatchNorm on the union ----

STEPS = 5


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _global_batches(per_step: list[list[int]]):
    generator = torch.Generator().manual_seed(1)
    for sizes in per_step:
        total = sum(sizes)
        yield (
            torch.randn(total, 3, 8, 8, generator=generator),
            torch.randint(0, 4, (total,), generator=generator),
            sizes,
        )


def _train(model, batches, rank: int | None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for images, labels, sizes in batches:
        if rank is not None:  # this rank's share of the global batch
            share = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            images, labels = images[share], labels[share]
        losses = nn.functional.cross_entropy(model(images), labels, reduction="sum")
        # DDP averages over ranks: scale so that it averages over samples.
        scale = len(sizes) if rank is not None else 1
        loss = losses * scale / sum(sizes)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    plain = model.module if hasattr(model, "module") else model
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


def _ddp_rank(rank: int, world: int, per_step) -> dict:
    model = strategy_for("ddp", syncbn=True).prepare_model(_cnn())
    assert any(isinstance(m, GroupSyncBatchNorm) for m in model.modules())
    return _train(model, _global_batches(per_step), rank)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "world, per_step",
    [
        (2, [[4, 4]] * STEPS),
        (3, [[3, 3, 3]] * (STEPS - 1) + [[3, 2, 2]]),  # unequal last batch
    ],
)
def test_ddp_with_syncbn_equals_one_process(tmp_path, world, per_step):
    results = run_on_ranks(world, _ddp_rank, (per_step,), tmp_path)
    expected = _train(_cnn(), _global_batches(per_step), None)
    for result in results:
        for key, value in expected.items():
            torch.testing.assert_close(
                result[key], value, rtol=1e-4, atol=1e-6, msg=f"{key} differs"
            )
