"""Hostile input gets clear answers.

Every case ends ``tools/train_net.py`` with exit code 2 (unusable config or
input, found before anything is written) or 1 (a failure during the run), one
stderr line ``error: ...`` naming the file, key or path, no traceback unless
``--debug``, and the checkpoints already in OUT_DIR untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_ok,
    call_main,
    import_train_net,
    read_text,
    train_net,
)
from PIL import Image

from distribuuuu.cli import describe_error

# A tiny LeNet-5 run on 28 px images (seconds on 2 cores).
LENET = ["MODEL.ARCH", "lenet5", "TRAIN.IM_SIZE", "28", "TEST.IM_SIZE", "28"]
# Fresh training on an image folder (no resume of the run in OUT_DIR).
FOLDER_RUN = [*LENET, "TRAIN.AUTO_RESUME", "False", "TRAIN.BATCH_SIZE", "4"] + [
    "OPTIM.MAX_EPOCH",
    "1",
]


@pytest.fixture(scope="module")
def trained_out_dir(tmp_path_factory) -> Path:
    """OUT_DIR of a finished one-epoch run: checkpoints, best.pth, logs."""
    out = tmp_path_factory.mktemp("trained") / "out"
    result = train_net(
        *LENET,
        "MODEL.DUMMY_INPUT",
        "True",
        "DATA.SYNTHETIC_SIZE",
        "[64, 16]",
        "OPTIM.MAX_EPOCH",
        "1",
        "OUT_DIR",
        str(out),
        timeout=120,
    )
    assert_ok(result)
    assert (out / "checkpoints" / "ckpt_ep_0001.pth").is_file()
    return out


@pytest.fixture
def out_dir(trained_out_dir: Path, tmp_path: Path) -> Path:
    """A copy of the trained OUT_DIR (same bytes and modification times)."""
    return Path(shutil.copytree(trained_out_dir, tmp_path / "out"))


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Relative path -> (sha256, mtime in ns) of every file under ``root``."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            files[str(path.relative_to(root))] = (digest, path.stat().st_mtime_ns)
    return files


def checkpoint_files(files: dict) -> dict:
    """The checkpoints and best weights of a :func:`snapshot`."""
    return {
        k: v for k, v in files.items() if k.startswith("checkpoints") or k == "best.pth"
    }


def assert_one_error_line(result, code: int, words: list[str]) -> str:
    """Exit ``code``, one stderr line ``error: ...`` holding ``words``; return it."""
    assert result.returncode == code, result.stderr[-3000:] + result.stdout[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]
    return lines[0]


def run_hostile(out_dir: Path, args: list[str], code: int, words: list[str]) -> str:
    """Run ``train_net ARGS OUT_DIR out_dir``; check the answer and OUT_DIR.

    Refusals (exit 2) run in this process, failures of a run in a new one.
    """
    before = snapshot(out_dir)
    if code == 2:
        result = call_main(*args, "OUT_DIR", str(out_dir))
    else:
        result = train_net(*args, "OUT_DIR", str(out_dir), timeout=120)
    line = assert_one_error_line(result, code, words)
    after = snapshot(out_dir)
    if code == 2:
        assert after == before  # nothing written, nothing touched
    else:
        assert checkpoint_files(after) == checkpoint_files(before)
    return line


# --------------------------------------------------------------------------- #
# Config files and values (cases 1-8, 15)
# --------------------------------------------------------------------------- #


def _yaml_list(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "list.yaml"
    path.write_text("- OPTIM.BASE_LR\n- 0.1\n")
    return ["--cfg", str(path)], [str(path), "expected a mapping"]


def _python_config(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "recipe.py"
    path.write_text(f"open({str(tmp / 'ran')!r}, 'w').close()\n")
    return ["--cfg", str(path)], [str(path), ".yaml"]


def _directory(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "configs"
    path.mkdir()
    return ["--cfg", str(path)], [str(path), "is a directory"]


def _directory_named_yaml(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "recipe.yaml"
    path.mkdir()
    return ["--cfg", str(path)], [str(path), "is a directory"]


def _not_utf8(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "latin1.yaml"
    path.write_bytes("OUT_DIR: /tmp/caf\xe9\n".encode("latin-1"))
    return ["--cfg", str(path)], [str(path), "not a UTF-8 text file"]


def _list_for_number_in_yaml(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "lr.yaml"
    path.write_text("OPTIM:\n  BASE_LR: [1, 2]\n")
    return ["--cfg", str(path)], ["lr.yaml", "OPTIM.BASE_LR", "expected a number"]


def _args(*args: str, words: list[str]):
    return lambda tmp: (list(args), words)


CONFIG_CASES = {
    "yaml-not-a-mapping": _yaml_list,
    "py-config": _python_config,
    "directory": _directory,
    "directory-named-yaml": _directory_named_yaml,
    "not-utf8": _not_utf8,
    "list-for-number-yaml": _list_for_number_in_yaml,
    "list-for-number-cli": _args(
        "OPTIM.BASE_LR", "[1,2]", words=["OPTIM.BASE_LR", "expected a number"]
    ),
    "batch-size-0": _args(
        "TRAIN.BATCH_SIZE", "0", words=["TRAIN.BATCH_SIZE", "must be >= 1"]
    ),
    "negative-lr": _args(
        "OPTIM.BASE_LR", "-0.1", words=["OPTIM.BASE_LR", "-0.1", "must be > 0"]
    ),
    "steps-not-increasing": _args(
        "OPTIM.LR_POLICY",
        "steps",
        "OPTIM.STEPS",
        "[6, 3]",
        words=["OPTIM.STEPS", "[6, 3]", "increasing"],
    ),
    "weights-missing": _args(
        "MODEL.WEIGHTS",
        "/no/such/weights.pth",
        words=["MODEL.WEIGHTS", "/no/such/weights.pth"],
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_exits_2(case, out_dir, tmp_path):
    args, words = CONFIG_CASES[case](tmp_path)
    run_hostile(out_dir, args, 2, words)
    assert not (tmp_path / "ran").exists()  # a .py config never runs


@pytest.mark.slow
def test_debug_adds_the_traceback(out_dir):
    before = snapshot(out_dir)
    result = train_net(
        "--debug", "TRAIN.BATCH_SIZE", "0", "OUT_DIR", str(out_dir), timeout=120
    )
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert errors == ["error: TRAIN.BATCH_SIZE 0 is invalid: must be >= 1"]
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    assert snapshot(out_dir) == before


# --------------------------------------------------------------------------- #
# Image folders (cases 9, 10, 11)
# --------------------------------------------------------------------------- #


def make_image_folder(root: Path, classes: int, per_class: int = 4) -> Path:
    """``root/{train,val}/cNN/i.png|jpg``: tiny images, PNG and JPEG mixed."""
    for split in ("train", "val"):
        for label in range(classes):
            folder = root / split / f"c{label:02d}"
            folder.mkdir(parents=True)
            for index in range(per_class):
                colour = (label * 20 % 256, index * 60 % 256, 128)
                suffix = "png" if index % 2 else "jpg"
                Image.new("RGB", (32, 32), colour).save(folder / f"{index}.{suffix}")
    return root


def folder_args(root: Path) -> list[str]:
    """Overrides that train on the image folder at ``root``."""
    return ["DATA.NAME", "imagefolder", "TRAIN.DATASET", str(root)] + [
        "TEST.DATASET",
        str(root),
    ]


def test_folder_without_classes(out_dir, tmp_path):
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    make_image_folder(tmp_path / "other", 2)
    shutil.copytree(tmp_path / "other" / "val", root / "val")
    words = ["TRAIN.DATASET", str(root / "train"), "no class folders"]
    run_hostile(out_dir, [*LENET, *folder_args(root)], 2, words)


@pytest.mark.parametrize("split", ["train", "val"])
def test_empty_class_folder(out_dir, tmp_path, split):
    root = make_image_folder(tmp_path / "data", 3)
    empty = root / split / "c01"
    for image in empty.iterdir():
        image.unlink()
    (empty / "notes.txt").write_text("not an image\n")
    run_hostile(out_dir, [*LENET, *folder_args(root)], 2, [str(empty), "empty"])


def test_more_classes_than_the_model_has(out_dir, tmp_path):
    root = make_image_folder(tmp_path / "data", 12, per_class=1)
    line = run_hostile(out_dir, [*LENET, *folder_args(root)], 2, [str(root / "train")])
    assert "12 classes" in line and "MODEL.NUM_CLASSES is 10" in line


def test_train_and_val_classes_differ(out_dir, tmp_path):
    root = make_image_folder(tmp_path / "data", 3, per_class=1)
    (root / "val" / "c02").rename(root / "val" / "c09")
    words = ["c02", str(root / "train"), str(root / "val")]
    run_hostile(out_dir, [*LENET, *folder_args(root)], 2, words)


def corrupt_folder(root: Path, per_class: int = 4) -> tuple[Path, Path]:
    """An image folder with a garbage file and a truncated JPEG in train."""
    make_image_folder(root, 3, per_class)
    garbage = root / "train" / "c01" / "2.jpg"
    garbage.write_bytes(b"this is not an image\n" * 4)
    truncated = root / "train" / "c02" / "0.jpg"
    truncated.write_bytes(truncated.read_bytes()[:200])
    return garbage, truncated


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "1"])
def test_corrupt_image_stops_the_run_naming_the_file(out_dir, tmp_path, workers):
    # The trained run resumes for a second epoch, with its batch of 64 images.
    garbage, truncated = corrupt_folder(tmp_path / "data", per_class=22)
    args = [*LENET, "OPTIM.MAX_EPOCH", "2", "TRAIN.WORKERS", workers]
    args += folder_args(tmp_path / "data")
    line = run_hostile(out_dir, args, 1, ["cannot read image"])
    assert str(garbage) in line or str(truncated) in line
    log = read_text(str(out_dir), "log.txt")
    assert "Traceback (most recent call last)" in log  # the user can find it
    assert line[len("error: ") :] in log


@pytest.mark.slow
def test_skip_corrupt_warns_and_finishes(tmp_path):
    garbage, truncated = corrupt_folder(tmp_path / "data")
    out = tmp_path / "out"
    args = [*FOLDER_RUN, "DATA.SKIP_CORRUPT", "True", "TRAIN.WORKERS", "1"]
    result = train_net(
        *args, *folder_args(tmp_path / "data"), "OUT_DIR", str(out), timeout=120
    )
    assert_ok(result)
    log = read_text(str(out), "log.txt")
    for path in (garbage, truncated):
        assert f"WARNING: cannot read image {path}" in log
    assert (out / "checkpoints" / "ckpt_ep_0001.pth").is_file()


# --------------------------------------------------------------------------- #
# MODEL.WEIGHTS (cases 12, 13)
# --------------------------------------------------------------------------- #


def test_weights_of_another_architecture(out_dir):
    weights = str(out_dir / "checkpoints" / "ckpt_ep_0001.pth")  # a LeNet-5
    args = ["MODEL.ARCH", "resnet8", "MODEL.WEIGHTS", weights]
    run_hostile(out_dir, args, 2, ["MODEL.WEIGHTS", weights, "another architecture"])


class _RunsCode:
    """Pickles as a call of os.system: what weights-only loading must refuse."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_weights_with_pickled_code_are_refused(out_dir, tmp_path):
    marker = tmp_path / "code-ran"
    weights = tmp_path / "trojan.pth"
    torch.save({"model": {}, "payload": _RunsCode(marker)}, weights)
    args = ["MODEL.WEIGHTS", str(weights)]
    run_hostile(out_dir, args, 2, ["MODEL.WEIGHTS", str(weights), "pickled code"])
    assert not marker.exists()


# --------------------------------------------------------------------------- #
# OUT_DIR (case 14)
# --------------------------------------------------------------------------- #


def test_out_dir_is_a_regular_file(tmp_path):
    target = tmp_path / "out"
    target.write_text("precious\n")
    result = call_main("OUT_DIR", str(target))
    assert_one_error_line(result, 2, ["OUT_DIR", str(target), "not a directory"])
    assert target.read_text() == "precious\n"


def test_out_dir_under_a_regular_file(tmp_path):
    parent = tmp_path / "file"
    parent.write_text("precious\n")
    result = call_main("OUT_DIR", str(parent / "run" / "out"))
    assert_one_error_line(result, 2, ["OUT_DIR", str(parent), "not a directory"])
    assert parent.read_text() == "precious\n"


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str):
    """Mount a tmpfs of ``size`` at ``path``; skip the test where that fails."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> None:
    """Write into ``directory`` until its file system is full."""
    path = directory / f"filler-{uuid.uuid4().hex}"
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="root only")
def test_full_disk_is_found_before_training(trained_out_dir, tmp_path):
    with tiny_tmpfs(tmp_path / "disk", "2m") as disk:
        out = Path(shutil.copytree(trained_out_dir, disk / "out"))
        fill(disk)
        run_hostile(out, [], 2, ["OUT_DIR", str(out), "No space left on device"])


# --------------------------------------------------------------------------- #
# Other failures during the run: type and message, traceback in the log
# --------------------------------------------------------------------------- #


@pytest.fixture
def cli():
    """tools/train_net.py imported as a module."""
    return import_train_net()


def _failing_train_model(cfg):
    from distribuuuu.logger import setup_logging

    setup_logging(cfg.OUT_DIR, 0)
    raise RuntimeError("the loss became a banana")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_any_runtime_error_is_one_line_and_logged(
    cli, monkeypatch, capsys, tmp_path, rank
):
    from distribuuuu.engine import trainer
    from distribuuuu.logger import setup_logging

    monkeypatch.setattr(trainer, "train_model", _failing_train_model)
    monkeypatch.setenv("RANK", rank)
    out = tmp_path / "out"
    try:
        code = cli.main(["MODEL.ARCH", "lenet5", "OUT_DIR", str(out)])
    finally:
        setup_logging(None, 1)  # close the log file, leave no handler behind
    assert code == 1
    err = capsys.readouterr().err
    if rank == "0":
        assert err == "error: RuntimeError: the loss became a banana\n"
    else:
        assert err == ""  # rank 0 speaks for the job
    log = read_text(str(out), "log.txt")
    assert "ERROR: the run failed: RuntimeError: the loss became a banana" in log
    assert "Traceback (most recent call last)" in log


def test_worker_error_is_reduced_to_its_last_line():
    message = (
        "Caught DataError in DataLoader worker process 0.\n"
        "Original Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "distribuuuu.data.datasets.DataError: cannot read image /d/a.png: bad\n"
    )
    assert describe_error(ValueError(message)) == "cannot read image /d/a.png: bad"
    assert describe_error(KeyError("k")) == "KeyError: 'k'"
    assert describe_error(RuntimeError("a\nb")) == "RuntimeError: a [...]"
