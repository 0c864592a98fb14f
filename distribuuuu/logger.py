"""Logging: console on rank 0 and a log file per rank.

On an interactive terminal rank 0's console also keeps a live status line (a
progress bar) below the log; records marked ``extra={STATUS_LINE: True}`` go
to the log files but not to such a console, whose status line shows the same.
Anywhere else (a file, a pipe, a Slurm log) the console prints every record
and no status line, so logs hold no carriage returns.  Open MPI's mpirun gives
its ranks a pseudo-terminal whatever its own output is (a file, a pipe), so
under mpirun the console never keeps a status line.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time

PACKAGE_LOGGER = "distribuuuu"
# Attribute of records that a live status line shows instead of the console.
STATUS_LINE = "status_line"
# A record with this attribute set goes to the log files only (tracebacks).
FILE_ONLY = "file_only"
_REDRAW_SECONDS = 0.1  # at most ten status redraws a second


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            stamp, _, message = text.partition("] ")
            text = f"{stamp}] {record.levelname}: {message}"
        return text


class _Console(logging.StreamHandler):
    """Rank 0's console; on a terminal, with a live status line at the bottom."""

    def __init__(self, stream):
        super().__init__(stream)
        self.live = (
            stream.isatty()
            and os.environ.get("TERM") != "dumb"
            and "OMPI_COMM_WORLD_RANK" not in os.environ  # mpirun's pseudo-terminal
        )
        self._status = ""  # the text on screen, "" when none is drawn
        self._drawn_at = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if not self.live:
            super().emit(record)
        elif not getattr(record, STATUS_LINE, False):
            status = self._status
            self._erase()
            super().emit(record)
            if status:
                self._draw(status)

    def set_status(self, text: str, force: bool = False) -> None:
        """Show ``text`` as the status line (redraws are rate-limited)."""
        now = time.monotonic()
        if self.live and (force or now - self._drawn_at >= _REDRAW_SECONDS):
            self._drawn_at = now
            self._draw(text)

    def end_status(self, keep: bool) -> None:
        """Leave the status line on screen as a log line (``keep``) or erase it."""
        if self._status and keep:
            self.stream.write("\n")
            self.stream.flush()
            self._status = ""
        self._erase()

    def _draw(self, text: str) -> None:
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r" + text[:width] + "\033[K")
        self.stream.flush()
        self._status = text

    def _erase(self) -> None:
        if self._status:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._status = ""


def _console() -> _Console | None:
    for handler in logging.getLogger(PACKAGE_LOGGER).handlers:
        if isinstance(handler, _Console):
            return handler
    return None


def live_console() -> bool:
    """True when this process logs to a terminal that shows a status line."""
    console = _console()
    return console is not None and console.live


def set_status(text: str, force: bool = False) -> None:
    """Show ``text`` on the live status line (no-op without a live console)."""
    console = _console()
    if console is not None:
        console.set_status(text, force)


def end_status(keep: bool = False) -> None:
    """Keep the status line as a log line or erase it (no-op without one)."""
    console = _console()
    if console is not None:
        console.end_status(keep)


def setup_logging(out_dir: str | None, rank: int) -> logging.Logger:
    """Log to stdout on rank 0 and to ``OUT_DIR/log.txt`` (``log_rank{r}.txt``).

    Calling it again replaces the handlers of an earlier call.
    """
    logger = logging.getLogger(PACKAGE_LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = _Formatter("[%(asctime)s] %(message)s", datefmt="%m/%d %H:%M:%S")
    if rank == 0:
        console = _Console(sys.stdout)
        console.setFormatter(formatter)
        console.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
        logger.addHandler(console)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        name = "log.txt" if rank == 0 else f"log_rank{rank}.txt"
        to_file = logging.FileHandler(os.path.join(out_dir, name), encoding="utf-8")  # noqa: SIM115
        to_file.setFormatter(formatter)
        logger.addHandler(to_file)
    return logger
