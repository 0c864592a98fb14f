"""End to end: the real entry point, single process and real gloo process groups."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import yaml
from helpers import (
    FAST,
    REPO,
    TINY,
    TINY_VAL_SIZE,
    TRAIN_NET,
    assert_ok,
    free_port,
    read_metrics,
    read_text,
    run_command,
    run_python,
    torchrun,
    train_net,
)

VAL_SIZE = 1000  # the embedded validation split
TWO_EPOCHS = [*FAST, "OPTIM.MAX_EPOCH", "2"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> str:
    """An uninterrupted 2-epoch run of the embedded data set, single process."""
    out_dir = str(tmp_path_factory.mktemp("reference"))
    assert_ok(train_net(*TWO_EPOCHS, "OUT_DIR", out_dir))
    return out_dir


@pytest.mark.slow
def test_single_process_run_writes_every_output(reference_run):
    out = reference_run
    cfg = yaml.safe_load(read_text(out, "config.yaml"))
    assert cfg["DATA"]["NAME"] == "mnist5k" and cfg["MODEL"]["ARCH"] == "resnet8"
    val = read_metrics(out, "val")
    assert [r["epoch"] for r in val] == [1, 2]
    assert val[-1]["samples"] == VAL_SIZE and val[-1]["world_size"] == 1
    assert val[-1]["top1"] >= 80.0  # two epochs of a tiny ResNet already learn
    for key in ("topk", "loss"):
        assert key in val[-1]
    train = read_metrics(out, "train")
    assert {"epoch", "iter", "loss", "lr", "img_per_s"} <= set(train[0])
    assert train[0]["img_per_s_per_rank"] == train[0]["img_per_s"] > 0
    assert any(
        name.startswith("events.out.tfevents") for name in os.listdir(f"{out}/tb")
    )
    log = read_text(out, "log.txt")
    assert "val ep 2/2" in log and "eta" in log
    assert "data-bound" not in log  # in-memory digits keep the steps busy
    checkpoints = os.path.join(out, "checkpoints")
    assert read_text(checkpoints, "last").strip() == "ckpt_ep_0002.pth"
    state = torch.load(os.path.join(checkpoints, "ckpt_ep_0002.pth"), weights_only=True)
    assert state["epoch"] == 2 and "optimizer" in state and "MODEL:" in state["cfg"]
    best = torch.load(os.path.join(out, "best.pth"), weights_only=True)
    assert best["top1"] == max(r["top1"] for r in val)


@pytest.mark.slow
def test_eval_only_prints_top1_of_the_best_weights(reference_run):
    result = train_net("--eval-only", *FAST, "OUT_DIR", reference_run)
    assert_ok(result)
    best = max(r["top1"] for r in read_metrics(reference_run, "val")[:2])
    assert f"top1 {best:.2f}  top5" in result.stdout
    assert "samples 1000" in result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_counts_every_validation_sample_once(tmp_path):
    """3 ranks (2 ranks: test_deprecated_launcher)."""
    nproc, out = 3, str(tmp_path)
    result = torchrun(nproc, *TINY, "OUT_DIR", out)
    assert_ok(result)
    (val,) = read_metrics(out, "val")
    assert val["world_size"] == nproc and val["samples"] == TINY_VAL_SIZE
    train = read_metrics(out, "train")[-1]
    assert train["world_size"] == nproc
    assert train["img_per_s_per_rank"] * nproc == pytest.approx(train["img_per_s"])
    assert os.path.exists(os.path.join(out, f"log_rank{nproc - 1}.txt"))
    log = read_text(out, "log.txt")
    assert f"rank 0 of {nproc}" in log and "backend gloo" in log
    assert "/rank)" in log  # per-process img/s beside the global figure


@pytest.mark.slow
def test_deprecated_launcher(tmp_path):
    """``python -m torch.distributed.launch``, which passes ``--local-rank=N``
    (the launcher forked from the zygote, its ranks new interpreters)."""
    cmd = ["-m", "torch.distributed.launch", "--nproc_per_node=2"]
    cmd += [f"--master_port={free_port()}", TRAIN_NET, *TINY, "OUT_DIR", str(tmp_path)]
    assert_ok(run_python(cmd))
    (val,) = read_metrics(str(tmp_path), "val")
    assert val["world_size"] == 2 and val["samples"] == TINY_VAL_SIZE


@pytest.mark.distributed
@pytest.mark.slow
def test_original_override_line_with_syncbn_on_cpu(tmp_path):
    result = torchrun(
        2,
        "--cfg",
        "config/resnet18.yaml",
        "OUT_DIR",
        str(tmp_path),
        "MODEL.SYNCBN",
        "True",
        "TRAIN.BATCH_SIZE",
        "8",
        "MODEL.DUMMY_INPUT",
        "True",
        "OPTIM.MAX_EPOCH",
        "1",
        "TRAIN.IM_SIZE",
        "64",
        "TEST.IM_SIZE",
        "64",
        "DATA.SYNTHETIC_SIZE",
        "[32, 16]",
        "TRAIN.WORKERS",
        "0",
        "TEST.BATCH_SIZE",
        "8",
    )
    assert_ok(result)
    log = read_text(tmp_path, "log.txt")
    assert "CPU SyncBN active" in log
    (val,) = read_metrics(str(tmp_path), "val")
    assert val["samples"] == 16 and val["world_size"] == 2
    cfg = yaml.safe_load(read_text(tmp_path, "config.yaml"))
    assert cfg["DATA"]["NAME"] == "synthetic" and cfg["MODEL"]["ARCH"] == "resnet18"


def test_local_rank_argument_forms():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import train_net as cli
    finally:
        sys.path.pop(0)
    assert cli.parse_args(["--local-rank=1", "OPTIM.MAX_EPOCH", "2"]).local_rank == 1
    args = cli.parse_args(["--local_rank", "3", "--cfg", "x.yaml", "A", "1"])
    assert (args.local_rank, args.cfg_file, args.opts) == (3, "x.yaml", ["A", "1"])


CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "distribuuuu-train")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CONSOLE_SCRIPT), reason="not pip-installed")
def test_console_script_is_the_same_entry():
    result = run_command([CONSOLE_SCRIPT, "OPTIM.BASE_LR", "fast"], timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: OPTIM.BASE_LR")
