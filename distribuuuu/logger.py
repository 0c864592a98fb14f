"""Logging: console on rank 0, a log file per rank, JSON lines and tensorboard."""

from __future__ import annotations

import json
import logging
import os
import sys

PACKAGE_LOGGER = "distribuuuu"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            stamp, _, message = text.partition("] ")
            text = f"{stamp}] {record.levelname}: {message}"
        return text


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
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(formatter)
        logger.addHandler(console)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        name = "log.txt" if rank == 0 else f"log_rank{rank}.txt"
        to_file = logging.FileHandler(os.path.join(out_dir, name), encoding="utf-8")  # noqa: SIM115
        to_file.setFormatter(formatter)
        logger.addHandler(to_file)
    return logger


class MetricsWriter:
    """Appends records to ``OUT_DIR/metrics.jsonl`` and scalars to ``OUT_DIR/tb``.

    Only the main process writes; on other ranks every call is a no-op.
    """

    def __init__(self, out_dir: str, enabled: bool):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, METRICS_FILE)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(out_dir, TENSORBOARD_DIR))

    def write(self, record: dict, scalars: dict | None = None, step: int = 0) -> None:
        """Append one JSON record; log ``scalars`` (tag -> value) at ``step``."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tag, value in (scalars or {}).items():
            self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
