"""How the command-line tools end: exit codes, one ``error:`` line, ``--debug``.

Every tool (train_net, export, predict, inspect_ckpt) runs its work through
:func:`run_tool`, which maps the errors it raises to exit codes by a list of
:class:`ErrorExit` rules and reports each in one line on stderr that starts
with ``error: `` (after the traceback only with ``--debug``), so that no tool
ends in a bare traceback.  The rules of each tool are here too: one place
says which error ends which tool with which code.

Nothing here imports torch at import time: train_net.py reports a bad config
before torch is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from distribuuuu.dist.launcher_env import launched_rank
from distribuuuu.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNUSABLE_INPUT,
    CheckpointError,
    ConfigError,
    DataError,
    DistributedSetupError,
    MismatchError,
    OnnxError,
    OutputPathError,
    PeerLostError,
    StepOutOfMemoryError,
)

# Errors whose message is written for users: shown without their type name.
_PLAIN_ERRORS = {
    "ConfigError",
    "DataError",
    "DiskFullError",
    "DistributedSetupError",
    "FileNotFoundError",
    "LoaderTimeoutError",
    "NoMicroBatchFitsError",
    "NonFiniteError",
    "PeerLostError",
    "StepOutOfMemoryError",
}
_TYPE_NAME = re.compile(r"^[A-Za-z_][\w.]*$")
# The longest error line printed: a message that quotes a huge value (a list of
# 100,000 steps) is cut in the middle; log.txt keeps it whole in the traceback.
MAX_ERROR_CHARS = 2000


def add_debug_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--debug``: print the traceback before the error line."""
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, also print the full traceback (before the error line)",
    )


def describe_error(error: BaseException) -> str:
    """``error`` in one line: ``Type: message`` (just the message for some types).

    A message carrying a traceback (an error re-raised from a data loader
    worker or a spawned process) is reduced to its last line.
    """
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    name, message = type(error).__name__, " ".join(lines[:1])
    if "Traceback (most recent call last)" in text:
        head, colon, rest = lines[-1].partition(": ")
        if colon and _TYPE_NAME.match(head):
            name, message = head.rsplit(".", 1)[-1], rest
        else:
            message = lines[-1]
    elif len(lines) > 1:
        message += " [...]"
    if name in _PLAIN_ERRORS and message:
        return message
    return f"{name}: {message}" if message else name


def plain_message(error: BaseException) -> str:
    """The message of an error written for users, as it is (no type name)."""
    return str(error)


def is_rank_zero() -> bool:
    """True in a process that is not a launched rank other than 0."""
    return launched_rank(os.environ) in (None, "0")


def shorten(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` cut in the middle to at most about ``limit`` characters,
    saying how many were cut (its start and end name what and why)."""
    cut = len(message) - limit
    if cut <= 0:
        return message
    head, tail = limit // 2, limit - limit // 2
    return f"{message[:head]} ... [{cut} characters cut] ... {message[-tail:]}"


def print_error(message: str, code: int) -> int:
    """Print ``error: message`` on stderr (one line, at most about
    MAX_ERROR_CHARS characters); return ``code``."""
    print(f"error: {shorten(message)}", file=sys.stderr)
    return code


def report_error(
    error: BaseException,
    code: int,
    debug: bool,
    message: str | None = None,
    every_rank: bool = False,
) -> int:
    """Report ``error`` in one line (after its traceback with --debug); return code.

    Only rank 0 reports, unless ``every_rank``.
    """
    if not (every_rank or is_rank_zero()):
        return code
    if debug:
        traceback.print_exception(error)
    return print_error(message or describe_error(error), code)


@dataclass(frozen=True)
class ErrorExit:
    """A rule of :func:`run_tool`: errors of these types end the tool so.

    Args:
        errors: the exception class (or classes) the rule matches.
        code: the exit code, or a function of the error that returns it.
        message: the error line's text (after ``error: ``) for the error.
        every_rank: report on every rank, not only on rank 0.
    """

    errors: type[BaseException] | tuple[type[BaseException], ...]
    # Functions of an error of ``errors``, typed Any: a rule reads the
    # attributes of its own error types (StartupStop.signum, ...).
    code: int | Callable[[Any], int]
    message: Callable[[Any], str] = describe_error
    every_rank: bool = False


# What every tool does with what its own rules do not name.
_LAST_RULES = (
    ErrorExit(KeyboardInterrupt, EXIT_INTERRUPTED, lambda error: "interrupted"),
    ErrorExit(Exception, EXIT_FAILED),
)


def run_tool(
    work: Callable[[], int | None],
    debug: bool = False,
    rules: Sequence[ErrorExit] = (),
) -> int:
    """Run ``work``; return its exit code (None: 0), or that of the error it raised.

    The first of ``rules`` that matches the error decides the code and the
    line; any other Exception exits 1 and Ctrl-C 130.  Only BaseExceptions
    that no rule names (SystemExit) pass through.
    """
    every_rule = (*rules, *_LAST_RULES)
    handled = tuple(
        kind
        for rule in every_rule
        for kind in (rule.errors if isinstance(rule.errors, tuple) else (rule.errors,))
    )
    try:
        code = work()
    except handled as error:
        rule = next(rule for rule in every_rule if isinstance(error, rule.errors))
        exit_code = rule.code(error) if callable(rule.code) else rule.code
        return report_error(
            error, exit_code, debug, rule.message(error), rule.every_rank
        )
    return EXIT_OK if code is None else code


# --------------------------------------------------------------------------- #
# Signals during start-up (train_net.py)
# --------------------------------------------------------------------------- #


class StartupStop(BaseException):
    """SIGTERM or SIGUSR1 before the training loop takes them over.

    (The loop saves a checkpoint and stops.)  Like KeyboardInterrupt, not an
    ``Exception``.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def message(self, eval_only: bool, dry_run: bool) -> str:
        """The error line: what was stopped, and to run the command again."""
        name = signal.Signals(self.signum).name
        if eval_only or dry_run:
            return f"stopped by {name}; run the same command again"
        return (
            f"stopped by {name} during start-up; nothing was trained, run the "
            "same command again"
        )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _StopRaiser:
    """The start-up handler of SIGTERM and SIGUSR1: raises StartupStop.

    It also records the signal: Python only prints an exception raised inside
    a weakref callback or a ``__del__`` (an import's clean-up may run one) and
    goes on, and the training loop's StopRequest, which replaces this handler,
    takes such a swallowed stop over from ``received``.
    """

    def __init__(self) -> None:
        self.received = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        raise StartupStop(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGUSR1 raise StartupStop inside the block.

    Until the training loop installs its own handlers (which save and stop);
    the previous handlers come back after the block unless something else
    (the loop, or a stop that ignores further signals) replaced ours.
    """
    raiser = _StopRaiser()
    previous = {signum: signal.signal(signum, raiser) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is raiser:  # not ignored by a stop
                signal.signal(signum, handler)


def default_stop_signals() -> None:
    """Let SIGTERM and SIGUSR1 end this process at once (a parent that waits)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


# --------------------------------------------------------------------------- #
# The rules of each tool
# --------------------------------------------------------------------------- #


def train_startup_rules(eval_only: bool, dry_run: bool) -> tuple[ErrorExit, ...]:
    """train_net.py before the run: config and input errors exit 2."""
    return (
        ErrorExit(ConfigError, EXIT_UNUSABLE_INPUT),
        ErrorExit(
            KeyboardInterrupt,
            EXIT_INTERRUPTED,
            lambda error: "interrupted during start-up; nothing was written",
        ),
        ErrorExit(
            StartupStop,
            lambda stop: 128 + stop.signum,
            lambda stop: stop.message(eval_only, dry_run),
        ),
    )


def train_run_rules(
    num_procs: int, eval_only: bool, dry_run: bool
) -> tuple[ErrorExit, ...]:
    """train_net.py during the run: every failure exits 1 (a stop 128+N).

    A failed setup, a lost peer or a step out of memory is reported by every
    rank that met it, a failed ``--num-procs`` process by the number of the
    process.
    """
    import torch.multiprocessing as mp

    def process_failed(error: mp.ProcessRaisedException) -> str:
        """The line of a failed --num-procs process: its number and error."""
        where = f"process {error.error_index} of {num_procs} failed"
        return f"{where}: {describe_error(error)}"

    return (
        ErrorExit(
            StartupStop,
            lambda stop: 128 + stop.signum,
            lambda stop: stop.message(eval_only, dry_run),
        ),
        ErrorExit(
            (DistributedSetupError, PeerLostError, StepOutOfMemoryError),
            EXIT_FAILED,
            every_rank=True,
        ),
        ErrorExit(mp.ProcessRaisedException, EXIT_FAILED, process_failed),
        ErrorExit(
            mp.ProcessExitedException,
            EXIT_FAILED,
            lambda error: f"{error}; the other processes were stopped",
        ),
    )


def checkpoint_tool_rules() -> tuple[ErrorExit, ...]:
    """export, predict, inspect_ckpt: unusable weights, config or image exit 2."""
    unusable = (CheckpointError, ConfigError, DataError, OnnxError, OutputPathError)
    return (  # not run under a launcher: every process reports
        ErrorExit(unusable, EXIT_UNUSABLE_INPUT, plain_message, every_rank=True),
        ErrorExit(MismatchError, EXIT_FAILED, plain_message, every_rank=True),
        *(ErrorExit(r.errors, r.code, r.message, every_rank=True) for r in _LAST_RULES),
    )
