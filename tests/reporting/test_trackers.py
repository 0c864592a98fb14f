"""Experiment trackers (LOG.TRACKERS): a real MLflow server, W&B offline, csv.

One tiny run with every tracker, resumed for a second epoch, is shared by the
tests that read what the trackers hold (MLflow through its sqlite store and
artifact folder, W&B through its own reader of the offline run files).  The
server test kills that module's server, after the shared run.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    REPO,
    TINY,
    assert_ok,
    free_port,
    kill_session,
    mlflow_server,
    read_metrics,
    read_text,
    refused,
    run_command,
    start,
    train_net,
)

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from distribuuuu.config import dump_cfg, flat_cfg, get_cfg  # noqa: E402
from distribuuuu.engine.best import save_best_weights  # noqa: E402
from distribuuuu.engine.specs import save_spec, tracker_spec  # noqa: E402
from distribuuuu.reporting.remote_trackers import MlflowTracker, WandbTracker  # noqa: E402
from distribuuuu.reporting.writer import MetricsWriter  # noqa: E402

logger = logging.getLogger(__name__)
EVERY = ["LOG.TRACKERS", "['tensorboard','mlflow','wandb','csv']"]
# Nothing may reach the network: W&B writes its run files only.
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
STEPS = 8  # optimizer steps per epoch of TINY (256 images, batch 32)
TRAIN_KEYS = ("loss", "top1", "topk", "lr", "img_per_s", "data_ms", "samples")
VAL_KEYS = ("loss", "top1", "topk", "samples", "train_samples")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as started:
        logger.info("mlflow server up in %.1f s", started.startup_s)
        yield started


@pytest.fixture(scope="module")
def tracked(server, tmp_path_factory):
    """OUT_DIR of one epoch with every tracker, then resumed for a second."""
    out_dir = str(tmp_path_factory.mktemp("tracked") / "run")
    keys = [*EVERY, "LOG.MLFLOW.TRACKING_URI", server.url, "OUT_DIR", out_dir]
    keys += ["LOG.MLFLOW.EXPERIMENT", "tracked"]
    keys += ["TRAIN.DATA_BOUND_SHARE", "0"]  # no warning but the trackers'
    for epochs in ("1", "2"):
        result = train_net(*TINY, *keys, "OPTIM.MAX_EPOCH", epochs, env=OFFLINE)
        assert_ok(result)
    return out_dir


def saved_runs(out_dir: str) -> dict:
    """The tracker run ids in the run's last checkpoint."""
    name = read_text(out_dir, "checkpoints", "last").strip()
    path = os.path.join(out_dir, "checkpoints", name)
    return torch.load(path, weights_only=True)["tracker_runs"]


def train_step(record: dict) -> int:
    return (record["epoch"] - 1) * STEPS + record["iter"]


def mlflow_run(server, experiment: str):
    client = mlflow.MlflowClient(server.store_uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [run.info.run_id for run in runs]
    return client, runs[0]


@pytest.mark.slow
def test_mlflow_run_holds_config_metrics_and_files(server, tracked):
    client, run = mlflow_run(server, "tracked")
    assert run.info.status == "FINISHED"
    assert len(run.data.params) == len(flat_cfg(get_cfg()))
    assert run.data.params["MODEL.ARCH"] == "lenet5"
    assert run.data.params["OPTIM.MAX_EPOCH"] == "1"  # params keep the first value

    def history(key):
        found = client.get_metric_history(run.info.run_id, key)
        return [(metric.step, metric.value) for metric in found]

    train, val = read_metrics(tracked, "train"), read_metrics(tracked, "val")
    assert len(train) == 8 and len(val) == 2  # 2 epochs of 4 windows
    for key in TRAIN_KEYS:
        expected = [(train_step(r), r[key]) for r in train]
        assert sorted(history(f"train/{key}")) == expected, key
    for key in VAL_KEYS:
        assert sorted(history(f"val/{key}")) == [(r["epoch"], r[key]) for r in val]
    peaks = [(r["epoch"], max(r["peak_mem_mb"])) for r in val]
    assert sorted(history("memory/peak_mb")) == peaks
    best = [value for _, value in history("hparam/best_top1")]  # one per process
    assert max(best) == max(r["top1"] for r in val)

    files = os.path.join(server.artifacts, run.info.experiment_id, run.info.run_id,
                         "artifacts")  # fmt: skip
    for name in ("config.yaml", "best.pth"):
        with (
            open(os.path.join(files, name), "rb") as got,
            open(os.path.join(tracked, name), "rb") as wrote,
        ):
            assert got.read() == wrote.read(), name
    from PIL import Image

    with Image.open(os.path.join(files, "val", "confusion_matrix.png")) as image:
        assert image.format == "PNG" and min(image.size) > 100


@pytest.mark.slow
def test_resumed_run_continues_the_same_tracker_runs(server, tracked):
    _, run = mlflow_run(server, "tracked")  # one run for both processes
    ids = saved_runs(tracked)
    assert ids["mlflow"] == run.info.run_id
    assert sorted(ids) == ["mlflow", "wandb"]
    log = read_text(tracked, "log.txt")
    assert f"mlflow: continuing run {ids['mlflow']}" in log
    assert log.count("WARNING") == 0, log


def wandb_records(run_dir: str) -> list[dict]:
    """The records of an offline W&B run, read by W&B's own reader."""
    (name,) = [n for n in os.listdir(run_dir) if n.endswith(".wandb")]
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json"]
    result = run_command([*cmd, os.path.join(run_dir, name)], timeout=60)
    assert_ok(result)
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_wandb_offline_run_holds_the_same_metrics(tracked):
    run_id = saved_runs(tracked)["wandb"]
    root = os.path.join(tracked, "wandb")
    dirs = sorted(n for n in os.listdir(root) if n.startswith("offline-run-"))
    assert len(dirs) == 2 and all(n.endswith(f"-{run_id}") for n in dirs)
    records = [r for d in dirs for r in wandb_records(os.path.join(root, d))]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    train, val = read_metrics(tracked, "train"), read_metrics(tracked, "val")
    logged_train = [h for h in history if "train/loss" in h]
    assert [h["train/step"] for h in logged_train] == [train_step(r) for r in train]
    for key in TRAIN_KEYS:
        assert [h[f"train/{key}"] for h in logged_train] == [r[key] for r in train]
    logged_val = [h for h in history if "val/top1" in h]
    assert [(h["val/epoch"], h["val/top1"]) for h in logged_val] == [
        (r["epoch"], r["top1"]) for r in val
    ]
    config = [r["config"]["update"] for r in records if r["type"] == "config"][0]
    assert config["MODEL.ARCH"] == "lenet5" and config["TRAIN.BATCH_SIZE"] == 32
    assert os.path.isfile(os.path.join(root, dirs[-1], "files", "config.yaml"))
    assert not [r for r in records if r["type"] == "artifact"]  # UPLOAD_BEST off


def read_csv(out_dir: str, split: str) -> list[dict]:
    with open(os.path.join(out_dir, f"metrics_{split}.csv"), newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_csv_matches_metrics_jsonl(tracked):
    for split in ("train", "val"):
        rows, records = read_csv(tracked, split), read_metrics(tracked, split)
        assert len(rows) == len(records)
        for row, record in zip(rows, records):
            plain = {k: v for k, v in record.items() if not isinstance(v, list)}
            del plain["split"]
            assert set(row) == set(plain) | ({"step"} if split == "train" else set())
            assert all(float(row[k]) == v for k, v in plain.items()), (row, record)
            if split == "train":
                assert int(row["step"]) == train_step(record)


@pytest.mark.slow
def test_a_server_killed_mid_run_does_not_stop_training(server, tracked, tmp_path):
    """Rank 0 is paused (SIGSTOP) after its second window while the server is
    killed: the run then finishes, exit 0, with one warning.  A checkpoint
    after every step makes sure the MLflow run exists by then (the first
    checkpoint waits for it)."""
    out_dir = str(tmp_path / "run")
    keys = ["TRAIN.PRINT_FREQ", "1", "CHECKPOINT.PERIOD_ITERS", "1", "OUT_DIR", out_dir]
    keys += ["TRAIN.DATA_BOUND_SHARE", "0", "LOG.TRACKERS", "['mlflow']"]
    keys += ["LOG.MLFLOW.TRACKING_URI", server.url, "LOG.MLFLOW.EXPERIMENT", "killed"]
    proc = start([sys.executable, "tools/train_net.py", *TINY, *keys])
    try:
        metrics = os.path.join(out_dir, "metrics.jsonl")
        deadline = time.monotonic() + 120
        while not os.path.exists(metrics) or read_text(metrics).count('"train"') < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        server.stop()
        os.kill(proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        out, err = proc.communicate(timeout=180)
        finished_s = time.monotonic() - resumed
    finally:
        if proc.returncode is None:
            kill_session(proc)
    _, run = mlflow_run(server, "killed")
    assert run.info.status == "RUNNING"  # created, never ended: the server died
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert len(read_metrics(out_dir, "train")) == STEPS
    assert len(read_metrics(out_dir, "val")) == 1
    assert os.path.isfile(os.path.join(out_dir, "best.pth"))
    log = read_text(out_dir, "log.txt")
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "mlflow tracker stopped logging" in warnings[0]
    assert "Retrying" not in out + err  # urllib3's retries stay quiet
    logger.info("the run ended %.1f s after the server died", finished_s)


def test_logging_never_waits_for_a_dead_server(tmp_path, caplog):
    """Nothing listens on the tracking URI: no call waits for it, one
    warning, and closing waits only for MLflow's bounded retries."""
    cfg = get_cfg()
    cfg.OUT_DIR = str(tmp_path)
    cfg.LOG.MLFLOW.TRACKING_URI = f"http://127.0.0.1:{free_port()}"
    writer = MetricsWriter(cfg.OUT_DIR, True, [MlflowTracker(tracker_spec(cfg))])
    slowest = 0.0
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        writer.start({})
        for step in range(1, 201):
            tic = time.perf_counter()
            record = {"split": "train", "loss": 1.0 / step}
            writer.write(record, {"train/loss": record["loss"]}, step)
            slowest = max(slowest, time.perf_counter() - tic)
        tic = time.perf_counter()
        writer.close()
        closing = time.perf_counter() - tic
    # A call that waited for the server would last MLflow's retries (a
    # second try at once, a third 2 s later: MLFLOW_HTTP_DEFAULTS); a busy
    # machine can hold any call for a second (1.1 s seen at pytest -n 2).
    assert slowest < 1.5, slowest
    assert closing < 30, closing
    assert len(read_metrics(str(tmp_path))) == 200
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "mlflow tracker stopped" in warned[0].getMessage()


def test_unknown_tracker_is_refused(tmp_path):
    line = refused(str(tmp_path / "out"), *TINY, "LOG.TRACKERS", "['neptune']")
    assert "LOG.TRACKERS 'neptune' is invalid" in line and "mlflow" in line
    line = refused(str(tmp_path / "out"), *TINY, "LOG.TRACKERS", "['csv','csv']")
    assert "lists csv twice" in line


@pytest.mark.slow
def test_missing_mlflow_names_the_extra(tmp_path):
    """``import mlflow`` raises ImportError in the run (a folder on PYTHONPATH
    shadows it): exit 2 before anything is written."""
    shadow = tmp_path / "shadow" / "mlflow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    env = {"PYTHONPATH": os.pathsep.join([str(shadow.parent), REPO])}
    out_dir = tmp_path / "out"
    result = train_net(*TINY, "LOG.TRACKERS", "['csv','mlflow']", "OUT_DIR",
                       str(out_dir), env=env)  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "hidden by the test" in line
    assert "pip install 'distribuuuu[mlflow]'" in line
    assert not out_dir.exists()


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    """The same in this process: ``import wandb`` fails (None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    line = refused(str(tmp_path / "out"), *TINY, "LOG.TRACKERS", "['wandb']")
    assert "pip install 'distribuuuu[wandb]'" in line


# --------------------------------------------------------------------------- #
# UPLOAD_BEST sends only the files this run wrote (fake MLflow and W&B clients)
# --------------------------------------------------------------------------- #


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def uploads(monkeypatch, tmp_path) -> dict[str, bytes]:
    """What the MLflow and W&B trackers upload (file name -> bytes, read as
    it is handed over), to fake clients that talk to no server."""
    sent: dict[str, bytes] = {}

    class MlflowClient:
        def __init__(self, uri=None):
            pass

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            return "0"

        def create_run(self, experiment_id, run_name=None):
            info, data = SimpleNamespace(run_id="r1"), SimpleNamespace(params={})
            return SimpleNamespace(info=info, data=data)

        def log_batch(self, run_id, metrics=(), params=()):
            pass

        def log_artifact(self, run_id, local_path, artifact_path=None):
            sent[os.path.basename(local_path)] = _read(local_path)

        def set_terminated(self, run_id, status):
            pass

    class WandbRun:
        dir = str(tmp_path / "wandb-files")
        config = SimpleNamespace(update=lambda *args, **kwargs: None)

        def define_metric(self, *args, **kwargs):
            pass

        def log(self, metrics):
            pass

        def save(self, path, base_path=None, policy="live"):
            sent[os.path.basename(path)] = _read(path)

        def log_artifact(self, artifact):
            sent.update(artifact.files)

        def finish(self, exit_code=0):
            pass

    class Artifact:
        def __init__(self, name, type):
            self.files = {}

        def add_file(self, local_path, name=None):
            self.files[name or os.path.basename(local_path)] = _read(local_path)

    os.makedirs(WandbRun.dir)
    wandb = types.ModuleType("wandb")
    wandb.init, wandb.Artifact = lambda **kwargs: WandbRun(), Artifact
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(mlflow, "MlflowClient", MlflowClient)
    return sent


def _best_weights_saved(cfg, writer: MetricsWriter, name: str) -> None:
    """save_best_weights of a one-tensor model at epoch 1, as an evaluation does."""
    strategy = SimpleNamespace(model_state_dict=lambda model: {"w": torch.ones(2)})
    progress = SimpleNamespace(epoch=1)
    state = SimpleNamespace(strategy=strategy, model=None, progress=progress,
                            classes=["a", "b"], writer=writer)  # fmt: skip
    save_best_weights(save_spec(cfg), state, ("top1", 50.0), name)


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
@pytest.mark.parametrize("planted", ["earlier-run", "symlink", "link-after-save"])
def test_upload_best_sends_only_what_this_run_wrote(
    tracker, planted, uploads, tmp_path, caplog
):
    """best.pth, saved by this run, is uploaded; best_ema.pth is not: left by
    an earlier run, a planted link to a secret, or this run's file replaced by
    such a link after the save."""
    out = tmp_path / "out"
    out.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"a secret")
    ema = out / "best_ema.pth"
    if planted == "earlier-run":
        ema.write_bytes(b"weights of an earlier run")
    elif planted == "symlink":
        ema.symlink_to(secret)
    cfg = get_cfg()
    cfg.OUT_DIR = str(out)
    cfg.LOG.MLFLOW.UPLOAD_BEST = cfg.LOG.WANDB.UPLOAD_BEST = True
    dump_cfg(cfg)
    build = {"mlflow": MlflowTracker, "wandb": WandbTracker}[tracker]
    writer = MetricsWriter(cfg.OUT_DIR, True, [build(tracker_spec(cfg))])
    writer.start({})
    _best_weights_saved(cfg, writer, "best.pth")
    if planted == "link-after-save":
        _best_weights_saved(cfg, writer, "best_ema.pth")
        os.remove(ema)
        ema.symlink_to(secret)
    with caplog.at_level(logging.INFO, logger="distribuuuu"):
        writer.close("FINISHED")
    assert sorted(uploads) == ["best.pth", "config.yaml"]
    assert uploads["best.pth"] == _read(str(out / "best.pth"))
    assert uploads["config.yaml"] == _read(str(out / "config.yaml"))
    assert b"a secret" not in uploads.values()
    said = [r.getMessage() for r in caplog.records if "best_ema.pth" in r.getMessage()]
    assert len(said) == 1 and "is not uploaded" in said[0]
    assert [name for name in os.listdir(out) if name.startswith(".")] == []
