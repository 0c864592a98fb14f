"""HSDP (``DIST.STRATEGY hsdp``) on 4 gloo ranks as 2 nodes x 2: a 2-D mesh
that shards within a node and replicates across nodes, equal to DDP, with
checkpoints that other strategies resume and that resume bitwise after
SIGKILL; a shard size that cannot work is refused before anything starts."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    refused,
    run_on_ranks,
    run_parts,
    sigkill_then_rerun_matches_uninterrupted,
    strategy_for,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import SavedRun
from distribuuuu.models import build_model
from distribuuuu.strategies.hsdp import HSDPStrategy
from distribuuuu.strategies.spec import StrategySpec

STEPS, BATCH = 4, 6  # optimizer steps of one epoch; samples per rank per step
ARCH = "lenet5"
LAST = "classifier.4.weight"  # lenet5's last layer
# Each run's strategy and its DIST keys (HSDP's shard size: 0, the processes
# per node, which the launch says are 2 here).
RUNS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "hsdp": ("hsdp", {}),
    "hsdp_offload": ("hsdp", {"FSDP_CPU_OFFLOAD": True}),
}


def _prepared(name: str, **keys) -> tuple:
    """Strategy, model (seed 0, prepared) and SGD with momentum over it."""
    strategy = strategy_for(name, **keys)
    torch.manual_seed(0)
    model = strategy.prepare_model(build_model(ARCH, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return strategy, model, optimizer


def _train_one_epoch(rank: int, world: int, name: str, **keys) -> tuple:
    """One epoch of :data:`STEPS` steps, each rank on its part of the batch."""
    strategy, model, optimizer = _prepared(name, **keys)
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        images = torch.randn(world * BATCH, 3, 28, 28, generator=generator)
        targets = torch.randint(0, 10, (world * BATCH,), generator=generator)
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        F.cross_entropy(model(images[part]), targets[part]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return strategy, model, optimizer


def _whole(strategy, model, optimizer) -> dict:
    """The whole model and its SGD momentum by parameter name (collectives:
    rank 0 gets them, sharded strategies give the other ranks nothing)."""
    names = [name for name, _ in build_model(ARCH, 10).named_parameters()]
    state = strategy.optimizer_state_dict(model, optimizer).get("state", {})
    return {
        "model": strategy.model_state_dict(model),
        "momentum": {
            key if isinstance(key, str) else names[key]: value["momentum_buffer"]
            for key, value in state.items()
        },
    }


def _mesh_of(model) -> dict:
    """How this rank holds the HSDP model's parameters."""
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    mesh = first.device_mesh
    # The parameter groups of FSDP's modules (torch's private state).
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [state._fsdp_param_group for state in states if state._fsdp_param_group]
    return {
        "dtensors": all(isinstance(p, DTensor) for p in params.values()),
        "placements": {tuple(p.placements) for p in params.values()},
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "shard_group": dist.get_process_group_ranks(mesh["shard"].get_group()),
        "replica_group": dist.get_process_group_ranks(mesh["replicate"].get_group()),
        "local_rows": {n: p.to_local().shape[0] for n, p in params.items()},
        "offload": {type(group.offload_policy).__name__ for group in groups},
    }


def _resumed(saved: SavedRun, name: str, **keys) -> dict:
    """A fresh model and optimizer of strategy ``name`` after loading ``saved``."""
    strategy, model, optimizer = _prepared(name, **keys)
    strategy.load_weights(model, optimizer, saved, None)
    return _whole(strategy, model, optimizer)


def _saved(run: tuple, out: str, name: str) -> SavedRun:
    """``run``'s model and optimizer saved as training checkpoint ``name``
    (its entries only; rank 0 writes the file that names the shards)."""
    strategy, model, optimizer = run
    writer = cp.CheckpointWriter(out)
    entries = strategy.save_weights(model, optimizer, None, writer, name)
    path = os.path.join(out, "checkpoints", f"{name}.pth")
    if dist.get_rank() == 0:
        torch.save(entries, path)
    dist.barrier()
    return SavedRun(path, entries)


def _on_four_ranks(rank: int, world: int, out: str) -> dict:
    """Every run of :data:`RUNS`, the HSDP model's mesh, and checkpoints
    exchanged between the strategies, in one process group that a launch of
    2 nodes x 2 processes would start.  A part that raised keeps its
    traceback (its tests fail with it, the others get their answers)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    runs = {}
    for key, (name, keys) in RUNS.items():
        runs[key] = _train_one_epoch(rank, world, name, **keys)
    parts = {
        "trained": lambda: {key: _whole(*run) for key, run in runs.items()},
        "mesh": lambda: {
            key: _mesh_of(runs[key][1]) for key in ("hsdp", "hsdp_offload")
        },
        "resumed": lambda: {
            # HSDP's shards into FSDP's and into whole DDP replicas; FSDP's
            # shards and DDP's whole state into HSDP.
            "hsdp->fsdp": _resumed(_saved(runs["hsdp"], out, "ckpt_ep_0001"), "fsdp"),
            "hsdp->ddp": _resumed(_saved(runs["hsdp"], out, "ckpt_ep_0002"), "ddp"),
            "fsdp->hsdp": _resumed(_saved(runs["fsdp"], out, "ckpt_ep_0003"), "hsdp"),
            "ddp->hsdp": _resumed(_saved(runs["ddp"], out, "ckpt_ep_0004"), "hsdp"),
        },
    }
    return run_parts(parts)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of :func:`_on_four_ranks`: one launch of 4 ranks."""
    out = tmp_path_factory.mktemp("hsdp")
    return run_on_ranks(4, _on_four_ranks, (str(out),), str(out))


def _part(ranks: list[dict], name: str) -> list:
    """Each rank's result of one part; a part that raised fails the test."""
    for result in ranks:
        assert not isinstance(result[name], str), result[name]
    return [result[name] for result in ranks]


def _assert_same(actual: dict, expected: dict, exact: bool) -> None:
    """Equal models and momentum, bitwise or to 1e-5."""
    for part in ("model", "momentum"):
        assert actual[part].keys() == expected[part].keys(), part
        for key, value in expected[part].items():
            if exact:
                assert torch.equal(actual[part][key], value), key
            else:
                torch.testing.assert_close(
                    actual[part][key], value, rtol=1e-5, atol=1e-5, msg=key
                )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("run", ["hsdp", "hsdp_offload"])
def test_hsdp_2x2_ends_the_epoch_where_ddp_does(four_ranks, run):
    """lenet5 (no BatchNorm): the same weights and momentum after one epoch,
    with and without DIST.FSDP_CPU_OFFLOAD."""
    trained = _part(four_ranks, "trained")[0]
    _assert_same(trained[run], trained["ddp"], exact=False)
    torch.manual_seed(0)
    first = build_model(ARCH, 10).state_dict()
    assert not torch.equal(trained[run]["model"][LAST], first[LAST])


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_mesh_is_2d_sharding_within_a_node_replicating_across(four_ranks):
    meshes = _part(four_ranks, "mesh")
    whole = {name: p.shape[0] for name, p in build_model(ARCH, 10).named_parameters()}
    for rank, mesh in enumerate(meshes):
        hsdp = mesh["hsdp"]
        assert hsdp["dtensors"]
        assert hsdp["placements"] == {(Replicate(), Shard(0))}
        assert hsdp["names"] == ("replicate", "shard")
        assert hsdp["shape"] == (2, 2)
        # Node n holds ranks 2n and 2n + 1: they shard; node 0's rank i
        # replicates node 1's rank i.
        assert hsdp["shard_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert hsdp["replica_group"] == [rank % 2, rank % 2 + 2]
        # Each rank holds its half of every parameter (rows split in two).
        for name, rows in whole.items():
            half = -(-rows // 2) if rank % 2 == 0 else rows // 2
            assert hsdp["local_rows"][name] == half, name
        assert hsdp["offload"] == {"OffloadPolicy"}
        assert mesh["hsdp_offload"]["offload"] == {"CPUOffloadPolicy"}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "moved, source",
    [
        ("hsdp->fsdp", "hsdp"),
        ("hsdp->ddp", "hsdp"),
        ("fsdp->hsdp", "fsdp"),
        ("ddp->hsdp", "ddp"),
    ],
)
def test_checkpoints_move_between_hsdp_fsdp_and_ddp(four_ranks, moved, source):
    """A checkpoint of one strategy loads under the other bitwise: DCP
    re-shards HSDP's shards for FSDP's 1-D mesh and reads them whole for
    DDP, and the other way round."""
    resumed = _part(four_ranks, "resumed")[0][moved]
    _assert_same(resumed, _part(four_ranks, "trained")[0][source], exact=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_hsdp_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """2 replicas x 1 shard on 2 ranks of 32 images (2,560 images make 40
    steps of 64): the ranks' own BatchNorm statistics and the replicated
    shards go through DCP; 4 ranks would double the time on 2 cores, and the
    2 x 2 layout's checkpoints are moved bitwise above."""
    hsdp = ("DIST.STRATEGY", "hsdp", "DIST.HSDP.SHARD_SIZE", "1")
    hsdp += ("TRAIN.BATCH_SIZE", "32")
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, hsdp)


def test_shard_groups_are_the_nodes_unless_a_size_is_given():
    """8 processes, 4 per node: 2 replicas x 4 shards; SHARD_SIZE 2 makes
    4 x 2.  Every rank reads its own batches (8 data-parallel readers)."""
    per_node = StrategySpec(name="hsdp", local_world_size=4)
    dims = HSDPStrategy.parallel_dims(per_node, 8)
    assert dims.axes == (("replicate", 2), ("shard", 4))
    assert HSDPStrategy.replicas(per_node, 8) == 8
    asked = dataclasses.replace(per_node, hsdp_shard_size=2)
    assert HSDPStrategy.parallel_dims(asked, 8).axes == (("replicate", 4), ("shard", 2))


HSDP = ["DIST.STRATEGY", "hsdp"]
# A launch of 4 processes, 3 of them on this node (srun -n 4 placing 3 + 1).
UNEVEN_NODES = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
UNEVEN_NODES["LOCAL_WORLD_SIZE"] = "3"


@pytest.mark.parametrize(
    "args, env, error",
    [
        (
            ["--num-procs", "4", *HSDP, "DIST.HSDP.SHARD_SIZE", "3"],
            {},
            "DIST.HSDP.SHARD_SIZE: shard groups of 3 processes do not divide the "
            "world size 4; give a divisor of 4 (0 = the processes per node",
        ),
        (
            [*HSDP, "DIST.HSDP.SHARD_SIZE", "0"],
            UNEVEN_NODES,
            "DIST.HSDP.SHARD_SIZE: shard groups of 3 processes do not divide the "
            "world size 4",
        ),
        (
            [*HSDP, "DIST.HSDP.SHARD_SIZE", "-2"],
            {},
            "DIST.HSDP.SHARD_SIZE -2 is invalid: must be >= 0 (0 = the processes "
            "per node)",
        ),
        (
            [*HSDP, "MODEL.ARCH", "vit_tiny_patch4", "DIST.TENSOR_PARALLEL", "2"],
            {},
            "DIST.STRATEGY 'hsdp' is invalid: cannot be combined with "
            "DIST.TENSOR_PARALLEL > 1",
        ),
    ],
    ids=["not-a-divisor", "uneven-nodes", "negative", "tensor-parallel"],
)
def test_a_shard_size_that_cannot_work_is_refused_before_anything_starts(
    tmp_path, monkeypatch, args, env, error
):
    """Exit 2 with one error line, before OUT_DIR is made or a process starts."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert error in refused(str(tmp_path / "out"), *args)
