"""Experiment trackers: where rank 0 sends a run's params, metrics and files
besides ``OUT_DIR/metrics.jsonl`` (LOG.TRACKERS).

:class:`~distribuuuu.logger.MetricsWriter` writes metrics.jsonl and hands
every record to each :class:`Tracker`: tensorboard (``OUT_DIR/tb``), csv
(``OUT_DIR/metrics_<split>.csv``), MLflow and W&B.  A tracker gets the
records that tensorboard plots (train windows and evaluations), as
``<split>/<field>`` numbers: the same numbers as metrics.jsonl.

MLflow and W&B talk to servers and run on threads of their own
(:mod:`distribuuuu.remote_trackers`).
"""

from __future__ import annotations

import csv
import importlib
import logging
import os

from yacs.config import CfgNode

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tb"
CSV_FILE = "metrics_{split}.csv"
# The extra that installs the package a tracker needs.
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}
# Run ends, as MLflow names them.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


def missing_package(cfg: CfgNode) -> str | None:
    """What to install for LOG.TRACKERS, in words; None when every package
    they need imports."""
    for name in cfg.LOG.TRACKERS:
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
    header, earlier rows leaving it empty."""

    name = "csv"

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self._headers: dict[str, list[str]] = {}

    def log(self, record: dict, scalars: dict, step: int) -> None:
        split = record["split"]
        row = {"step": step} if split == "train" else {}
        plain = (bool, int, float, str)
        row.update(
            (k, v) for k, v in record.items() if k != "split" and isinstance(v, plain)
        )
        path = os.path.join(self.out_dir, CSV_FILE.format(split=split))
        header = self._headers.get(split) or _csv_header(path)
        if header is None or not set(row) <= set(header):
            rows = [] if header is None else _csv_rows(path)
            header = (header or []) + [k for k in row if k not in (header or [])]
            _write_csv(path, header, rows, "w")
        self._headers[split] = header
        _write_csv(path, header, [row], "a")


def _csv_header(path: str) -> list[str] | None:
    if not os.path.exists(path):
        return None
    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), None)


def _csv_rows(path: str) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _write_csv(path: str, header: list[str], rows: list[dict], mode: str) -> None:
    with open(path, mode, newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, header, restval="")
        if mode == "w":
            writer.writeheader()
        writer.writerows(rows)


def build_trackers(cfg: CfgNode) -> list[Tracker]:
    """The trackers of LOG.TRACKERS (metrics.jsonl is not one: it is always
    written); call on rank 0 only."""
    from distribuuuu.remote_trackers import MlflowTracker, WandbTracker

    builders = {
        "tensorboard": lambda: TensorboardTracker(cfg.OUT_DIR),
        "csv": lambda: CsvTracker(cfg.OUT_DIR),
        "mlflow": lambda: MlflowTracker(cfg),
        "wandb": lambda: WandbTracker(cfg),
    }
    return [builders[name]() for name in cfg.LOG.TRACKERS if name in builders]
