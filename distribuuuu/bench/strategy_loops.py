"""Each strategy's training loop beside the plain loop a user would write with
the same library, on 2 local gloo ranks, for tools/benchmark.py.

Ours is ``loop.train_epoch`` over the strategy that ``DIST.STRATEGY`` builds
(the run's model, optimizer, schedule, metrics and logging); the plain loops
get the same in-memory batches already normalised, as a loader of float
images would give them:

* ``ddp``: ``DistributedDataParallel``, forward, loss, backward, step;
* ``pipeline``: the model cut into 2 stages where ours cuts it, one
  ``torch.distributed.pipelining.PipelineStage`` each, ``Schedule1F1B`` over
  the run's micro-batches;
* ``deepspeed``: ``deepspeed.initialize`` with ZeRO stage 2 and the loop of
  its tutorials (``engine(x)``, ``engine.backward``, ``engine.step``).

The sides alternate repeat after repeat on both ranks in step (a barrier
before each); a figure is rank 0's img/s over the global batch.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from yacs.config import CfgNode

from distribuuuu.bench.baselines import InMemoryLoader, make_batches, minimal_train
from distribuuuu.bench.overheads import on_local_ranks, summarize
from distribuuuu.config import load_cfg
from distribuuuu.data import build_normalizer
from distribuuuu.dist import group as du
from distribuuuu.engine.loop import train_epoch
from distribuuuu.engine.specs import data_spec, loop_spec
from distribuuuu.engine.trainer import build_train_state
from distribuuuu.models import build_model
from distribuuuu.models.chains import (
    StagePart,
    balanced_bounds,
    model_chain,
    step_sizes,
)
from distribuuuu.reporting.writer import MetricsWriter

STRATEGIES = ("ddp", "pipeline", "deepspeed")


def _plain_ddp(cfg: CfgNode, loader) -> Callable[[], float]:
    model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
    if cfg.MODEL.CHANNELS_LAST:
        model = model.to(memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return minimal_train(model, loader, optimizer, None, torch.device("cpu"))


def _plain_pipeline(cfg: CfgNode, loader) -> Callable[[], float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
    steps = model_chain(model)
    cut = balanced_bounds(step_sizes(model, steps), 2)[1]
    mine = steps[:cut] if dist.get_rank() == 0 else steps[cut:]
    stage = StagePart(model, mine)
    if cfg.MODEL.CHANNELS_LAST:
        stage = stage.to(memory_format=torch.channels_last)
    pipe = PipelineStage(stage, dist.get_rank(), 2, torch.device("cpu"))
    micro = cfg.DIST.PIPELINE.MICROBATCHES or 4
    schedule = Schedule1F1B(pipe, micro, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)

    def repeat() -> float:
        for images, targets in loader:
            optimizer.zero_grad()
            if dist.get_rank() == 0:
                schedule.step(images)
            else:
                schedule.step(target=targets)
            optimizer.step()
        return len(loader) * len(images)

    return repeat


def _plain_deepspeed(cfg: CfgNode, loader) -> Callable[[], float]:
    import deepspeed

    model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = cfg.TRAIN.BATCH_SIZE
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "train_batch_size": batch * dist.get_world_size(),
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,  # torch's SGD, as ours
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )

    def repeat() -> float:
        for images, targets in loader:
            loss = F.cross_entropy(engine(images), targets)
            engine.backward(loss)
            engine.step()
            loss.item()
        return len(loader) * len(images)

    return repeat


PLAIN = {"ddp": _plain_ddp, "pipeline": _plain_pipeline, "deepspeed": _plain_deepspeed}


def _sides(cfg: CfgNode, steps: int, out_dir: str) -> tuple[dict, int]:
    """Ours and the plain loop of ``cfg``'s strategy, each a repeat of
    ``steps`` steps, and the images of a repeat (over all ranks)."""
    info = du.detect_launch()
    writer = MetricsWriter(out_dir, enabled=False)
    state, _, _ = build_train_state(cfg, info, torch.device("cpu"), writer)
    batches = make_batches(4, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.IM_SIZE, 10)
    normalize = build_normalizer(data_spec(cfg), torch.device("cpu"))
    floats = [(normalize(images), targets) for images, targets in batches]
    ours_loader = InMemoryLoader(batches, steps)

    def ours() -> None:
        state.progress.consumed = 0
        train_epoch(state, ours_loader, loop_spec(cfg))

    plain = PLAIN[cfg.DIST.STRATEGY](cfg, InMemoryLoader(floats, steps))
    return {"ours": ours, "plain": plain}, steps * state.plan.global_batch


def _timed(sides: dict, images: int, repeats: int) -> dict[str, list[float]]:
    """img/s of each side per repeat, the sides alternating, both ranks in
    step; the first repeat warms up and is dropped."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(1 + repeats):
        for name in list(sides)[:: 1 if repeat % 2 else -1]:
            dist.barrier()
            tic = time.perf_counter()
            sides[name]()
            dist.barrier()
            rates[name].append(images / (time.perf_counter() - tic))
    return {name: values[1:] for name, values in rates.items()}


def _on_rank(rank, ranks, port, opts, steps, repeats, out) -> None:
    launch = {"RANK": rank, "WORLD_SIZE": ranks, "LOCAL_RANK": rank}
    launch.update(LOCAL_WORLD_SIZE=ranks, MASTER_PORT=port, OMP_NUM_THREADS=1)
    os.environ.update({key: str(value) for key, value in launch.items()})
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    du.setup_distributed("gloo", "cpu")
    result = {}
    with tempfile.TemporaryDirectory() as work:
        for strategy in STRATEGIES:
            cfg = load_cfg(None, [*opts, "DIST.STRATEGY", strategy, "OUT_DIR", work])
            sides, images = _sides(cfg, steps, work)
            for name, rates in _timed(sides, images, repeats).items():
                result[f"{strategy}/{name}"] = rates
    if rank == 0:
        torch.save(result, out)
    du.cleanup_distributed()


def measure_loops(opts: list[str], steps: int, repeats: int) -> dict:
    """Per strategy: ours and the plain loop's img/s on 2 ranks, and the
    per-repeat ratio ours / plain (``opts``: the recipe's KEY VALUE words;
    ours logs once a repeat)."""
    # A large synthetic set (drawn lazily: the sides get in-memory batches)
    # that any batch per rank fits.
    opts = [*opts, "TRAIN.PRINT_FREQ", str(steps)]
    opts += ["DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", "[1048576, 64]"]
    with tempfile.TemporaryDirectory() as work:
        found = on_local_ranks(_on_rank, 2, (opts, steps, repeats), work)
    rows = {}
    for strategy in STRATEGIES:
        ours, plain = found[f"{strategy}/ours"], found[f"{strategy}/plain"]
        ratios = [a / b for a, b in zip(ours, plain)]
        rows[strategy] = {
            "ours": summarize(ours),
            "plain": summarize(plain),
            "ratio": summarize(ratios),
        }
    return rows


def format_loops(rows: dict) -> str:
    """One line per strategy: img/s of ours and of the plain loop, the ratio."""
    lines = ["strategy, 2 gloo ranks   ours img/s   plain img/s   ratio (min-max)"]
    for strategy, row in rows.items():
        ratio = row["ratio"]
        lines.append(
            f"  {strategy:<22} {row['ours']['median']:10.1f} "
            f"{row['plain']['median']:12.1f}   {ratio['median']:.3f} "
            f"({ratio['min']:.3f}-{ratio['max']:.3f})"
        )
    return "\n".join(lines)
