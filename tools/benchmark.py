#!/usr/bin/env python3
"""Throughput of distribuuuu beside the plain PyTorch code people would write.

    python tools/benchmark.py [--cfg FILE] [--model resnet18 --im-size 32 ...]
    python tools/benchmark.py --short          # seconds: the CI smoke test

Measurements, printed as a table and written as JSON (``--out``):

* train step: img/s of distribuuuu's training loop (``loop.train_epoch``:
  learning-rate schedule, loss, backward, optimizer, metrics, logging) beside
  a minimal loop (forward, loss, zero_grad, backward, step, ``loss.item()``
  every step) on the same model, batches and threads;
* data pipeline: img/s of our ImageFolder loader (decode and transforms in
  the workers, normalisation in this process) beside torchvision's ImageFolder
  with the classic PIL transforms, same workers and batch, on ImageNet-sized
  JPEGs that the tool writes first; ``ours`` is the default DATA.DECODER, and
  each of ``--decoders`` is measured in the same run, each with its ratio to
  torchvision's; this process runs on one torch thread for it; then, as a
  row of its own (prepared data, not the same pixels), our loader on those
  JPEGs written as shards with ``--max-side`` (``--data-max-side``) beside
  torchvision's on the original folder;
* eval: img/s of ``evaluation.evaluate`` beside a minimal no-grad loop;
* start-up: seconds of ``train_net.py --dry-run`` (build, a step, an eval batch)
  beside ``python -c "import torch, torchvision"``, and the difference;
* stop check: seconds of the ranks' agreement on a stop request (2 local gloo
  ranks), and its cost per training step with DIST.STOP_CHECK_STEPS, also as
  a share of the measured train step;
* ``--only`` rows outside the default set: ``scan`` (the listing of a 200 k-file
  split on 4 gloo ranks, bench.folder_scan), ``hooks`` (bytes all-reduced and
  seconds per DDP step with each DIST.DDP.COMM_HOOK, bench.comm_hooks),
  ``loops`` (ddp, pipeline and DeepSpeed beside plain loops on 2 gloo ranks,
  bench.strategy_loops), ``async`` (training blocked by a 503 MB save, at
  once and in the background, bench.async_save),
  ``pipeline`` (the bubble, bench.pipeline_bubble), ``plan`` (the planner
  against measurement, docs/planner.md: bench.plan_accuracy, plan_timing, and
  plan_links across two namespaced nodes, root only).

The two sides of a measurement alternate, repeat after repeat (the first
side changes every repeat), so that load from other processes on the machine
hits both alike.  Each figure is the median over the repeats with the
slowest and fastest repeat beside it; a ratio is the median of the
per-repeat ratios.  Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torchvision

from distribuuuu.bench.async_save import measure_async_save
from distribuuuu.bench.baselines import (
    InMemoryLoader,
    make_batches,
    minimal_eval,
    minimal_train,
)
from distribuuuu.bench.comm_hooks import measure_comm_hooks
from distribuuuu.bench.data_throughput import capped_shard_sides, data_pipeline_sides
from distribuuuu.bench.folder_scan import measure_folder_scan
from distribuuuu.bench.overheads import (
    measure_startup,
    stop_check_cost,
    summarize,
)
from distribuuuu.bench.pipeline_bubble import measure_bubble
from distribuuuu.bench.plan_accuracy import plan_accuracy
from distribuuuu.bench.plan_links import plan_links
from distribuuuu.bench.plan_timing import measure_plan_timing
from distribuuuu.bench.strategy_loops import measure_loops
from distribuuuu.bench.table import format_table
from distribuuuu.config import load_cfg
from distribuuuu.data import build_normalizer
from distribuuuu.data.spec import DataSpec, LoaderSpec
from distribuuuu.dist.group import LaunchInfo
from distribuuuu.engine.evaluation import evaluate
from distribuuuu.engine.loop import train_epoch
from distribuuuu.engine.specs import (
    data_spec,
    eval_spec,
    loader_spec,
    loop_spec,
    optimizer_spec,
    run_precision,
)
from distribuuuu.engine.trainer import build_train_state
from distribuuuu.logger import PACKAGE_LOGGER, setup_logging
from distribuuuu.models import build_model
from distribuuuu.optim import build as optim
from distribuuuu.reporting.writer import MetricsWriter

TRAIN_NET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_net.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="benchmark.py", description="Measure distribuuuu's throughput."
    )
    add = parser.add_argument
    add("--cfg", default="", help="recipe to measure (default: the embedded one)")
    add("--model", default="", help="MODEL.ARCH (default: the recipe's)")
    add("--im-size", type=int, default=0, help="training crop of the train step")
    add("--batch", type=int, default=0, help="images per step (default: recipe's)")
    add("--steps", type=int, default=20, help="training steps per repeat")
    add("--repeats", type=int, default=5, help="repeats of every measurement")
    add("--precision", default="", help="TRAIN.MIXED_PRECISION: auto|none|bf16|fp16")
    add(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MODEL.CHANNELS_LAST (default: the recipe's)",
    )
    add("--compile", action="store_true", help="torch.compile both models")
    add("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    add("--ranks", type=int, default=1, help="processes of the start-up run")
    add("--workers", type=int, default=2, help="data loader workers")
    add("--data-images", type=int, default=1024, help="JPEGs in the data folder")
    add("--data-im-size", type=int, default=224, help="crop of the data pipeline")
    add("--data-batch", type=int, default=32, help="batch of the data pipeline")
    add("--data-max-side", type=int, default=256,
        help="prepared-data row: shards with this --max-side (0: none)")  # fmt: skip
    add("--decoders", default="tensor,pil", help="other DATA.DECODERs ('': none)")
    add("--only", default="train,data,eval,startup,stop", help="+hooks,loops,...")
    add("--scan-files", type=int, default=200_000, help="files of the scan row")
    add("--short", action="store_true", help="tiny sizes, 2 repeats (smoke test)")
    add("--out", default="benchmark.json", help="JSON file to write")
    args = parser.parse_args(argv)
    if args.short:
        args.steps, args.repeats, args.data_images = 3, 2, 16
        args.data_im_size, args.data_batch, args.scan_files = 64, 8, 2000
    return args


def interleave(sides: dict[str, Callable[[], int]], repeats: int) -> dict:
    """Run each side once per repeat, in order, then in reverse order, and so on.

    A side returns the number of images it processed.  Returns each side's
    img/s summary and the summary of the per-repeat ratio of the first side
    to the last (with more than two sides, ``"ratios"`` holds that of every
    side but the last to the last); under ``"cpu"`` the same from the CPU time
    of this process and its child processes (:func:`cpu_seconds`), which
    other programs on a busy machine disturb far less than the wall clock.
    """
    names = list(sides)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            tic, cpu_tic = time.perf_counter(), cpu_seconds()
            images = sides[name]()
            wall[name].append(images / (time.perf_counter() - tic))
            cpu[name].append(images / max(cpu_seconds() - cpu_tic, 1e-9))
    result = _compare(wall)
    result["cpu"] = _compare(cpu)
    return result


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its child processes.

    The children are the data loader workers: those alive are read from
    ``/proc`` (Linux; elsewhere only this process counts), those ended and
    reaped (workers that do not persist end with each epoch) from
    ``getrusage``.  A worker ending between two readings moves from the
    first count to the second whole, so differences stay right.
    """
    total, me = time.process_time(), os.getpid()
    try:  # Unix
        import resource
    except ImportError:
        pass
    else:
        ended = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += ended.ru_utime + ended.ru_stime
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == me:  # fields: state, ppid, ..., utime (12), stime (13)
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _compare(runs: dict[str, list[float]]) -> dict:
    """Summaries of each side's runs and of the paired ratios to the last side."""
    result = {name: summarize(values) for name, values in runs.items()}
    *names, last = runs

    def ratio(name: str) -> dict:
        return summarize([a / b for a, b in zip(runs[name], runs[last])])

    result["ratio"] = ratio(names[0])
    if len(names) > 1:
        result["ratios"] = {name: ratio(name) for name in names}
    return result


def recipe_opts(args: argparse.Namespace) -> list[str]:
    """KEY VALUE words of the measured recipe on synthetic data (every side,
    and the start-up run)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    opts = ["DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", "[64, 64]"]
    opts += ["DEVICE", device]
    if args.model:
        opts += ["MODEL.ARCH", args.model]
    if args.im_size:
        opts += ["TRAIN.IM_SIZE", str(args.im_size), "TEST.IM_SIZE", str(args.im_size)]
    if args.batch:
        opts += [
            "TRAIN.BATCH_SIZE",
            str(args.batch),
            "TEST.BATCH_SIZE",
            str(args.batch),
        ]
    if args.precision:
        opts += ["TRAIN.MIXED_PRECISION", args.precision]
    if args.channels_last is not None:
        opts += ["MODEL.CHANNELS_LAST", str(args.channels_last)]
    return opts


def bench_cfg(args: argparse.Namespace, out_dir: str):
    """The frozen cfg of the measured recipe on synthetic data."""
    return load_cfg(args.cfg or None, [*recipe_opts(args), "OUT_DIR", out_dir])


@contextlib.contextmanager
def quiet_run(cfg) -> Iterator:
    """A one-process training run of ``cfg`` that logs to OUT_DIR/log.txt only."""
    setup_logging(cfg.OUT_DIR, 0)
    package_logger = logging.getLogger(PACKAGE_LOGGER)
    for handler in list(package_logger.handlers):
        if not isinstance(handler, logging.FileHandler):
            package_logger.removeHandler(handler)
    info = LaunchInfo(
        launcher="none",
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=0,
    )
    device = torch.device(cfg.DEVICE)
    writer = MetricsWriter(cfg.OUT_DIR, enabled=False)
    try:
        state, _, _ = build_train_state(cfg, info, device, writer)
        yield state
    finally:
        setup_logging(None, 1)  # closes the log file; no handler is left


def bench_train_and_eval(args: argparse.Namespace, cfg, what: set[str]) -> dict:
    """The train-step and eval measurements (ours beside minimal)."""
    results: dict = {}
    classes, batch = cfg.MODEL.NUM_CLASSES, cfg.TRAIN.BATCH_SIZE
    batches = make_batches(4, batch, cfg.TRAIN.IM_SIZE, classes)
    loader = InMemoryLoader(batches, args.steps)
    # The minimal loops get the batches normalised beforehand, as a loader of
    # float images would give them; ours normalises them in its step.
    normalize = build_normalizer(data_spec(cfg), torch.device("cpu"))
    floats = [(normalize(images), targets) for images, targets in batches]
    float_loader = InMemoryLoader(floats, args.steps)
    with quiet_run(cfg) as state:
        device = state.device
        plain = build_model(cfg.MODEL.ARCH, classes).to(device)
        if cfg.MODEL.CHANNELS_LAST:
            plain = plain.to(memory_format=torch.channels_last)
        amp_dtype = state.amp_dtype
        if args.compile:
            state.model = torch.compile(state.model)
            # torch types compile()'s result as a callable: of a module, it is
            # a module (an OptimizedModule).
            plain = torch.compile(plain)  # type: ignore[assignment]
        spec = eval_spec(cfg, device, state.normalize, amp_dtype)
        spec = dataclasses.replace(spec, print_freq=10**9)

        def ours_train() -> int:
            state.progress.consumed = 0
            train_epoch(state, loader, loop_spec(cfg))
            return args.steps * batch

        def ours_eval() -> int:
            evaluate(state.strategy.eval_model(state.model), loader, spec)
            return args.steps * batch

        if "train" in what:
            # The recipe's optimizer: the comparison measures the framework.
            recipe = optimizer_spec(cfg)
            groups = optim.build_param_groups(plain, recipe)
            optimizer = optim.OPTIMIZERS[recipe.name](groups, recipe)
            minimal = minimal_train(plain, float_loader, optimizer, amp_dtype, device)
            sides = {"ours": ours_train, "minimal": minimal}
            interleave(sides, 1)  # warm-up: allocator, caches, compilation
            results["train_step"] = interleave(sides, args.repeats)
        if "eval" in what:
            minimal = minimal_eval(plain, float_loader, amp_dtype, device)
            sides = {"ours": ours_eval, "minimal": minimal}
            interleave(sides, 1)
            results["eval"] = interleave(sides, args.repeats)
    return results


def loader_specs(
    root: str, im_size: int, workers: int, decoder: str = "", shards: str = ""
) -> tuple[DataSpec, LoaderSpec]:
    """The data set's and the loaders' specs of our training loader of the
    folder ``root``/train (or of the WebDataset ``shards`` pattern), as a run
    loads them on the CPU (DATA.DECODER ``decoder``, or the default)."""
    if shards:
        opts = ["DATA.NAME", "webdataset", "TRAIN.DATASET", shards]
        opts += ["TEST.DATASET", shards]
    else:
        opts = ["DATA.NAME", "imagefolder", "TRAIN.DATASET", root]
        opts += ["TEST.DATASET", root]
    opts += ["DATA.DECODER", decoder] if decoder else []
    opts += ["TRAIN.IM_SIZE", str(im_size), "TEST.IM_SIZE", str(im_size)]
    opts += ["TRAIN.WORKERS", str(workers), "MODEL.NUM_CLASSES", "2"]
    cfg = load_cfg(None, opts + ["TEST.SPLIT", "train", "DEVICE", "cpu"])
    return data_spec(cfg), loader_spec(cfg)


def bench_data(args: argparse.Namespace, work_dir: str) -> dict:
    """The data-pipeline measurement: img/s of one epoch of each loader, ours
    with the default decoder and with each of ``--decoders`` (see
    :mod:`distribuuuu.bench.data_throughput`)."""
    decoders = [name for name in args.decoders.split(",") if name]
    sizes = (args.data_images, args.data_im_size, args.data_batch, args.workers)
    root = os.path.join(work_dir, "jpegs")
    specs_of = functools.partial(loader_specs, root, args.data_im_size, args.workers)
    threads = torch.get_num_threads()
    # This process only normalises the workers' batches (a run does it among
    # the model's work): one thread, as in each worker, so that no idle
    # thread pool spins beside the workers.
    torch.set_num_threads(1)
    try:
        sides = data_pipeline_sides(root, *sizes, decoders, specs_of=specs_of)
        interleave(sides, 1)  # starts the persistent workers
        result = interleave(sides, args.repeats)
        if args.data_max_side:
            prepared = capped_shard_sides(
                root, *sizes[1:], args.data_max_side, specs_of=specs_of
            )
            interleave(prepared, 1)
            result["prepared"] = interleave(prepared, args.repeats)
    finally:
        torch.set_num_threads(threads)
    return result


WORKERS_RUN = "dry run, 2 workers"


def bench_startup(args: argparse.Namespace, work_dir: str) -> dict:
    """Seconds of ``train_net.py --dry-run`` of the recipe, launch to exit,
    beside the bare imports of torch and torchvision."""
    cmd = [sys.executable, TRAIN_NET, "--dry-run", "--num-procs", str(args.ranks)]
    cmd += ["--cfg", args.cfg] if args.cfg else []
    cmd += [*recipe_opts(args), "OUT_DIR", os.path.join(work_dir, "startup")]
    env = dict(os.environ)
    if args.threads:  # torch reads it at start-up for its thread pool
        env["OMP_NUM_THREADS"] = str(args.threads)
    repeats = 1 if args.short else args.repeats
    # Loader workers come from a fork server started at launch (its imports
    # overlap the build): the second row is what they add.
    runs = {"dry run": cmd, WORKERS_RUN: [*cmd, "TRAIN.WORKERS", "2"]}
    return {**measure_startup(runs, env, repeats), "ranks": args.ranks}


def measure_more(args: argparse.Namespace, cfg, what: set[str]) -> dict:
    """The rows outside the default set that ``what`` names."""
    results: dict = {}
    if "scan" in what:
        results["folder_scan"] = measure_folder_scan(args.scan_files, 4, args.repeats)
    if "hooks" in what:
        shape = (cfg.MODEL.ARCH, cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE)
        results["comm_hooks"] = measure_comm_hooks(*shape, args.repeats)
    if "loops" in what:
        results["loops"] = measure_loops(recipe_opts(args), args.steps, args.repeats)
    if "pipeline" in what:
        results["pipeline"] = measure_bubble(repeats=args.repeats)
    if "async" in what:
        results["async_save"] = measure_async_save(512, min(args.repeats, 5))
    if "plan" in what:
        results["plan_memory"] = plan_accuracy(worlds=(2,) if args.short else (2, 4))
        results["plan_timing"] = measure_plan_timing(rounds=3 if args.short else 9)
        results["plan_links"] = plan_links()
    return results


def main(argv: list[str] | None = None) -> dict:
    """Run the measurements, print the table, write the JSON; return the results."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    what = set(args.only.split(","))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="distribuuuu-bench-") as work_dir:
        cfg = bench_cfg(args, work_dir)
        precision = cfg.TRAIN.MIXED_PRECISION
        if what & {"train", "eval"}:
            results.update(bench_train_and_eval(args, cfg, what))
            precision = run_precision(cfg, torch.device(cfg.DEVICE))  # as it ran
        if "data" in what:
            results["data_pipeline"] = bench_data(args, work_dir)
        if "startup" in what:
            results["startup"] = bench_startup(args, work_dir)
        if "stop" in what:
            step_s = None  # ours, in one process
            if "train_step" in results:
                step_s = cfg.TRAIN.BATCH_SIZE / results["train_step"]["ours"]["median"]
            results["stop_check"] = stop_check_cost(
                cfg.DIST.STOP_CHECK_STEPS, step_s, args.short, args.repeats
            )
    results.update(measure_more(args, cfg, what))
    report = {
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "model": cfg.MODEL.ARCH,
            "im_size": cfg.TRAIN.IM_SIZE,
            "batch": cfg.TRAIN.BATCH_SIZE,
            "precision": precision,
            "threads": torch.get_num_threads(),
            "device": cfg.DEVICE,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
        },
        "results": results,
    }
    print(format_table(results))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
