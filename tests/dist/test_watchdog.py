"""Loader workers are never forked from the trainer, and a loader that gives no
batch fails the run (distribuuuu/data/workers.py, distribuuuu/dist/watchdog.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch
from helpers import (
    REPO,
    TINY,
    TRAIN_NET,
    free_port,
    kill_tree,
    last_checkpoint_weights,
    process_table,
    run_command,
)
from torch.utils.data import DataLoader, Dataset

from distribuuuu.config import load_cfg
from distribuuuu.data import build_test_loader, build_train_loader
from distribuuuu.data.packed import PackedSamples
from distribuuuu.dist.watchdog import Watchdog, WatchedLoader
from distribuuuu.dist.worker_server import worker_context
from distribuuuu.engine.specs import loader_spec
from distribuuuu.errors import LoaderTimeoutError

CPU = torch.device("cpu")
CONTEXT = worker_context()
_FORKS = []
os.register_at_fork(before=lambda: _FORKS.append(os.getpid()))


class ParentPids(Dataset):
    """Images labelled with the pid of the process that loaded them and its
    parent's."""

    classes = ["a"]

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pids = torch.tensor([os.getpid(), os.getppid()], dtype=torch.int32)
        return pids.view(torch.uint8).view(1, 2, 4), index


def _pids(batches) -> set[tuple[int, int]]:
    found = set()
    for images, _ in batches:
        for image in images:
            found.add(tuple(image.reshape(-1).view(torch.int32).tolist()))
    return found


def test_the_worker_server_starts_before_the_trainer_imports_torch():
    """train_net.py starts the fork server right after reading the config, so
    that its imports (torch, 2-6 s) overlap the trainer's own: nothing the
    script imports at its top may import torch (importing any module of
    ``distribuuuu.data`` would: its package does)."""
    code = f"import runpy, sys; sys.path[0] = {REPO!r}"  # its top only:
    code += f"; runpy.run_path({TRAIN_NET!r}, run_name='not_main')"
    code += "; print('torch' in sys.modules)"
    result = run_command([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


def test_no_loader_worker_is_forked_from_the_trainer():
    cfg = load_cfg(None, ["TRAIN.WORKERS", "2", "TEST.BATCH_SIZE", "2"])
    train = build_train_loader(
        loader_spec(cfg),
        ParentPids(),
        rank=0,
        world_size=1,
        seed=0,
        device=CPU,
        batch_size=2,
    )
    test = build_test_loader(loader_spec(cfg), ParentPids(), 0, 1, CPU)
    forks = len(_FORKS)
    train.sampler.set_epoch(0)
    loaded = _pids(train) | _pids(test)
    # Four workers loaded, none of them a child of this process, which
    # forked nothing: a single-threaded fork server made them.
    assert len({pid for pid, _ in loaded}) == 4
    assert all(parent != os.getpid() for _, parent in loaded)
    assert _FORKS[forks:] == []


def test_torchs_loader_iterator_still_lists_its_workers():
    # The watchdog names the workers from a private attribute of torch's
    # multiprocessing iterator (_workers): this fails if torch renames it.
    loader = DataLoader(
        ParentPids(), batch_size=2, num_workers=1, multiprocessing_context=CONTEXT
    )
    batches = iter(WatchedLoader(loader, "train", Watchdog(0)))
    next(batches)
    assert [pid for pid, _ in _pids([next(batches)])] == batches.worker_pids()
    del batches


class Blocking(Dataset):
    """A data set whose reads never end (a dead file system, a FIFO)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        threading.Event().wait()


def test_a_read_that_blocks_the_main_thread_fails_the_run():
    loader = DataLoader(Blocking(), batch_size=2)
    tic = time.monotonic()
    with pytest.raises(LoaderTimeoutError) as raised, Watchdog(1, rank=3) as watchdog:
        next(iter(watchdog.watch(loader, "eval")))
    assert time.monotonic() - tic < 10
    assert str(raised.value).startswith("rank 3: no batch from the eval loader for")
    assert "it loads in the main thread (TRAIN.WORKERS 0)" in str(raised.value)


def test_without_a_timeout_nothing_is_watched():
    loader = DataLoader(ParentPids(), batch_size=2)
    with Watchdog(0) as watchdog:
        assert watchdog.watch(loader, "train") is loader
        assert not watchdog._threads


def test_packed_samples_give_the_paths_and_labels_back_and_pickle_small():
    import pickle

    samples = [(f"/data/train/c{i % 3}/ünïcode {i}.jpg", i % 3) for i in range(1000)]
    samples.append((os.fsdecode(b"/data/train/c0/latin1-\xe9.jpg"), 0))
    packed = PackedSamples(samples)
    assert list(packed) == samples and packed[-1] == samples[-1]
    assert packed[2:4] == samples[2:4]
    with pytest.raises(IndexError):
        packed[len(samples)]
    from multiprocessing.reduction import ForkingPickler

    # Sent to a worker, the tensors travel as shared memory: a few hundred
    # bytes, not the 40 kB of the list.
    assert len(bytes(ForkingPickler.dumps(packed))) < 2000
    assert list(pickle.loads(pickle.dumps(packed))) == samples


def test_an_image_folder_travels_to_its_workers_in_shared_memory(tmp_path):
    from multiprocessing.reduction import ForkingPickler

    from distribuuuu.data.datasets import CheckedImageFolder

    for index in range(400):
        folder = tmp_path / f"class {index % 2}"
        folder.mkdir(exist_ok=True)
        (folder / f"a rather long file name of image {index:05d}.jpg").touch()
    dataset = CheckedImageFolder(str(tmp_path), None, "TRAIN.DATASET")
    assert len(dataset) == 400 and dataset.samples[-1][1] == 1
    # 400 paths of some 80 characters: 32 kB as a list, a few hundred bytes
    # of file descriptors and sizes as shared tensors.
    assert len(bytes(ForkingPickler.dumps(dataset))) < 4000


def _start_rank(rank: int, port: int, out_dir: str, opts: list[str]):
    import subprocess

    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, TRAIN_NET, *opts, "OUT_DIR", out_dir],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_worker_fails_the_run_and_the_other_rank_names_it(tmp_path):
    out_dir = str(tmp_path / "out")
    opts = [*TINY, "DATA.SYNTHETIC_SIZE", "[4096,101]", "TRAIN.WORKERS", "1"]
    opts += ["DATA.TIMEOUT", "3", "CHECKPOINT.PERIOD_ITERS", "4"]
    port = free_port()
    ranks = [_start_rank(rank, port, out_dir, opts) for rank in range(2)]
    try:
        last = os.path.join(out_dir, "checkpoints", "last")
        deadline = time.monotonic() + 240
        while not os.path.exists(last) and time.monotonic() < deadline:
            assert all(rank.poll() is None for rank in ranks)
            time.sleep(0.2)
        # Rank 0's loader workers stop: the children of its fork server.
        children = {pid for pid, ppid, _, _ in process_table() if ppid == ranks[0].pid}
        workers = [pid for pid, ppid, _, _ in process_table() if ppid in children]
        assert workers
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        errors = [rank.communicate(timeout=120)[1] for rank in ranks]
        took = time.monotonic() - stopped
    finally:
        for rank in ranks:
            kill_tree(rank.pid)
            rank.communicate()
    lines = [[x for x in err.splitlines() if x.startswith("error:")] for err in errors]
    assert [rank.returncode for rank in ranks] == [1, 1], errors
    assert len(lines[0]) == 1 and len(lines[1]) == 1, errors
    assert lines[0][0].startswith("error: rank 0: no batch from the train loader")
    assert "(stopped)" in lines[0][0]
    assert any(f"{pid} (stopped)" in lines[0][0] for pid in workers)
    assert "rank 0" in lines[1][0] and lines[1][0].startswith("error: rank 1")
    assert took < 60  # not DIST.INIT_TIMEOUT's 600 s
    assert last_checkpoint_weights(out_dir)  # the last checkpoint loads
