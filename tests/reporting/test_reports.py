"""What a run shows: progress on a terminal or in a log, the start-up report,
tensorboard beyond scalars, per-class results, --dry-run."""

from __future__ import annotations

import csv
import os
import pty
import subprocess

import pytest
import torch
from helpers import (
    REPO,
    TRAIN_NET,
    assert_ok,
    kill_tree,
    python_command,
    read_metrics,
    read_text,
    train_net,
)
from tensorboard.backend.event_processing import event_accumulator

from distribuuuu.reporting.meters import ConfusionMatrix, per_class_top1

# Two short epochs of the small ResNet on 10-class synthetic images.
SMALL = [
    "MODEL.ARCH", "resnet8", "DATA.NAME", "synthetic",
    "DATA.SYNTHETIC_SIZE", "[256, 64]", "TRAIN.BATCH_SIZE", "32",
    "TRAIN.PRINT_FREQ", "3", "OPTIM.MAX_EPOCH", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory) -> tuple[str, str]:
    """A run whose output goes to a pipe, as in a Slurm log: (OUT_DIR, stdout)."""
    out_dir = str(tmp_path_factory.mktemp("piped"))
    result = train_net(*SMALL, "OUT_DIR", out_dir)
    assert_ok(result)
    return out_dir, result.stdout


def run_in_terminal(args: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run train_net.py with a pseudo-terminal as its console; (exit code, output)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        python_command([TRAIN_NET, *args]),
        cwd=REPO,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "160"},
        start_new_session=True,
    )
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closes when the program exits
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=timeout)
    finally:
        kill_tree(proc.pid)
        proc.wait()
        os.close(leader)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_terminal_shows_a_live_bar_with_eta(tmp_path):
    one_epoch = ["OPTIM.MAX_EPOCH", "1"]
    code, output = run_in_terminal([*SMALL, *one_epoch, "OUT_DIR", str(tmp_path)])
    assert code == 0, output[-3000:]
    redraws = [part for part in output.split("\r") if part.startswith("ep 1/1 [")]
    assert len(redraws) >= 2  # redrawn in place, step after step
    final = redraws[-1]
    assert "8/8" in final and "eta 0:00:00" in final and "img/s" in final
    assert "loss " in final and "top1 " in final and "lr " in final
    assert "\rval [" in output  # evaluation progress, erased afterwards
    # The bar replaces the console's train lines; the log file keeps them all.
    assert "train ep" not in output
    assert "train ep 1/1 it 8/8" in read_text(str(tmp_path), "log.txt")
    assert "val ep 1/1" in output


def test_pipe_gets_plain_lines(piped_run):
    _, stdout = piped_run
    assert "\r" not in stdout and "\033" not in stdout
    for line in ("train ep 1/2 it 3/8", "train ep 2/2 it 8/8", "val ep 2/2"):
        assert line in stdout
    assert "eta " in stdout


def test_startup_report_names_versions_layout_data_model_and_batch(piped_run):
    out_dir, stdout = piped_run
    assert stdout.count("start-up report") == 1
    report = stdout[stdout.index("start-up report") :]
    expected = [
        f"torch {torch.__version__}",
        "world: 1 process(es) on 1 node(s)",
        "launcher none",
        "data: synthetic, 256 train / 64 val images, 10 classes",
        "decoder fused",
        "model: resnet8, 78.04 K parameters",
        "memory: 0.30 MiB of parameters on the fullest process",
        "batch: 32 per process x 1 accumulation step(s) x 1 process(es) = global "
        "batch 32; LR 0.1 (cos); strategy ddp; precision none; seed 1",
        "start: a new run",
    ]
    for text in expected:
        assert text in report
    (start,) = read_metrics(out_dir, "start")
    assert start["model"]["parameters"] == 78042
    assert start["data"]["decoder"] == "fused"
    assert start["batch"]["global"] == 32 and start["world"]["world_size"] == 1


def test_tensorboard_holds_hparams_per_class_confusion_and_images(piped_run):
    out_dir, _ = piped_run
    events = event_accumulator.EventAccumulator(
        os.path.join(out_dir, "tb"),
        size_guidance={event_accumulator.IMAGES: 0, event_accumulator.SCALARS: 0},
    )
    events.Reload()
    tags = events.Tags()
    hparams = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams
    assert b"OPTIM.BASE_LR" in hparams["_hparams_/session_start_info"]
    per_class = [f"val_per_class/{digit}" for digit in range(10)]
    assert set(per_class) <= set(tags["scalars"])
    val = read_metrics(out_dir, "val")
    assert [e.value for e in events.Scalars("val_per_class/3")] == pytest.approx(
        [r["per_class_top1"][3] for r in val]
    )
    assert [e.value for e in events.Scalars("hparam/top1")] == pytest.approx(
        [val[-1]["top1"]]
    )
    for tag in ("train/lr", "train/img_per_s", "memory/peak_mb"):
        assert tag in tags["scalars"]
    confusion = events.Images("val/confusion_matrix")
    assert [image.step for image in confusion] == [1, 2]
    assert confusion[0].width > 100 and confusion[0].height > 100
    (grid,) = events.Images("train/augmented_images")
    assert grid.width > 0
    assert "val/per_class_top1" in tags["histograms"]
    assert all(len(r["peak_mem_mb"]) == 1 and r["peak_mem_mb"][0] > 0 for r in val)


@pytest.mark.slow
def test_eval_only_writes_per_class_results(piped_run):
    out_dir, _ = piped_run
    result = train_net("--eval-only", *SMALL, "OUT_DIR", out_dir)
    assert_ok(result)
    assert "per-class top-1" in result.stdout and "class  samples" in result.stdout
    with open(os.path.join(out_dir, "confusion_matrix.csv"), encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0][1:] == [str(digit) for digit in range(10)]
    counts = torch.tensor([[int(v) for v in row[1:]] for row in rows[1:]])
    assert counts.sum() == 64  # every validation image once
    eval_record = read_metrics(out_dir, "val")[-1]
    assert eval_record["eval_only"]
    assert per_class_top1(counts) == pytest.approx(eval_record["per_class_top1"])
    with open(os.path.join(out_dir, "per_class_accuracy.csv"), encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert sum(int(row["correct"]) for row in table) == counts.trace()
    with open(os.path.join(out_dir, "confusion_matrix.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.distributed
@pytest.mark.slow
def test_dry_run_checks_every_rank_and_writes_nothing(tmp_path):
    out_dir = tmp_path / "never"
    result = train_net("--dry-run", "--num-procs", "2", *SMALL, "OUT_DIR", str(out_dir))
    assert_ok(result)
    assert "train ep 1/2 it 1/4" in result.stdout  # one step of 2 x 32 images
    assert "dry run passed" in result.stdout
    assert "world: 2 process(es) on 1 node(s)" in result.stdout
    assert not out_dir.exists()


def test_confusion_matrix_counts_pairs():
    matrix = ConfusionMatrix(torch.device("cpu"), 3)
    logits = torch.eye(3)[[0, 1, 1, 2]]  # predictions 0, 1, 1, 2
    matrix.update(logits, torch.tensor([0, 1, 2, 2]))
    counts = matrix.reduce()
    assert counts.tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    assert per_class_top1(counts) == [100.0, 100.0, 50.0]
    assert per_class_top1(torch.zeros(2, 2, dtype=torch.int64)) == [None, None]


def test_image_grid_shows_the_augmented_training_images():
    """The tensorboard grid holds the training images as the model gets them
    before normalisation: the first tile is sample 0 under the run's seed."""
    from distribuuuu.config import load_cfg
    from distribuuuu.data import build_dataset
    from distribuuuu.engine.run_log import log_training_images
    from distribuuuu.engine.specs import data_spec

    class Capture:
        def image(self, tag: str, pixels) -> None:
            self.tag, self.pixels = tag, pixels

    dataset = build_dataset(data_spec(load_cfg()), train=True)
    writer = Capture()
    log_training_images(writer, dataset, seed=3)
    torch.manual_seed(3)
    first = dataset[0][0].permute(1, 2, 0).numpy()
    assert writer.pixels.shape == (2 + 2 * 30, 2 + 8 * 30, 3)  # 2 rows of 8, padded
    assert (writer.pixels[2:30, 2:30] == first).all()
