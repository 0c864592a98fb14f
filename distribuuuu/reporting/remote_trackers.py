"""The experiment trackers that talk to servers: MLflow and W&B
(LOG.TRACKERS; the contract is :class:`distribuuuu.reporting.trackers.Tracker`).

A server may be slow or gone: each tracker runs its calls in order on a
thread of its own behind a bounded queue (:class:`_Worker`), so that a
training step only ever waits for a queue insertion.  The first failure (or
a full queue) logs one warning and the tracker goes quiet for the rest of
the run; the end of a run waits at most LOG.CLOSE_TIMEOUT seconds for what a
tracker still holds.  MLflow's HTTP client retries a failed request for
minutes by default: unless the environment says otherwise, its retries are
bounded by :data:`MLFLOW_HTTP_DEFAULTS`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distribuuuu.reporting.trackers import (
    FAILED,
    FINISHED,
    KILLED,
    CsvTracker,
    TensorboardTracker,
    Tracker,
    tracked_metrics,
)

logger = logging.getLogger(__name__)

# Calls a remote tracker holds before it drops new ones (one per log window,
# evaluation or file: far more than a healthy server ever lets pile up).
QUEUE_SIZE = 1000
# MLflow's documented environment settings, used where the environment sets
# none: 2 retries with back-off 1 s, 30 s per request (MLflow's own defaults,
# 7 retries with back-off 2 s and 120 s per request, keep a dead server's
# request going for minutes).
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
# The longest a checkpoint waits for the MLflow run to be created (once).
START_WAIT = 10.0
# MLflow's limits: entries per log_batch call and characters of a param value.
_MLFLOW_BATCH, _MLFLOW_PARAM_CHARS = 100, 6000
# The name of every tracker thread begins with it.
_THREAD_PREFIX = "tracker-"


@dataclass(frozen=True)
class MlflowSpec:
    """Where the MLflow run goes (LOG.MLFLOW)."""

    tracking_uri: str  # empty: MLflow reads the environment
    experiment: str  # empty: MLFLOW_EXPERIMENT_NAME, else MLflow's "Default"
    run_name: str  # empty: the name of the output folder
    upload_best: bool  # best.pth and best_ema.pth go up at the end


@dataclass(frozen=True)
class WandbSpec:
    """Where the W&B run goes (LOG.WANDB)."""

    project: str
    entity: str
    mode: str
    run_name: str  # empty: the name of the output folder
    upload_best: bool


@dataclass(frozen=True)
class TrackerSpec:
    """What the trackers need of a run: its output folder, LOG.* and the
    config as flat params (``engine.specs.tracker_spec`` fills it)."""

    out_dir: str
    trackers: tuple[str, ...]  # LOG.TRACKERS
    params: dict  # the whole config with dotted keys, logged as params
    config_file: str  # CFG_DEST: the config rank 0 dumps in out_dir
    close_timeout: float  # LOG.CLOSE_TIMEOUT, in seconds
    mlflow: MlflowSpec
    wandb: WandbSpec


def _not_from_trackers(record: logging.LogRecord) -> bool:
    """False for the records of a tracker's thread (urllib3's "Retrying"
    warnings): a failing tracker says so once, in its own words."""
    return not (record.threadName or "").startswith(_THREAD_PREFIX)


class _Worker:
    """Runs calls in order on a daemon thread behind a bounded queue.

    The first call that raises, or a full queue, logs one warning; every
    later call is dropped.
    """

    def __init__(self, name: str):
        self.name, self.failed = name, False
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(
            target=self._run, name=_THREAD_PREFIX + name, daemon=True
        )
        retries = logging.getLogger("urllib3.connectionpool")
        if _not_from_trackers not in retries.filters:
            retries.addFilter(_not_from_trackers)
        self._thread.start()

    def submit(self, call: Callable, *args) -> None:
        """Queue ``call(*args)``; never blocks."""
        if self.failed:
            return
        try:
            self._queue.put_nowait((call, args))
        except queue.Full:
            self._fail(f"it fell {QUEUE_SIZE} calls behind (a slow server?)")

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, args = item
            if self.failed:
                continue
            try:
                call(*args)
            except Exception as error:  # any failure: the run goes on without it
                self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            logger.warning(
                "the %s tracker stopped logging: %s; the run goes on without it "
                "(OUT_DIR/metrics.jsonl has every record)",
                self.name,
                " ".join(why.split())[:500],
            )

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the queued calls to finish."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(max(deadline - time.monotonic(), 0))
        if self._thread.is_alive():
            logger.warning(
                "the %s tracker still sends after LOG.CLOSE_TIMEOUT %g s; the run "
                "ends without waiting for it",
                self.name,
                timeout,
            )


class _RemoteTracker(Tracker):
    """A tracker whose calls run on a :class:`_Worker` (see the module doc).

    Subclasses implement ``_start``, ``_log``, ``_finish`` and may keep the
    latest image of each tag, which ``_finish`` uploads.
    """

    def __init__(self, spec: TrackerSpec, keys: MlflowSpec | WandbSpec):
        self.out_dir = spec.out_dir
        self.run_name = keys.run_name or os.path.basename(os.path.abspath(spec.out_dir))
        self.params = spec.params  # dotted keys
        names = [spec.config_file]
        if keys.upload_best:
            names += ["best.pth", "best_ema.pth"]
        self.files = [os.path.join(spec.out_dir, name) for name in names]
        # The files to upload that this run wrote: path -> _file_identity.
        self.written: dict[str, tuple] = {}
        # Rank 0 dumps config.yaml just before it builds the trackers.
        self.wrote_file(self.files[0])
        self.close_timeout = spec.close_timeout
        self.images: dict = {}
        self.started = False
        self.worker = _Worker(self.name)

    def wrote_file(self, path: str) -> None:
        identity = _file_identity(path)
        if path in self.files and identity is not None:
            self.written[path] = identity

    def start(self, run_id: str | None) -> None:
        self.started = True
        self.worker.submit(self._start, run_id)

    def log(self, record: dict, scalars: dict, step: int) -> None:
        self.worker.submit(self._log, tracked_metrics(record, scalars, step), step)

    def image(self, tag: str, image, step: int) -> None:
        self.images[tag] = image  # the latest, uploaded at the end

    def hparams(self, hparams: dict, metrics: dict) -> None:
        self.worker.submit(self._log, dict(metrics), None)

    def close(self, status: str) -> None:
        if self.started:  # a run that failed while it was built has none
            self.worker.submit(self._finish, status, dict(self.images))
        self.worker.close(self.close_timeout)

    def _start(self, run_id: str | None) -> None:
        raise NotImplementedError

    def _log(self, metrics: dict, step: int | None) -> None:
        raise NotImplementedError

    def _finish(self, status: str, images: dict) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _own_files(self):
        """Yield {path: a hard link to it} for the files to upload that are
        still those this run wrote, never through a symbolic link.

        The links, in a private folder of OUT_DIR removed afterwards, are
        checked and then uploaded: what is checked is what is sent, even if
        the name in OUT_DIR is replaced meanwhile.  A file this run did not
        write (an earlier run's, or one from before a resume) stays out.
        """
        with tempfile.TemporaryDirectory(prefix=".upload-", dir=self.out_dir) as tmp:
            found = {}
            for path in self.files:
                link = self._checked_link(path, tmp)
                if link is not None:
                    found[path] = link
            yield found

    def _checked_link(self, path: str, folder: str) -> str | None:
        """A hard link in ``folder`` to the file at ``path`` if it is the one
        this run wrote (see :meth:`_own_files`); None, with a line why, if not."""
        if not os.path.lexists(path):
            return None
        wrote = self.written.get(path)
        if wrote is None:
            logger.info(
                "%s: %s is not uploaded, this run did not write it", self.name, path
            )
            return None
        link = os.path.join(folder, os.path.basename(path))
        try:
            os.link(path, link, follow_symlinks=False)  # a symlink's own entry
        except OSError:  # no hard links on this file system: the name itself
            link = path
        if _file_identity(link) == wrote:
            return link
        logger.warning(
            "%s: %s is not uploaded, it was replaced since this run wrote it "
            "(by a link, or another file)",
            self.name,
            path,
        )
        return None


def _file_identity(path: str) -> tuple | None:
    """(device, inode, size, mtime) of the regular file at ``path``; None for a
    symbolic link (never followed), anything else or nothing."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class MlflowTracker(_RemoteTracker):
    """An MLflow run: the config as params, the records as metrics at their
    step, and at the end config.yaml, best.pth and the confusion matrices as
    artifacts (LOG.MLFLOW)."""

    name = "mlflow"

    def __init__(self, spec: TrackerSpec):
        keys = spec.mlflow
        super().__init__(spec, keys)
        self.uri = keys.tracking_uri or None  # None: MLflow reads the environment
        self.experiment = keys.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self._run_id: str | None = None
        self._client: Any = None  # an MlflowClient, once started
        self._started = threading.Event()  # the run was created, or failed to be
        self._waited = False

    @property
    def run_id(self) -> str | None:
        """The MLflow run id; asked for by a checkpoint before the run is
        created (a first epoch faster than the server), it waits for it once,
        up to START_WAIT seconds."""
        if not self._waited:
            self._waited = True
            self._started.wait(START_WAIT)
        return self._run_id

    def text(self, tag: str, text: str, step: int) -> None:
        self.worker.submit(self._text, text, f"{tag}.txt")

    def _start(self, run_id: str | None) -> None:
        try:
            self._begin(run_id)
        finally:
            self._started.set()

    def _begin(self, run_id: str | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = self._client = MlflowClient(self.uri)
        if run_id is None:
            name = self.experiment or "Default"
            experiment = client.get_experiment_by_name(name)
            experiment_id = (
                client.create_experiment(name)
                if experiment is None
                else experiment.experiment_id
            )
            run = client.create_run(experiment_id, run_name=self.run_name)
        else:
            run = client.get_run(run_id)
            client.update_run(run_id, status="RUNNING")
            logger.info("mlflow: continuing run %s", run_id)
        self._run_id = run.info.run_id
        # Params cannot change: a resumed run keeps the values first logged.
        params = [
            Param(key, str(value)[:_MLFLOW_PARAM_CHARS])
            for key, value in self.params.items()
            if key not in run.data.params
        ]
        for first in range(0, len(params), _MLFLOW_BATCH):
            chunk = params[first : first + _MLFLOW_BATCH]
            client.log_batch(self._run_id, params=chunk)

    def _log(self, metrics: dict, step: int | None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [
            Metric(_mlflow_key(key), float(value), now, step or 0)
            for key, value in metrics.items()
        ]
        for first in range(0, len(entries), _MLFLOW_BATCH):
            chunk = entries[first : first + _MLFLOW_BATCH]
            self._client.log_batch(self._run_id, metrics=chunk)

    def _text(self, text: str, name: str) -> None:
        self._client.log_text(self._run_id, text, name)

    def _finish(self, status: str, images: dict) -> None:
        if status == FINISHED:
            with self._own_files() as found:
                for link in found.values():
                    self._client.log_artifact(self._run_id, link)
            for tag, image in images.items():
                self._client.log_image(self._run_id, image, artifact_file=f"{tag}.png")
        self._client.set_terminated(self._run_id, status)


def _mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in metric names replaced."""
    return re.sub(r"[^\w\-. :/]", "_", key)


class WandbTracker(_RemoteTracker):
    """A W&B run in ``OUT_DIR/wandb``: the config, the records as history
    (train/* against train/step, val/* against val/epoch), at the end the
    confusion matrices, config.yaml and, with LOG.WANDB.UPLOAD_BEST, best.pth
    as a model artifact (LOG.WANDB)."""

    name = "wandb"

    def __init__(self, spec: TrackerSpec):
        keys = spec.wandb
        super().__init__(spec, keys)
        self.keys = keys
        # Known before W&B starts, so that the first checkpoint holds it.
        self._run_id = uuid.uuid4().hex[:12]
        self._run: Any = None  # the wandb run, once started

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def histogram(self, tag: str, values, step: int) -> None:
        self.worker.submit(self._histogram, tag, values)

    def _start(self, run_id: str | None) -> None:
        import wandb

        self._run_id = run_id or self._run_id
        run = self._run = wandb.init(
            project=self.keys.project or None,
            entity=self.keys.entity or None,
            mode=self.keys.mode or None,
            dir=self.out_dir,
            id=self._run_id,
            name=self.run_name,
            resume="allow",
        )
        run.config.update(self.params, allow_val_change=True)
        run.define_metric("train/step")
        run.define_metric("train/*", step_metric="train/step")
        for split in ("val", "val_ema"):
            run.define_metric(f"{split}/epoch")
            for pattern in (f"{split}/*", f"{split}_per_class/*"):
                run.define_metric(pattern, step_metric=f"{split}/epoch")
        run.define_metric("memory/*", step_metric="val/epoch")

    def _log(self, metrics: dict, step: int | None) -> None:
        if step is None:  # the final scores
            self._run.summary.update(metrics)
        else:
            self._run.log(metrics)

    def _histogram(self, tag: str, values) -> None:
        import wandb

        self._run.log({tag: wandb.Histogram(values)})

    def _finish(self, status: str, images: dict) -> None:
        import wandb

        run = self._run
        if status == FINISHED:
            run.log({tag: wandb.Image(image) for tag, image in images.items()})
            with self._own_files() as found:
                self._upload(run, found)
        elif status == KILLED:
            run.mark_preempting()
        run.finish(exit_code=1 if status == FAILED else 0)

    def _upload(self, run, found: dict[str, str]) -> None:
        """config.yaml into the run's files, the best weights as a model
        artifact: copies of ``found`` (path -> hard link, see _own_files)."""
        import wandb

        config, *best = self.files
        if config in found:  # a copy: W&B links a saved file, uploaded later
            copy = os.path.join(run.dir, os.path.basename(config))
            shutil.copyfile(found[config], copy)
            run.save(copy, base_path=run.dir, policy="now")
        best = [path for path in best if path in found]
        if best:
            artifact = wandb.Artifact(f"{self._run_id}-best", type="model")
            for path in best:  # "mutable": W&B copies it at once
                artifact.add_file(found[path], name=os.path.basename(path))
            run.log_artifact(artifact)


def build_trackers(spec: TrackerSpec) -> list[Tracker]:
    """The trackers of LOG.TRACKERS (metrics.jsonl is not one: it is always
    written); call on rank 0 only."""
    builders = {
        "tensorboard": lambda: TensorboardTracker(spec.out_dir),
        "csv": lambda: CsvTracker(spec.out_dir),
        "mlflow": lambda: MlflowTracker(spec),
        "wandb": lambda: WandbTracker(spec),
    }
    return [builders[name]() for name in spec.trackers if name in builders]
