"""The run's watchdog: a loader that gives no batch for DATA.TIMEOUT seconds
fails the run, and the other ranks stop with it.

A loader can wait for ever: a worker stopped or deadlocked, a read blocked on
a dead file system, an image file that never ends. :class:`Watchdog` runs
threads of its own beside the training loop (the main thread may be the one
that is blocked: with TRAIN.WORKERS 0 it loads the batches itself):

- one times every wait for a batch of the loaders wrapped by
  :meth:`Watchdog.watch`; past DATA.TIMEOUT it fails the run with a
  :class:`LoaderTimeoutError` naming the rank, the loader and its workers
  (pid, and whether each is alive);
- one asks the process group's store whether another rank announced its
  failure, and then stops this rank with a :class:`PeerLostError` naming it,
  instead of waiting out DIST.INIT_TIMEOUT in a collective.

The error is raised in the main thread by a SIGALRM (a blocked read or a
sleep is interrupted), so the run ends as any failed run does: trackers
closed, one ``error:`` line, exit 1, the last checkpoint as it was.  Should
the main thread not take it within GRACE_S (blocked in C, such as an NCCL
wait), the watchdog writes the error line itself and ends the process.
Every rank whose run fails announces it in the store (:meth:`__exit__`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sized
from types import FrameType
from typing import Any, Protocol, cast

from distribuuuu.dist import peers
from distribuuuu.errors import LoaderTimeoutError, PeerLostError

logger = logging.getLogger(__name__)

# Seconds the main thread has to take the error before the process ends.
GRACE_S = 15.0
# The store is asked every this many seconds for a failed peer.
PEER_POLL_S = 5.0
_SIGNAL = signal.SIGALRM


class Watchdog:
    """The threads that time the loaders' waits and watch for failed peers
    (a context manager; ``timeout_s`` 0 turns it off)."""

    def __init__(self, timeout_s: float, rank: int = 0):
        self.timeout_s, self.rank = timeout_s, rank
        self._waiting: tuple[str, float, Callable[[], list]] | None = None
        self._error: BaseException | None = None
        self._fired = threading.Lock()
        self._taken = threading.Event()  # the main thread raised the error
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def __enter__(self) -> Watchdog:
        if self.timeout_s <= 0:
            return self
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(_SIGNAL, self._raise)
        for watch in (self._watch_loaders, self._watch_peers):
            thread = threading.Thread(target=watch, name=watch.__name__, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join()
        if self._previous is not None:
            signal.signal(_SIGNAL, self._previous)
        if error is not None and not isinstance(
            error, PeerLostError | KeyboardInterrupt
        ):
            lines = str(error).strip().splitlines() or [type(error).__name__]
            peers.announce_failure(f"rank {self.rank} failed: {lines[0][:500]}")

    def watch(self, loader, name: str):
        """``loader`` with each wait for a batch timed (as loader ``name``)."""
        return loader if self.timeout_s <= 0 else WatchedLoader(loader, name, self)

    def waiting(self, name: str, workers: Callable[[], list]) -> None:
        """The main thread waits for a batch of loader ``name`` from now on."""
        self._waiting = (name, time.monotonic(), workers)

    def got(self) -> None:
        """The batch came."""
        self._waiting = None

    def _watch_loaders(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._done.wait(poll):
            waiting = self._waiting
            if waiting and time.monotonic() - waiting[1] > self.timeout_s:
                self._fire(LoaderTimeoutError(self._describe(*waiting)))
                return

    def _watch_peers(self) -> None:
        while not self._done.wait(min(PEER_POLL_S, self.timeout_s)):
            failure = peers.failed_peer()
            if failure:
                message = f"rank {self.rank} stopped: {failure}"
                self._fire(PeerLostError(message))
                return

    def _describe(self, name: str, since: float, workers: Callable[[], list]) -> str:
        waited = time.monotonic() - since
        text = (
            f"rank {self.rank}: no batch from the {name} loader for {waited:.0f} s "
            f"(DATA.TIMEOUT {self.timeout_s:g})"
        )
        pids = workers()
        if not pids:
            return text + "; it loads in the main thread (TRAIN.WORKERS 0)"
        states = ", ".join(f"{pid} ({process_state(pid)})" for pid in pids)
        return text + f"; its worker pids: {states}"

    def _fire(self, error: BaseException) -> None:
        """Fail the run with ``error`` (once): raised in the main thread, or
        the process ends after GRACE_S."""
        if not self._fired.acquire(blocking=False):
            return
        self._error = error
        logger.error("%s", error)
        if isinstance(error, LoaderTimeoutError):
            peers.announce_failure(str(error))
        if self._previous is not None:
            # The main thread has started: its ident is never None.
            main = cast(int, threading.main_thread().ident)
            signal.pthread_kill(main, _SIGNAL)
        if self._taken.wait(GRACE_S) or self._done.is_set():
            return
        logger.error(
            "the main thread did not stop in %g s: ending the process", GRACE_S
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.write(f"error: {error}\n")
        sys.stderr.flush()
        os._exit(1)

    def _raise(self, signum, frame) -> None:
        if self._error is not None and not (
            self._taken.is_set() or self._done.is_set()
        ):
            self._taken.set()
            raise self._error


def process_state(pid: int) -> str:
    """``alive``, ``stopped`` or ``dead``: process ``pid`` as /proc sees it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "dead"
    return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(
        state, "alive"
    )


class WatchedLoader:
    """A loader whose iterators tell a :class:`Watchdog` when they wait for
    a batch; everything else (``len``, ``sampler``, ``dataset``) is the
    loader's own."""

    def __init__(self, loader, name: str, watchdog: Watchdog):
        self.loader, self.name, self.watchdog = loader, name, watchdog

    def __getattr__(self, attribute: str):
        if attribute == "loader":  # not set yet (a copy being made)
            raise AttributeError(attribute)
        return getattr(self.loader, attribute)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        return _WatchedBatches(iter(self.loader), self.name, self.watchdog)


class _LoaderIterator(Iterator, Sized, Protocol):
    """A loader's iterator, which has a length (its loader's)."""


class _WatchedBatches:
    # A method, not a generator: no frame of ours keeps the last batch (a
    # RingLoader hands a slot back once nothing refers to its batch).
    def __init__(self, batches: _LoaderIterator, name: str, watchdog: Watchdog):
        self.batches, self.name, self.watchdog = batches, name, watchdog

    def __iter__(self) -> _WatchedBatches:
        return self

    def __len__(self) -> int:
        return len(self.batches)

    def __next__(self):
        self.watchdog.waiting(self.name, self.worker_pids)
        try:
            return next(self.batches)
        except LoaderTimeoutError:
            # A stopped or hung worker ignores the SIGTERM that ends it at
            # exit, and multiprocessing would wait for it for ever.
            for pid in self.worker_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise
        finally:
            self.watchdog.got()

    def worker_pids(self) -> list[int]:
        """The pids of the loader's worker processes (none without workers)."""
        inner = getattr(self.batches, "batches", self.batches)  # a RingLoader's
        # torch's _MultiProcessingDataLoaderIter keeps its processes here (a
        # private name: tests/dist/test_watchdog.py fails if it changes).
        return [worker.pid for worker in getattr(inner, "_workers", [])]
