"""A refusal that rank 0 alone found before the process group existed, told
to every rank once they joined it.

In a launched job of several processes some start-up checks run on rank 0
alone: the lock of OUT_DIR (one process holds it:
:mod:`distribuuuu.engine.run_lock`) and the data (one walk of an image
folder, not one per rank: :mod:`distribuuuu.preflight`).  Rank 0 cannot end
the job by exiting before the rendezvous: the other ranks would wait for it
until DIST.INIT_TIMEOUT wherever no launcher stops them (srun without
``--kill-on-bad-exit``).  So it keeps its refusal (:func:`defer_refusal`),
joins the group, and :func:`agree_inputs_usable`, a collective of every rank
before anything is written, raises it on every rank (exit 2) after undoing
what the checks made (:func:`undo_on_refusal`: OUT_DIR's new folders, its
lock file).

Nothing here imports torch but :func:`agree_inputs_usable`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from distribuuuu.errors import ConfigError, DeferredRefusalError

# How long the other ranks of a refused job wait before exiting: rank 0
# reports (its line says why), and torchrun, seeing another rank exit first,
# would stop rank 0 before it has printed.
RANK_ZERO_FIRST_S = 3.0
# Rank 0's first refusal, and what a refusal undoes (in this process): the
# locks first, on every rank, then the folders.
_DEFERRED: list[ConfigError] = []
_RELEASE: list[Callable[[], None]] = []
_UNDO: list[Callable[[], None]] = []


def defer_refusal(error: ConfigError) -> None:
    """Keep rank 0's refusal (the first one) until the ranks can be told."""
    if not _DEFERRED:
        _DEFERRED.append(error)


def deferred_refusal() -> ConfigError | None:
    """The refusal this process keeps, if any."""
    return _DEFERRED[0] if _DEFERRED else None


def undo_on_refusal(action: Callable[[], None], release: bool = False) -> None:
    """Run ``action`` (removing what a check made) should the agreement
    refuse the run, the last one given first; with ``release`` (a lock file
    that keeps its folder from being removed) before any rank's others."""
    (_RELEASE if release else _UNDO).append(action)


def forget_refusal() -> None:
    """Forget the kept refusal and the undo actions (a run that ended)."""
    for kept in (_DEFERRED, _RELEASE, _UNDO):
        kept.clear()


def agree_inputs_usable() -> None:
    """Raise rank 0's kept refusal on every rank, if it kept one.

    A collective of every rank, once the process group is joined and before
    anything is written (a no-op in one process).  On a refusal every rank
    undoes what its checks made (the locks on every rank, then the folders,
    and all of it before any rank exits: a launcher stops the others when
    one exits); then rank 0 raises its own error, whose line says why, and
    the other ranks raise DeferredRefusalError a moment later.
    """
    from distribuuuu.dist.group import all_reduce_max_int

    refusal, phases = deferred_refusal(), (_RELEASE[::-1], _UNDO[::-1])
    forget_refusal()
    if not all_reduce_max_int(int(refusal is not None)):
        return
    for actions in phases:
        for action in actions:
            action()
        all_reduce_max_int(0)  # every rank done with the phase: a barrier
    if refusal is not None:
        raise refusal
    time.sleep(RANK_ZERO_FIRST_S)
    raise DeferredRefusalError(
        "rank 0 refused the run's inputs before it started; its error line says why"
    )
