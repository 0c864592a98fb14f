"""Hostile configs and start-up faults get one ``error:`` line, before anything
is written: crafted yaml (deep, aliases, huge), non-finite numbers, absurd
timeouts, a batch larger than the data, CFG_DEST naming the run's own files,
TRAIN.AUTO_RESUME False over another run's checkpoints, and Ctrl-C or SIGTERM
while the run starts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    TRAIN_NET,
    assert_ok,
    call_main,
    kill_session,
    start,
    train_net,
)
from test_hostile import (
    assert_one_error_line,
    folder_args,
    make_image_folder,
    snapshot,
)

from distribuuuu import checkpoint as cp
from distribuuuu.config import MAX_YAML_BYTES, dump_cfg, get_cfg, load_cfg
from distribuuuu.errors import CheckpointError, OutputPathError
from distribuuuu.inference.read import read_checkpoint, saved_cfg
from distribuuuu.preflight import check_batch_fits


def refused(tmp_path: Path, args: list[str], words: list[str]) -> str:
    """``train_net ARGS`` (a TINY run) in this process: exit 2, one error line
    holding ``words``, and its fresh OUT_DIR never created.

    Leading ``--flag value`` pairs of ``args`` go before the KEY VALUE pairs.
    """
    flags, args = [], list(args)
    while args and args[0].startswith("--"):
        flags, args = flags + args[:2], args[2:]
    out = tmp_path / "out"
    result = call_main(*flags, *TINY, *args, "OUT_DIR", str(out))
    line = assert_one_error_line(result, 2, words)
    assert not out.exists()
    return line


def laughs(levels: int) -> str:
    """OPTIM.STEPS as nested aliases ("billion laughs"): 9**levels values once
    expanded, from a file of a few hundred bytes."""
    items = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels):
        items.append(f"&a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "OPTIM:\n  STEPS: [" + ", ".join(items) + "]\n"


def nested(value: str, levels: int) -> str:
    """``value`` inside ``levels`` nested yaml lists."""
    return "[" * levels + value + "]" * levels


# --------------------------------------------------------------------------- #
# Crafted yaml
# --------------------------------------------------------------------------- #

# Six levels (531,441 values) exceed the limit as the nine (387 million)
# do, and stay small enough not to exhaust memory on code without the limit.
YAML_CASES = {
    "nested-50000-deep": (
        "OPTIM:\n  STEPS: " + "[" * 50_000 + "]" * 50_000 + "\n",
        ["nested deeper than 64 levels"],
    ),
    "billion-laughs": (laughs(6), ["aliases", "expanded"]),
    "alias-inside-itself": ("OPTIM: &o\n  STEPS: *o\n", ["alias"]),
    # Each alias adds the depth of what it names: 3 x 30 levels once expanded.
    "aliases-deeper-than-64": (
        "OPTIM:\n  STEPS: [&a "
        + nested("0", 30)
        + ", &b "
        + nested("*a", 30)
        + ", "
        + nested("*b", 30)
        + "]\n",
        ["aliases", "64 levels"],
    ),
    "larger-than-1-mib": (
        "# " + "x" * MAX_YAML_BYTES + "\nOPTIM:\n  BASE_LR: 0.1\n",
        ["larger than 1024 KiB"],
    ),
    # yaml itself keeps the last of two keys: the first block would be lost.
    "a-section-twice": (
        "OPTIM:\n  BASE_LR: 0.2\nTRAIN:\n  BATCH_SIZE: 16\nOPTIM:\n  MAX_EPOCH: 3\n",
        ["key OPTIM is given twice", "lines 1 and 5"],
    ),
    "a-key-twice": (
        "OPTIM:\n  BASE_LR: 0.2\n  BASE_LR: 0.3\n",
        ["key BASE_LR is given twice", "lines 2 and 3"],
    ),
}


@pytest.mark.parametrize("case", YAML_CASES)
def test_crafted_yaml_exits_2(case, tmp_path):
    text, words = YAML_CASES[case]
    path = tmp_path / "crafted.yaml"
    path.write_text(text)
    tic = time.perf_counter()
    refused(tmp_path, ["--cfg", str(path)], [str(path), *words])
    assert time.perf_counter() - tic < 10


def test_small_aliases_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("TRAIN:\n  IM_SIZE: &size 28\nTEST:\n  IM_SIZE: *size\n")
    result = call_main("--cfg", str(path), "--print-config", *TINY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("IM_SIZE: 28") == 2


def test_a_key_twice_in_a_base_file_exits_2(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("TRAIN:\n  BATCH_SIZE: 32\nTRAIN:\n  IM_SIZE: 28\n")
    path = tmp_path / "child.yaml"
    path.write_text("_BASE_: base.yaml\nOPTIM:\n  BASE_LR: 0.2\n")
    words = [str(base), "key TRAIN is given twice", "lines 1 and 3"]
    refused(tmp_path, ["--cfg", str(path)], words)


def test_a_merge_may_still_be_overridden(tmp_path):
    """``<<: *name`` then a key of the mapping: no key given twice."""
    path = tmp_path / "merge.yaml"
    path.write_text(
        "TRAIN: &train\n  IM_SIZE: 28\n  BATCH_SIZE: 32\n"
        "TEST:\n  <<: *train\n  BATCH_SIZE: 64\n"
    )
    cfg = load_cfg(str(path), TINY)
    assert (cfg.TEST.IM_SIZE, cfg.TEST.BATCH_SIZE, cfg.TRAIN.BATCH_SIZE) == (28, 64, 32)


@pytest.mark.parametrize("text", [laughs(6), "a: " + "[" * 50_000 + "]" * 50_000])
def test_crafted_cfg_dump_in_a_checkpoint_is_refused(text, tmp_path):
    """A checkpoint is untrusted input: its cfg dump is read with the same bounds."""
    path = tmp_path / "crafted.pth"
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 1, "cfg": text}, path)
    with pytest.raises(CheckpointError, match="its cfg is unreadable") as error:
        saved_cfg(read_checkpoint(str(path)))
    assert "alias" in str(error.value) or "64 levels" in str(error.value)


# --------------------------------------------------------------------------- #
# Numbers: inf, nan, a timeout beyond any clock
# --------------------------------------------------------------------------- #


def _yaml_number(tmp: Path, section: str, key: str, value: str) -> list[str]:
    path = tmp / "numbers.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    return ["--cfg", str(path)]


NUMBER_CASES = {
    "base-lr-1e999": (["OPTIM.BASE_LR", "1e999"], ["OPTIM.BASE_LR", "inf"]),
    "weight-decay-1e999": (
        ["OPTIM.WEIGHT_DECAY", "1e999"],
        ["OPTIM.WEIGHT_DECAY", "inf"],
    ),
    "momentum-minus-1e999": (["OPTIM.MOMENTUM", "-1e999"], ["OPTIM.MOMENTUM", "-inf"]),
    "betas-item-1e999": (["OPTIM.BETAS", "[0.9, 1e999]"], ["OPTIM.BETAS", "inf"]),
    "yaml-base-lr-inf": (("OPTIM", "BASE_LR", ".inf"), ["OPTIM.BASE_LR", "inf"]),
    "yaml-base-lr-nan": (("OPTIM", "BASE_LR", ".nan"), ["OPTIM.BASE_LR", "nan"]),
    "yaml-weight-decay-nan": (
        ("OPTIM", "WEIGHT_DECAY", ".nan"),
        ["OPTIM.WEIGHT_DECAY", "nan"],
    ),
    "yaml-label-smoothing-nan": (
        ("TRAIN", "LABEL_SMOOTHING", ".nan"),
        ["TRAIN.LABEL_SMOOTHING", "nan"],
    ),
}


@pytest.mark.parametrize("case", NUMBER_CASES)
def test_non_finite_numbers_exit_2(case, tmp_path):
    args, words = NUMBER_CASES[case]
    if isinstance(args, tuple):
        args = _yaml_number(tmp_path, *args)
    refused(tmp_path, list(args), [*words, "finite"])


def test_a_huge_value_gives_a_short_error_line(tmp_path):
    """20,000 steps, a line of 110,000 characters before it was cut (python
    takes seconds to parse the issue's 99,990)."""
    steps = "[" + ",".join(str(step) for step in range(1, 20_001)) + "]"
    line = refused(tmp_path, ["OPTIM.STEPS", steps], ["OPTIM.STEPS", "characters cut"])
    assert len(line) < 2100


@pytest.mark.parametrize("seconds", ["100000000000000000000", "604801"])
def test_init_timeout_beyond_seven_days_exits_2(seconds, tmp_path):
    refused(tmp_path, ["DIST.INIT_TIMEOUT", seconds], ["DIST.INIT_TIMEOUT", seconds])


# --------------------------------------------------------------------------- #
# A batch larger than the training set (found before anything is written)
# --------------------------------------------------------------------------- #


def _image_folder(tmp: Path) -> list[str]:
    return folder_args(make_image_folder(tmp / "data", 3))  # 12 training images


BATCH_CASES = {
    "synthetic": (["TRAIN.BATCH_SIZE", "257"], ["257", "256 training images"]),
    "accumulation": (
        ["TRAIN.BATCH_SIZE", "128", "TRAIN.ACCUM_STEPS", "3"],
        ["TRAIN.ACCUM_STEPS 3", "384 images", "256 training images"],
    ),
    "two-processes": (
        ["--num-procs", "2", "TRAIN.BATCH_SIZE", "129"],
        ["129", "128 training images of each of the 2 processes"],
    ),
    "mnist5k": (["DATA.NAME", "mnist5k", "TRAIN.BATCH_SIZE", "4001"], ["4000"]),
    "imagefolder": (
        ["TRAIN.BATCH_SIZE", "13"],
        ["13", "12 training images"],
    ),
}


@pytest.mark.parametrize("case", BATCH_CASES)
def test_batch_larger_than_the_training_set_exits_2(case, tmp_path):
    args, words = BATCH_CASES[case]
    if case == "imagefolder":
        args = [*_image_folder(tmp_path), *args]
    refused(tmp_path, args, ["TRAIN.BATCH_SIZE", *words])


def test_batch_that_fills_the_training_set_is_not_refused(tmp_path):
    args = [*TINY, *_image_folder(tmp_path), "TRAIN.BATCH_SIZE", "12"]
    cfg = load_cfg(None, [*args, "OUT_DIR", str(tmp_path / "out")])
    check_batch_fits(cfg, 1)  # 12 images, a step of 12
    cfg = load_cfg(None, [*args, "TRAIN.BATCH_SIZE", "6", "OUT_DIR", "unused"])
    check_batch_fits(cfg, 2)  # 6 images of each process


# --------------------------------------------------------------------------- #
# CFG_DEST naming the run's own files
# --------------------------------------------------------------------------- #

CFG_DESTS = [
    "log.txt",
    "log_rank1.txt",
    "metrics.jsonl",
    "checkpoints",
    "best.pth",
    "best_ema.pth",
    "tb",
    "..",
    ".",
    ".yaml",
]


@pytest.mark.parametrize("dest", CFG_DESTS)
def test_cfg_dest_naming_the_runs_files_exits_2(dest, tmp_path):
    refused(tmp_path, ["CFG_DEST", dest], ["CFG_DEST", repr(dest), ".yaml"])


def test_dump_cfg_leaves_no_temporary_file(tmp_path):
    """A write refused (here: CFG_DEST taken by a folder) leaves no temp file."""
    cfg = get_cfg()
    (tmp_path / cfg.CFG_DEST).mkdir()
    with pytest.raises(OutputPathError, match="is a folder"):
        dump_cfg(cfg, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [cfg.CFG_DEST]
    shutil.rmtree(tmp_path / cfg.CFG_DEST)
    path = dump_cfg(cfg, str(tmp_path))
    assert os.listdir(tmp_path) == [cfg.CFG_DEST]
    assert oct(os.stat(path).st_mode & 0o777) != oct(0o600)  # as open() makes it


# --------------------------------------------------------------------------- #
# TRAIN.AUTO_RESUME False over another run's checkpoints
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def used_out_dir(tmp_path_factory) -> Path:
    """OUT_DIR of a finished TINY run: checkpoints, best.pth, logs."""
    out = tmp_path_factory.mktemp("used") / "out"
    assert_ok(train_net(*TINY, "OUT_DIR", str(out), timeout=120))
    assert (out / "checkpoints" / "ckpt_ep_0001.pth").is_file()
    return out


@pytest.mark.parametrize("keep", ["everything", "best.pth", "best_ema.pth"])
def test_auto_resume_false_over_checkpoints_exits_2(keep, used_out_dir, tmp_path):
    out = Path(shutil.copytree(used_out_dir, tmp_path / "out"))
    if keep != "everything":  # only best weights left: still another run's
        shutil.rmtree(out / "checkpoints")
        (out / "best.pth").rename(out / keep)
    before = snapshot(out)
    args = [*TINY, "TRAIN.AUTO_RESUME", "False", "OUT_DIR", str(out)]
    result = call_main(*args)
    words = ["TRAIN.AUTO_RESUME False", str(out), "fresh OUT_DIR", "AUTO_RESUME True"]
    assert_one_error_line(result, 2, words)
    assert snapshot(out) == before


@pytest.mark.slow
def test_auto_resume_false_dry_run_is_not_refused(used_out_dir, tmp_path):
    """--dry-run writes no checkpoint, so it may run beside another run's."""
    out = Path(shutil.copytree(used_out_dir, tmp_path / "out"))
    before = snapshot(out)
    result = train_net(
        "--dry-run", *TINY, "TRAIN.AUTO_RESUME", "False", "OUT_DIR", str(out)
    )
    assert_ok(result)
    assert snapshot(out) == before


@pytest.mark.slow
def test_resumed_run_is_not_refused_for_the_configured_batch(used_out_dir, tmp_path):
    """A checkpoint's batch wins on resume: a configured batch larger than the
    data is no reason to refuse (the run resumes with the saved batch of 32)."""
    out = Path(shutil.copytree(used_out_dir, tmp_path / "out"))
    args = [*TINY, "TRAIN.BATCH_SIZE", "1000", "OUT_DIR", str(out)]
    result = train_net("--dry-run", *args)
    assert_ok(result)


# --------------------------------------------------------------------------- #
# Ctrl-C and SIGTERM while the run starts
# --------------------------------------------------------------------------- #


def _opened(pid: int, path: Path) -> bool:
    """True while process ``pid`` holds ``path`` open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """Wait for ``proc`` (a minute at most), then reap anything it left."""
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        pytest.fail("still running a minute after the signal")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _wait_for(proc: subprocess.Popen, ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_session(proc)
            pytest.fail("the run ended or never got there")
        time.sleep(0.01)


def _slow_yaml(tmp: Path) -> Path:
    """A yaml file of 300 KB that takes seconds to parse (and is refused once
    parsed, for its unknown key: the tests signal before that)."""
    path = tmp / "slow.yaml"
    path.write_text("FILLER: [" + ", ".join(["0.1"] * 60_000) + "]\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, words",
    [
        (signal.SIGINT, 130, ["interrupted during start-up"]),
        (signal.SIGTERM, 143, ["stopped by SIGTERM during start-up"]),
        (signal.SIGUSR1, 138, ["stopped by SIGUSR1 during start-up"]),
    ],
)
def test_signal_while_the_config_loads(signum, code, words, tmp_path):
    """Ctrl-C / SIGTERM during pre-flight: one error line, nothing created."""
    cfg_file, out = _slow_yaml(tmp_path), tmp_path / "out"
    proc = start([sys.executable, TRAIN_NET, "--cfg", str(cfg_file), *TINY,
                  "OUT_DIR", str(out)])  # fmt: skip
    _wait_for(proc, lambda: _opened(proc.pid, cfg_file))
    os.kill(proc.pid, signum)
    assert_one_error_line(_finish(proc), code, words)
    assert not out.exists()


@pytest.mark.slow
def test_sigterm_while_the_run_builds_leaves_no_temporary_file(tmp_path):
    """SIGTERM after config.yaml is written, before the training loop takes the
    signal over (the default digits take a second or more to load)."""
    out = tmp_path / "out"
    args = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(out)]
    proc = start([sys.executable, TRAIN_NET, *args])
    _wait_for(proc, lambda: (out / "config.yaml").is_file())
    os.kill(proc.pid, signal.SIGTERM)
    words = ["stopped by SIGTERM during start-up", "nothing was trained"]
    assert_one_error_line(_finish(proc), 143, words)
    left = [p.name for p in out.rglob("*") if ".tmp" in p.name]
    assert left == []
    assert not (out / cp.CHECKPOINT_DIR).exists() or not os.listdir(
        out / cp.CHECKPOINT_DIR
    )
