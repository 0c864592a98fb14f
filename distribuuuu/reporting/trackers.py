"""Experiment trackers: where rank 0 sends a run's params, metrics and files
besides ``OUT_DIR/metrics.jsonl`` (LOG.TRACKERS).

:class:`~distribuuuu.reporting.writer.MetricsWriter` writes metrics.jsonl and hands
every record to each :class:`Tracker`: tensorboard (``OUT_DIR/tb``), csv
(``OUT_DIR/metrics_<split>.csv``), MLflow and W&B.  A tracker gets the
records that tensorboard plots (train windows and evaluations), as
``<split>/<field>`` numbers: the same numbers as metrics.jsonl.

MLflow and W&B talk to servers and run on threads of their own
(:mod:`distribuuuu.reporting.remote_trackers`).
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import logging
import os
import stat
from collections.abc import Iterable
from typing import IO, Any

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tb"
CSV_FILE = "metrics_{split}.csv"
# The extra that installs the package a tracker needs.
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}
# Run ends, as MLflow names them.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


def missing_package(trackers: Iterable[str]) -> str | None:
    """What to install for the ``trackers`` of LOG.TRACKERS, in words; None
    when every package they need imports."""
    for name in trackers:
        if name not in PACKAGES:
            continue
        try:
            importlib.import_module(PACKAGES[name])
        except ImportError as error:
            return (
                f"LOG.TRACKERS {name} needs the {PACKAGES[name]} package, which "
                f"cannot be imported here ({error}): pip install "
                f"'distribuuuu[{name}]'"
            )
    return None


def tracked_metrics(record: dict, scalars: dict, step: int) -> dict[str, float]:
    """The numbers a tracker logs for ``record``: tensorboard's ``scalars``
    and every number of the record as ``<split>/<field>`` (a train record
    adds ``train/step``, the optimizer step since the run began)."""
    split = record["split"]
    metrics = dict(scalars)
    for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[f"{split}/{key}"] = value
    if split == "train":
        metrics["train/step"] = step
    return metrics


class Tracker:
    """What every tracker does; each method is a no-op unless overridden.

    ``log`` gets the records that tensorboard plots (``scalars`` non-empty)
    with the step tensorboard uses: the optimizer step for train records,
    the epoch for evaluations.
    """

    name = ""

    @property
    def run_id(self) -> str | None:
        """The id that continues this tracker's run on resume (None: none)."""
        return None

    def start(self, run_id: str | None) -> None:
        """Begin the run, or continue run ``run_id`` (from the checkpoint)."""

    def log(self, record: dict, scalars: dict, step: int) -> None:
        """Log one train or evaluation record of metrics.jsonl."""

    def image(self, tag: str, image, step: int) -> None:
        """An HxWx3 uint8 image (numpy), e.g. the confusion matrix."""

    def histogram(self, tag: str, values, step: int) -> None:
        """The distribution of ``values``."""

    def text(self, tag: str, text: str, step: int) -> None:
        """A text, e.g. the start-up report."""

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """The run's config beside its final scores (at the end)."""

    def wrote_file(self, path: str) -> None:
        """This run has just written ``path`` (best weights): the end of the run
        uploads a file only if this run wrote it and it is still that file."""

    def close(self, status: str) -> None:
        """End the run: FINISHED (upload its files), FAILED or KILLED."""


class TensorboardTracker(Tracker):
    """Scalars, images, histograms, texts and hparams in ``OUT_DIR/tb``."""

    name = "tensorboard"

    def __init__(self, out_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(os.path.join(out_dir, TENSORBOARD_DIR))

    def log(self, record: dict, scalars: dict, step: int) -> None:
        for tag, value in scalars.items():
            self._tb.add_scalar(tag, value, step)

    def image(self, tag: str, image, step: int) -> None:
        self._tb.add_image(tag, image, step, dataformats="HWC")

    def histogram(self, tag: str, values, step: int) -> None:
        self._tb.add_histogram(tag, values, step)

    def text(self, tag: str, text: str, step: int) -> None:
        self._tb.add_text(tag, text, step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """Values other than bool, int, float and str are logged as text."""
        plain = {
            key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in hparams.items()
        }
        # run_name "." writes into this run's own directory, not a new one.
        self._tb.add_hparams(plain, metrics, run_name=".")

    def close(self, status: str) -> None:
        self._tb.close()


class CsvTracker(Tracker):
    """One spreadsheet per split: ``OUT_DIR/metrics_<split>.csv``, a header
    row, then one row per record with its plain values (train rows begin with
    ``step``; lists such as per-class top-1 stay in metrics.jsonl).  A resumed
    run appends, as to metrics.jsonl; a field that appears later (another
    world size adds ``scaling_efficiency``) rewrites the file with a wider
    header, earlier rows leaving it empty.  A file there that is no UTF-8 csv,
    a link or no regular file is set aside (:func:`set_aside`)."""

    name = "csv"

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self._headers: dict[str, list[str]] = {}

    def log(self, record: dict, scalars: dict, step: int) -> None:
        split = record["split"]
        row: dict[str, Any] = {"step": step} if split == "train" else {}
        plain = (bool, int, float, str)
        row.update(
            (k, v) for k, v in record.items() if k != "split" and isinstance(v, plain)
        )
        path = os.path.join(self.out_dir, CSV_FILE.format(split=split))
        header = self._headers.get(split) or _read_csv(path, with_rows=False)[0]
        if header and set(row) <= set(header):
            with open_to_append(path, newline="") as f:
                csv.DictWriter(f, header, restval="").writerow(row)
        else:
            rows = _read_csv(path, with_rows=True)[1] if header else []
            header = (header or []) + [k for k in row if k not in (header or [])]
            _rewrite_csv(path, header, [*rows, row])
        self._headers[split] = header


def set_aside(path: str, why: str) -> None:
    """Rename what is at ``path`` (a link is renamed, never followed) to a free
    name beside it, ``<name>.old``, ``<name>.old2``, ...; warn, saying ``why``."""
    aside, number = f"{path}.old", 1
    while os.path.lexists(aside):
        number += 1
        aside = f"{path}.old{number}"
    os.rename(path, aside)
    logger.warning(
        "%s %s: moved it to %s, a new file takes its place",
        path,
        why,
        os.path.basename(aside),
    )


def _regular_file_there(path: str) -> bool:
    """True when a regular file is at ``path``; anything else there (a link, a
    FIFO, a folder) is set aside, since writing through it would change what
    it points to."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode):
        return True
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
    set_aside(path, f"is {kind}, which a run never writes through")
    return False


def _open_text(path: str, flags: int, mode: str, newline: str | None) -> IO[str]:
    """``path`` opened with ``flags`` as UTF-8 text, never through a link and
    never blocking on a FIFO (O_NOFOLLOW and O_NONBLOCK: both raise OSError)."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(path, flags, 0o666)
    try:
        return open(fd, mode, encoding="utf-8", newline=newline)  # noqa: SIM115
    except BaseException:
        os.close(fd)
        raise


def open_to_append(path: str, newline: str | None = None) -> IO[str]:
    """``path`` opened to append UTF-8 text (created if missing), never through
    a link: a link or other non-regular file there is set aside first."""
    _regular_file_there(path)
    return _open_text(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a", newline)


def _read_csv(path: str, with_rows: bool) -> tuple[list[str] | None, list[dict]]:
    """The header (None: no file, or an empty one) and, ``with_rows``, the rows
    of the csv at ``path``.  A file that cannot be read as a UTF-8 csv is set
    aside (a resume goes on with a new file), as is a link."""
    if not _regular_file_there(path):
        return None, []
    try:
        with _open_text(path, os.O_RDONLY, "r", "") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames
            rows = list(reader) if with_rows else []
    except (UnicodeDecodeError, csv.Error) as error:
        set_aside(path, f"cannot be read as a UTF-8 csv ({error})")
        return None, []
    return (list(header) if header else None), rows


def _rewrite_csv(path: str, header: list[str], rows: list[dict]) -> None:
    """Write a csv of ``header`` and ``rows`` beside ``path``, then rename it
    over ``path``: a crash leaves the old file, and a link there is replaced,
    its target left as it was."""
    tmp = os.path.join(
        os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}"
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a killed process of the same pid
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        with _open_text(tmp, flags, "w", "") as f:
            writer = csv.DictWriter(f, header, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
