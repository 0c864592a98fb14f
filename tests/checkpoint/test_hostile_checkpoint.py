"""Crafted checkpoints never run code, reach other files or block a resume.

A sharded (DCP) checkpoint is a ``.pth`` naming a ``.dcp`` folder whose
``.metadata`` DCP itself would unpickle, and whose non-tensor items its
default planner would load with ``weights_only=False``.  Each crafted file
goes through the five entry points that read checkpoints: MODEL.WEIGHTS,
auto-resume, inspect_ckpt.py, predict.py and export.py.  None may create the
marker file, and each ends with exit 2 and one ``error:`` line.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import TINY, call_main, run_python, train_net
from PIL import Image
from test_hostile import assert_one_error_line, snapshot

from distribuuuu import checkpoint as cp
from distribuuuu.tools import export as export_tool
from distribuuuu.tools import inspect_ckpt, predict


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def dotted_global(marker: Path) -> bytes:
    """Protocol 4: an allowed-looking module with a dotted name reaching os.system."""
    return (
        b"\x80\x04"
        + _str("torch.distributed.checkpoint.filesystem")
        + _str("os.system")
        + b"\x93"  # STACK_GLOBAL
        + _str(f"touch {marker}")
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )


def protocol0_global(marker: Path) -> bytes:
    """Protocol 0: GLOBAL os system, called."""
    return f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()


def reduce_into_other(marker: Path) -> bytes:
    """An allowed class (pathlib.PosixPath) built in place of the metadata."""
    return pickle.dumps(Path(marker), protocol=4)


def metadata_escaping(directory: Path) -> bytes:
    """Genuine DCP metadata whose storage entries name a file out of the folder."""
    metadata = _load_pickle(directory / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../../../../etc/passwd"
    return pickle.dumps(metadata)


def _load_pickle(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f)  # our own file, written just before


class _RunsCode:
    """Pickles as a call of os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_dcp(directory: Path, extra: dict | None = None) -> None:
    """A small genuine DCP checkpoint (no process group needed)."""
    state = {"model": {"w": torch.ones(3)}, "optimizer": {"lr": 0.1}, **(extra or {})}
    dcp.save(state, checkpoint_id=str(directory))


def write_pth(path: Path, sharded: str) -> None:
    torch.save({"epoch": 1, "consumed": 0, "sharded": sharded}, path)


def crafted(kind: str, folder: Path, marker: Path) -> Path:
    """The ``.pth`` of crafted checkpoint ``kind`` (in ``folder``)."""
    pth = folder / "ckpt_ep_0001.pth"
    shards = folder / "ckpt_ep_0001.dcp"
    if kind in ("absolute-path", "dotdot-path"):
        elsewhere = folder.parent / "elsewhere" / "real.dcp"
        elsewhere.parent.mkdir(parents=True, exist_ok=True)
        write_dcp(elsewhere)
        name = str(elsewhere) if kind == "absolute-path" else "../elsewhere/real.dcp"
        write_pth(pth, name)
        return pth
    if kind == "link-out":
        elsewhere = folder.parent / "elsewhere" / "real.dcp"
        elsewhere.parent.mkdir(parents=True, exist_ok=True)
        write_dcp(elsewhere)
        shards.symlink_to(elsewhere)
        write_pth(pth, shards.name)
        return pth
    if kind == "code-in-shard-item":
        write_dcp(shards, {"payload": _RunsCode(marker)})
    else:
        write_dcp(shards)
        metadata = {
            "dotted-global": lambda: dotted_global(marker),
            "protocol0-global": lambda: protocol0_global(marker),
            "reduce-into-other": lambda: reduce_into_other(marker),
            "metadata-escapes": lambda: metadata_escaping(shards),
        }[kind]()
        (shards / ".metadata").write_bytes(metadata)
    write_pth(pth, shards.name)
    return pth


KINDS = [
    "dotted-global",
    "protocol0-global",
    "reduce-into-other",
    "metadata-escapes",
    "code-in-shard-item",
    "absolute-path",
    "dotdot-path",
    "link-out",
]


def test_the_dotted_global_runs_code_under_plain_pickle(tmp_path):
    """The crafted metadata is a real exploit: plain pickle runs it."""
    marker = tmp_path / "ran"
    pickle.loads(dotted_global(marker))
    assert marker.exists()


def _image(tmp_path: Path) -> str:
    path = tmp_path / "digit.png"
    Image.new("L", (28, 28), 128).save(path)
    return str(path)


def _tool(main, args: list[str], capsys) -> _Result:
    code = main(args)
    captured = capsys.readouterr()
    return _Result(code, captured.out, captured.err)


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


ENTRY_POINTS = ["weights", "auto-resume", "inspect", "predict", "export"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_crafted_checkpoint_is_refused(kind, entry, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    out = tmp_path / "out"
    folder = out / "checkpoints" if entry == "auto-resume" else tmp_path / "files"
    folder.mkdir(parents=True)
    pth = crafted(kind, folder, marker)
    before = snapshot(out) if out.exists() else None
    if entry in ("weights", "auto-resume"):
        weights = ["MODEL.WEIGHTS", str(pth)] if entry == "weights" else []
        result = call_main(*TINY, *weights, "OUT_DIR", str(out))
    elif entry == "inspect":
        result = _tool(inspect_ckpt.main, [str(pth)], capsys)
    elif entry == "predict":
        args = ["--weights", str(pth), _image(tmp_path)]
        result = _tool(predict.main, args, capsys)
    else:
        args = ["--weights", str(pth), "--out", str(tmp_path / "x.pt")]
        result = _tool(export_tool.main, args, capsys)
    line = assert_one_error_line(result, 2, [str(pth)])
    assert "refused" in line
    assert not marker.exists()
    if before is not None:
        assert snapshot(out) == before
    else:
        assert not out.exists()


def test_damaged_shard_falls_back_to_an_older_checkpoint(tmp_path, caplog):
    """A truncated shard file is damaged, not hostile: resume takes the
    previous complete checkpoint, with a warning naming the file."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"epoch": 1, "consumed": 0, "model": {"w": torch.ones(2)}},
               folder / "ckpt_ep_0001.pth")  # fmt: skip
    write_dcp(folder / "ckpt_ep_0002.dcp")
    write_pth(folder / "ckpt_ep_0002.pth", "ckpt_ep_0002.dcp")
    (folder / "last").write_text("ckpt_ep_0002.pth\n")
    path, _ = cp.find_resume_checkpoint(str(tmp_path))
    assert path.endswith("ckpt_ep_0002.pth")
    shard = next((folder / "ckpt_ep_0002.dcp").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(100)
    path, state = cp.find_resume_checkpoint(str(tmp_path))
    assert path.endswith("ckpt_ep_0001.pth") and state["epoch"] == 1
    assert "skipping unreadable checkpoint" in caplog.text
    assert "ckpt_ep_0002.pth" in caplog.text


def test_shard_checksums_catch_damage_of_the_same_size(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"epoch": 1, "consumed": 0, "model": {"w": torch.ones(2)}},
               folder / "ckpt_ep_0001.pth")  # fmt: skip
    shards = folder / "ckpt_ep_0002.dcp"
    write_dcp(shards)
    entries = cp.shard_manifest(str(shards))
    torch.save({"epoch": 2, "consumed": 0, "sharded": shards.name,
                "sharded_files": entries}, folder / "ckpt_ep_0002.pth")  # fmt: skip
    shard = next(shards.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0xFF  # inside the last tensor's bytes: same size, other values
    shard.write_bytes(bytes(data))
    found, _ = cp.find_resume_checkpoint(str(tmp_path))  # sizes only: not seen
    assert found.endswith("ckpt_ep_0002.pth")
    found, _ = cp.find_resume_checkpoint(str(tmp_path), checksums=True)
    assert found.endswith("ckpt_ep_0001.pth")


@pytest.mark.parametrize(
    "content",
    [b"/etc/passwd\n", b"../../other/checkpoints/ckpt_ep_0009.pth\n", b"\xff\xfe\n"],
    ids=["absolute", "dotdot", "not-utf8"],
)
def test_last_pointer_is_confined_to_the_folder(tmp_path, caplog, content):
    """``last`` naming anything but a checkpoint file beside it is ignored
    with a warning; the intact checkpoints are used."""
    other = tmp_path / "other" / "checkpoints"
    other.mkdir(parents=True)
    torch.save({"epoch": 9, "consumed": 0, "model": {}}, other / "ckpt_ep_0009.pth")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"epoch": 1, "consumed": 0, "model": {}}, folder / "ckpt_ep_0001.pth")
    (folder / "last").write_bytes(content)
    path, state = cp.find_resume_checkpoint(str(tmp_path / "run"))
    assert path == str(folder / "ckpt_ep_0001.pth") and state["epoch"] == 1
    assert "ignoring" in caplog.text and str(folder / "last") in caplog.text


@pytest.mark.slow
def test_stale_temporary_files_are_removed_at_start(tmp_path):
    """Half-written files of a SIGKILLed save are removed when a run starts."""
    out = tmp_path / "out"
    folder = out / "checkpoints"
    folder.mkdir(parents=True)
    stale = [
        folder / ".ckpt_ep_0002.pth.tmp4242",
        folder / ".last.tmp4242",
        out / ".best.pth.tmp4242",
    ]
    for path in stale:
        path.write_bytes(b"\0" * 1000)
    (folder / "ckpt_ep_0003.dcp.tmp").mkdir()
    keep = out / "notes.tmp1"  # not ours
    keep.write_text("mine\n")
    result = train_net(*TINY, "OUT_DIR", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    for path in stale:
        assert not path.exists()
    assert not (folder / "ckpt_ep_0003.dcp.tmp").exists()
    assert keep.exists()
    assert (folder / "ckpt_ep_0001.pth").is_file()
    log = (out / "log.txt").read_text()
    assert ".ckpt_ep_0002.pth.tmp4242, left by a save that was killed" in log


def test_remove_stale_files_leaves_others(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for name in ("ckpt_ep_0001.pth", "last", ".hidden", "x.tmp1", "best.pth"):
        (tmp_path / "checkpoints" / name).write_text("x")
    assert cp.remove_stale_files(str(tmp_path)) == []
    assert len(os.listdir(tmp_path / "checkpoints")) == 5
    shutil.rmtree(tmp_path / "checkpoints")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_during_the_run_keeps_the_previous_checkpoint(tmp_path):
    """The disk fills up after the first checkpoint: one plain error line, no
    partial file, and the first checkpoint intact and still ``last``."""
    from test_hostile import tiny_tmpfs

    with tiny_tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / "out"
        args = [*TINY, "OPTIM.MAX_EPOCH", "3", "OUT_DIR", str(out)]
        result = train_net(*args, timeout=120)
        line = assert_one_error_line(result, 1, ["no space left on device"])
        assert str(out) in line
        folder = out / "checkpoints"
        assert not [p for p in out.rglob("*") if ".tmp" in p.name]
        assert (folder / "last").read_text().strip() == "ckpt_ep_0001.pth"
        assert cp.load_file(str(folder / "ckpt_ep_0001.pth"))["epoch"] == 1


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_resume_skips_a_truncated_shard(tmp_path):
    """``truncate -s 1000`` of a shard of the newest FSDP checkpoint: the rerun
    warns, resumes from the previous complete one and finishes."""
    from helpers import assert_ok, read_metrics, torchrun

    out = str(tmp_path / "out")
    fsdp = [*TINY, "DIST.STRATEGY", "fsdp", "OUT_DIR", out]
    assert_ok(torchrun(2, *fsdp, "OPTIM.MAX_EPOCH", "2"))
    shard = tmp_path / "out" / "checkpoints" / "ckpt_ep_0002.dcp" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(1000)
    again = torchrun(2, *fsdp, "OPTIM.MAX_EPOCH", "3")
    assert_ok(again)
    assert "skipping unreadable checkpoint" in again.stdout
    assert "ckpt_ep_0002.pth" in again.stdout
    assert "resumed from" in again.stdout and "ckpt_ep_0001.pth" in again.stdout
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "Traceback (most recent call last)" in log  # why it was skipped
    assert "Traceback" not in again.stdout + again.stderr
    assert [r["epoch"] for r in read_metrics(out, "val")] == [1, 2, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dotted-global", "code-in-shard-item", "link-out"])
def test_real_commands_answer_a_crafted_checkpoint_in_one_line(kind, tmp_path):
    """As a user runs them: DCP logs a traceback of its own when it cannot read
    metadata; none may reach the console (the in-process cases above do not see
    the logging handlers torch made at import)."""
    from helpers import REPO

    marker = tmp_path / "code-ran"
    pth = crafted(kind, tmp_path, marker)
    out = tmp_path / "out"
    result = train_net(*TINY, "MODEL.WEIGHTS", str(pth), "OUT_DIR", str(out))
    assert "refused" in assert_one_error_line(result, 2, [str(pth)])
    tool = os.path.join(REPO, "tools", "inspect_ckpt.py")
    result = run_python([tool, str(pth)], timeout=120)
    assert "refused" in assert_one_error_line(result, 2, [str(pth)])
    assert not marker.exists() and not out.exists()
