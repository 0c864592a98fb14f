"""Output paths are untrusted too: the export and average tools, and every
atomic write, replace only regular files they were asked to write, never a
device, a FIFO, a folder, a link, an input or another output.  A full disk
during a sharded (DCP) save ends in one ``error:`` line and leaves no
half-written folder.

No test here touches a real device: a FIFO, a link or a folder in tmp_path
stands for ``/dev/null``, and a device node of our own is made only in
tmp_path.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from helpers import error_line
from torch.distributed.checkpoint import FileSystemWriter

from distribuuuu import checkpoint as cp
from distribuuuu import cli
from distribuuuu.models import build_model
from distribuuuu.tools import average_checkpoints as average_tool
from distribuuuu.tools import export as export_tool

WEIGHTS = b"weights this test never loads"  # the checks come before any work
LENET = ["MODEL.ARCH", "lenet5", "MODEL.NUM_CLASSES", "10"]  # for a plain state_dict


@pytest.fixture
def lenet(tmp_path) -> Path:
    """A plain lenet5 state_dict that export reads with LENET (the old code
    exported it, over whatever the outputs were)."""
    path = tmp_path / "ckpt_ep_0001.pth"
    torch.save(build_model("lenet5", 10).state_dict(), path)
    return path


def plain_weights(*paths: Path) -> None:
    """Plain state_dicts that average reads, a different tensor in each."""
    for value, path in enumerate(paths):
        torch.save({"w": torch.full((2,), float(value))}, path)


def make_hostile(kind: str, path: Path) -> Path:
    """Put at ``path`` what an output must not replace: ``kind`` of file."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "link":
        target = path.with_name(path.name + ".target")
        target.write_bytes(b"the link's target\n")
        path.symlink_to(target)
    elif kind == "dangling-link":
        path.symlink_to(path.with_name("nowhere"))
    elif kind == "device":  # like /dev/null, but a node of our own in tmp_path
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError as error:
            pytest.skip(f"cannot make a device node here: {error}")
    return path


def listing(folder: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``folder``: its mode and, for a regular file, bytes."""
    found = {}
    for path in sorted(folder.rglob("*")):
        info = os.lstat(path)
        data = path.read_bytes() if stat.S_ISREG(info.st_mode) else None
        found[str(path.relative_to(folder))] = (info.st_mode, data)
    return found


HOSTILE = ["fifo", "folder", "link", "dangling-link", "device"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_atomic_write_replaces_only_regular_files(kind, tmp_path):
    path = make_hostile(kind, tmp_path / "out.pth")
    before = listing(tmp_path)
    with pytest.raises(ValueError, match="refusing to replace it"):  # OutputPathError
        cp.atomic_write(str(path), lambda f: f.write(b"new"))
    assert listing(tmp_path) == before  # no temporary file either
    regular = tmp_path / "regular.pth"
    regular.write_bytes(b"old")
    cp.atomic_write(str(regular), lambda f: f.write(b"new"))
    assert regular.read_bytes() == b"new"


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("option", ["--out", "--torchscript", "--onnx"])
def test_export_refuses_an_output_that_is_no_regular_file(
    option, kind, tmp_path, capsys
):
    """``--out /dev/null`` as root replaced the device with a file: refused
    with exit 2 before the weights are even read, nothing written."""
    weights = tmp_path / "w.pth"
    weights.write_bytes(WEIGHTS)
    hostile = make_hostile(kind, tmp_path / "hostile")
    args = {"--out": str(tmp_path / "sd.pth"), option: str(hostile)}
    before = listing(tmp_path)
    argv = ["--weights", str(weights), *(a for pair in args.items() for a in pair)]
    assert export_tool.main(argv) == 2
    line = error_line(capsys)
    assert str(hostile) in line and "refusing to replace it" in line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("kind", ["fifo", "link", "device"])
def test_average_refuses_an_output_that_is_no_regular_file(kind, tmp_path, capsys):
    inputs = [tmp_path / "a.pth", tmp_path / "b.pth"]
    plain_weights(*inputs)
    hostile = make_hostile(kind, tmp_path / "avg.pth")
    before = listing(tmp_path)
    assert average_tool.main(["--out", str(hostile), *map(str, inputs)]) == 2
    assert str(hostile) in error_line(capsys)
    assert listing(tmp_path) == before


def test_export_refuses_to_replace_its_input(lenet, tmp_path, capsys):
    before = lenet.read_bytes()
    argv = ["--weights", str(lenet), "--out", str(lenet), *LENET]
    assert export_tool.main(argv) == 2
    line = error_line(capsys)
    assert f"--out {lenet} and --weights {lenet} are the same file" in line
    assert lenet.read_bytes() == before
    cfg = tmp_path / "c.yaml"
    cfg.write_text("MODEL:\n  ARCH: lenet5\n")
    argv = ["--weights", str(lenet), "--out", str(tmp_path / "o.pth"), "--cfg"]
    assert export_tool.main([*argv, str(cfg), "--onnx", str(cfg), *LENET]) == 2
    assert f"--onnx {cfg} and --cfg {cfg} are the same file" in error_line(capsys)
    assert cfg.read_text() == "MODEL:\n  ARCH: lenet5\n"
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", lenet.name]


def test_export_refuses_two_outputs_on_one_path(lenet, tmp_path, capsys):
    """``--out F --torchscript F`` silently kept only one of the two."""
    out = tmp_path / "model.pt"
    spelled_otherwise = str(tmp_path / "." / "model.pt")
    argv = ["--weights", str(lenet), "--out", str(out)]
    assert export_tool.main([*argv, "--torchscript", spelled_otherwise, *LENET]) == 2
    line = error_line(capsys)
    assert f"--out {out} and --torchscript {spelled_otherwise} are the same" in line
    assert not out.exists()


@pytest.mark.parametrize("twice", ["same-path", "hard-link", "symlink"])
def test_average_counts_each_checkpoint_once(twice, tmp_path, capsys):
    """The same file given twice got double weight, hidden by a hard link."""
    first, other = tmp_path / "a.pth", tmp_path / "b.pth"
    plain_weights(first, other)
    again = tmp_path / "again.pth"
    if twice == "same-path":
        again = first
    elif twice == "hard-link":
        os.link(first, again)
    else:
        again.symlink_to(first)
    out = tmp_path / "avg.pth"
    argv = ["--out", str(out), str(first), str(other), str(again)]
    assert average_tool.main(argv) == 2
    line = error_line(capsys)
    assert f"checkpoint {first} and checkpoint {again} are the same file" in line
    assert not out.exists()


@pytest.mark.parametrize("alias", ["same-path", "hard-link"])
def test_average_refuses_to_replace_an_input(alias, tmp_path, capsys):
    first, other = tmp_path / "a.pth", tmp_path / "b.pth"
    plain_weights(first, other)
    before = first.read_bytes()
    out = first
    if alias == "hard-link":
        out = tmp_path / "avg.pth"
        os.link(first, out)
    assert average_tool.main(["--out", str(out), str(first), str(other)]) == 2
    line = error_line(capsys)
    assert f"--out {out} and checkpoint {first} are the same file" in line
    assert first.read_bytes() == before


# --------------------------------------------------------------------------- #
# A full disk during a sharded (DCP) save
# --------------------------------------------------------------------------- #


def failing_writes(monkeypatch, code: int) -> None:
    """DCP's file writer writes part of a shard, then fails with ``code``."""

    def write_data(self, plan, planner):
        (Path(self.path) / "__0_0.distcp").write_bytes(b"\0" * 4096)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


@pytest.fixture
def saved_run(tmp_path) -> Path:
    """OUT_DIR holding one complete checkpoint, ``last`` naming it."""
    out = tmp_path / "out"
    cp.save_checkpoint(str(out), 1, {"epoch": 1, "w": torch.ones(3)})
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "no space left on device while writing"),
        (errno.EIO, "Input/output error"),
    ],
)
def test_a_failed_sharded_save_ends_in_one_error_line(
    code, words, saved_run, monkeypatch, capsys
):
    """FSDP's save on a full disk gave raw tracebacks (DCP's exception is a
    BaseException) and left a ``.dcp.tmp`` folder: now one ``error:`` line,
    no folder, and the previous checkpoint still ``last`` and loadable."""
    failing_writes(monkeypatch, code)
    shards = {"model": {"w": torch.zeros(8)}}

    def save() -> None:
        cp.save_sharded(str(saved_run), cp.checkpoint_name(2), shards)

    assert cli.run_tool(save) == cli.EXIT_FAILED
    line = error_line(capsys)
    assert words in line
    if code == errno.ENOSPC:
        assert line.endswith(os.path.join("checkpoints", "ckpt_ep_0002.dcp"))
    folder = saved_run / "checkpoints"
    assert sorted(os.listdir(folder)) == ["ckpt_ep_0001.pth", "last"]
    assert (folder / "last").read_text() == "ckpt_ep_0001.pth\n"
    assert cp.load_file(str(folder / "ckpt_ep_0001.pth"))["epoch"] == 1
