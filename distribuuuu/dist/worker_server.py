"""Loader workers start from a fork server, never by forking the trainer.

A training process is full of threads that are not Python's own: torch's,
gloo's, a tracker's. ``os.fork()`` of such a process can deadlock the child
in CPython's after-fork clean-up when one of them held the interpreter's
thread list lock at that moment (CPython gh-112275: fixed in 3.12 and late
3.11 builds, present in the many older ones on clusters; 3.12 warns that
"use of fork() may lead to deadlocks"). The evaluation loader starts its
workers lazily, at the first evaluation, so a run could hang there.

Every loader with workers uses :func:`worker_context` instead: a fork
server, started as a fresh interpreter (fork + exec, which runs no Python
in between), imports our data code once and forks each worker from its own
single thread. What differs from fork:

- the data set and ``collate_fn`` are pickled into each worker, so what a
  data set holds must be small to pickle (paths are packed into
  shared-memory tensors, sent as file descriptors: ``data/packed.py``);
- environment changes made after the server started do not reach workers;
- the server's first worker waits for its imports (2-6 s with torch):
  :func:`start_worker_server` starts it early, before this process imports
  torch (``tools/train_net.py``, right after the config is read), so that
  both import at once. This module imports no torch for that reason, and it
  lives in ``dist/`` (beside spawn), whose package imports nothing: importing
  anything of ``data/`` runs its package, which imports torch.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

# What the server imports once, before it forks any worker: our data code
# (with torch, torchvision and PIL), and a quick exit for the server.
PRELOAD = ["distribuuuu.data.worker_preload"]


def worker_context() -> BaseContext:
    """The multiprocessing context of every loader's workers: a fork server
    (spawn where the platform has none)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # used when the server starts
    return context


def start_worker_server() -> None:
    """Start the fork server now, so that its imports overlap the work that
    follows (it is started once per process; later calls do nothing)."""
    if worker_context().get_start_method() == "forkserver":
        forkserver.ensure_running()
