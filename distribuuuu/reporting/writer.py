"""The metrics writer: JSON lines in ``OUT_DIR/metrics.jsonl``, and the same
records handed to the experiment trackers."""

from __future__ import annotations

import json
import os
from typing import IO, cast

from distribuuuu.reporting.trackers import TensorboardTracker, open_to_append

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Appends records to ``OUT_DIR/metrics.jsonl`` and hands them to the
    experiment trackers (:mod:`distribuuuu.reporting.trackers`; tensorboard in
    ``OUT_DIR/tb`` unless ``trackers`` says otherwise).

    Only the main process writes; on other ranks every call is a no-op.
    """

    def __init__(self, out_dir: str, enabled: bool, trackers: list | None = None):
        self.enabled = enabled
        self._file: IO[str] | None = None
        self.trackers: list = []
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            # Never through a link: one planted there is set aside with a warning.
            self._file = open_to_append(os.path.join(out_dir, METRICS_FILE))
            if trackers is None:
                trackers = [TensorboardTracker(out_dir)]
            self.trackers = trackers

    def start(self, run_ids: dict[str, str]) -> None:
        """Begin the trackers' runs, continuing those of ``run_ids`` (tracker
        name -> run id, from the checkpoint resumed)."""
        for tracker in self.trackers:
            tracker.start(run_ids.get(tracker.name))

    def run_ids(self) -> dict[str, str]:
        """The trackers' run ids, for the checkpoint (empty on other ranks)."""
        ids = {tracker.name: tracker.run_id for tracker in self.trackers}
        return {name: run_id for name, run_id in ids.items() if run_id}

    def write(self, record: dict, scalars: dict | None = None, step: int = 0) -> None:
        """Append one JSON record; log ``scalars`` (tag -> value) at ``step``.

        The trackers get the records that have scalars (train windows and
        evaluations).
        """
        if not self.enabled:
            return
        file = cast(IO[str], self._file)  # open from __init__ to close()
        file.write(json.dumps(record) + "\n")
        file.flush()
        if scalars:
            for tracker in self.trackers:
                tracker.log(record, scalars, step)

    def wrote_file(self, path: str) -> None:
        """Tell the trackers that this run has just written ``path`` (best
        weights), which they may upload at the end."""
        for tracker in self.trackers:
            tracker.wrote_file(path)

    def image(self, tag: str, image, step: int = 0) -> None:
        """Log an HxWx3 uint8 image (a numpy array)."""
        for tracker in self.trackers:
            tracker.image(tag, image, step)

    def histogram(self, tag: str, values, step: int = 0) -> None:
        """Log the distribution of ``values``."""
        for tracker in self.trackers:
            tracker.histogram(tag, values, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Log a text (tensorboard shows it as markdown)."""
        for tracker in self.trackers:
            tracker.text(tag, text, step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """Log a run's hyper-parameters with its final metrics (tensorboard's
        hparams tab; the others have the config as params already)."""
        for tracker in self.trackers:
            tracker.hparams(hparams, metrics)

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close the files; end the trackers' runs with ``status``
        (FINISHED, FAILED or KILLED: stopped by a signal, to be resumed)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(status)
