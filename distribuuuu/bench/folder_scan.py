"""The listing of an image folder at start-up, for tools/benchmark.py.

A synthetic split of empty ``.jpg`` files (200 k by default: 200 classes of
4 sub-folders) is listed by 4 local gloo ranks three ways, alternating
repeat after repeat: every rank lists it itself, as before the index
(``every rank``: the class check, then each class's files); rank 0 lists it
once and sends it (``rank 0``, no index file); rank 0 reads its current
index file and sends it (``index``).  A figure is the seconds from a
barrier until every rank has the listing; beside it, each rank's
``os.scandir`` calls.  The tree sits in the page cache of a local disk: on
a parallel file system every listing is round trips to its metadata
servers, which the scandir counts stand for.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

from distribuuuu.bench.overheads import on_local_ranks, summarize
from distribuuuu.data import datasets as ds
from distribuuuu.data.folder_index import index_file, shared_listing

KEY = "TRAIN.DATASET/TRAIN.SPLIT"
WAYS = ("every rank", "rank 0", "index")
CLASSES, SUBFOLDERS = 200, 4


def make_split(root: str, files: int) -> str:
    """A split of ``files`` empty JPEG names in CLASSES classes of SUBFOLDERS
    folders each, its folders' times an hour old; returns its folder."""
    split = os.path.join(root, "train")
    folders = [
        os.path.join(split, f"n{label:08d}", f"part{part}")
        for label in range(CLASSES)
        for part in range(SUBFOLDERS)
    ]
    for number in range(files):
        folder = folders[number % len(folders)]
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(os.path.join(folder, f"{number:08d}.jpg"), os.O_CREAT))
    past = time.time_ns() - 3600 * 10**9  # older than the index's racy window
    for folder, _, _ in os.walk(split):
        os.utime(folder, ns=(past, past))
    return split


class _Counted:
    """``os.scandir`` that counts its calls."""

    def __init__(self):
        self.calls, self.scandir = 0, os.scandir

    def __call__(self, path):
        self.calls += 1
        return self.scandir(path)


def _list(way: str, split: str, cache: str) -> None:
    """One listing of the split on this rank, ``way``."""
    if way == "every rank":
        classes = ds.find_image_classes(split, KEY)
        for name in classes:
            ds.find_image_files(os.path.join(split, name), split)
        return
    if way == "rank 0" and dist.get_rank() == 0:
        os.remove(index_file(cache, split))
    shared_listing(split, KEY, cache)


def _rank_main(rank: int, world: int, port: int, split: str, repeats: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counted = _Counted()
    os.scandir = counted  # type: ignore[assignment]  # this process only
    cache = os.path.join(os.path.dirname(split), "cache")
    try:
        shared_listing(split, KEY, cache)  # the index file, and warm caches
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        scandirs = torch.zeros(len(WAYS), world, dtype=torch.int64)
        for repeat in range(repeats):
            shift = repeat % len(WAYS)
            for way in WAYS[shift:] + WAYS[:shift]:
                dist.barrier()
                before, tic = counted.calls, time.perf_counter()
                _list(way, split, cache)
                dist.barrier()
                seconds[way].append(time.perf_counter() - tic)
                scandirs[WAYS.index(way), rank] = counted.calls - before
        dist.all_reduce(scandirs)  # each rank filled its own column
        if rank == 0:
            torch.save({"seconds": seconds, "scandirs": scandirs.tolist()}, out)
    finally:
        dist.destroy_process_group()


def measure_folder_scan(files: int = 200_000, ranks: int = 4, repeats: int = 5):
    """Seconds until ``ranks`` local gloo ranks have the listing of a split
    of ``files`` files, each way of :data:`WAYS`, and each rank's scandir
    calls in the last repeat."""
    with tempfile.TemporaryDirectory(prefix="distribuuuu-scan-") as work:
        tic = time.perf_counter()
        split = make_split(work, files)
        made_s = time.perf_counter() - tic
        result = on_local_ranks(_rank_main, ranks, (split, repeats), work)
    seconds = {way: summarize(result["seconds"][way]) for way in WAYS}
    scandirs = dict(zip(WAYS, result["scandirs"], strict=True))
    sizes = {"files": files, "ranks": ranks, "tree_s": made_s}
    return {**seconds, "scandirs": scandirs, **sizes}


def format_folder_scan(scan: dict) -> str:
    """The folder scan's rows of the benchmark table."""
    cells = [
        f"{way} {scan[way]['median']:.3f} ({scan[way]['min']:.3f}-"
        f"{scan[way]['max']:.3f})"
        for way in WAYS
    ]
    counts = "  ".join(
        f"{way} {','.join(map(str, scan['scandirs'][way]))}" for way in WAYS
    )
    return (
        f"{'folder scan':<18} {'s':<6} " + "  ".join(cells) + "\n"
        f"{'  scandirs/rank':<25} {counts}  ({scan['files']} files, "
        f"{scan['ranks']} ranks)"
    )
