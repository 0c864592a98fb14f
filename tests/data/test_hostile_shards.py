"""Hostile shards and shard sources: a class list naming a class twice, a
label of thousands of digits, a deeply nested index; class folders whose names
break ``classes.txt``, files that are no images, links out of the source and
FIFOs given to ``make_shards``.

Pre-flight refusals exit 2 with one ``error:`` line; make_shards leaves no
partial output behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest
from helpers import import_tool, refused
from PIL import Image
from test_hostile import LENET, make_image_folder

from distribuuuu.data.shards import ShardDecoder, open_shards, read_shard
from distribuuuu.errors import DataError


def make_shards(capsys, *args: str) -> tuple[int, list[str]]:
    """The exit code and the ``error:`` lines of ``tools/make_shards.py ARGS``."""
    code = import_tool("make_shards").main(list(args))
    lines = capsys.readouterr().err.splitlines()
    return code, [line for line in lines if line.startswith("error:")]


def refused_by_make_shards(capsys, source: Path, out: Path, *words: str) -> str:
    """The one ``error:`` line of make_shards SOURCE OUT, which must exit 2
    and leave OUT as it was (absent here)."""
    code, errors = make_shards(capsys, str(source), str(out), "--samples", "1")
    assert code == 2 and len(errors) == 1, errors
    assert not out.exists()  # nothing written, or what was written removed
    for word in words:
        assert word in errors[0]
    return errors[0]


@pytest.fixture
def shards(tmp_path, capsys) -> Path:
    """A folder of shards of 2 classes, 2 images a class, one image a shard."""
    source = make_image_folder(tmp_path / "src", 2, per_class=2)
    out = tmp_path / "shards"
    code, errors = make_shards(capsys, str(source), str(out), "--samples", "1")
    assert code == 0, errors
    return out


def train_pattern(shards: Path) -> str:
    return str(shards / "train-{000000..000003}.tar")


def test_a_class_list_naming_a_class_twice_is_refused(shards):
    (shards / "classes.txt").write_text("c00\nc01\nc00\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"classes\.txt lists class 'c00' 2 times"):
        open_shards(train_pattern(shards), "TRAIN.DATASET")


@pytest.mark.parametrize(
    "index",
    [
        '{"shards": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"shards": {"train-000000.tar": {"samples": true, "bytes": 10240}}}',
        '{"shards": {"train-000000.tar": [1, 10240]}}',
        '[{"shards": {}}]',
    ],
    ids=["nested", "bool", "list", "not-a-mapping"],
)
def test_an_index_not_of_the_written_form_is_refused(shards, index):
    (shards / "index.json").write_text(index, encoding="utf-8")
    with pytest.raises(DataError, match=r"unreadable index .*index\.json"):
        open_shards(train_pattern(shards), "TRAIN.DATASET")


def test_a_deeply_nested_index_exits_2_before_training(shards, tmp_path):
    (shards / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    keys = ["DATA.NAME", "webdataset", "TRAIN.DATASET", train_pattern(shards),
            "TEST.DATASET", str(shards / "val-{000000..000003}.tar")]  # fmt: skip
    line = refused(str(tmp_path / "run"), *LENET, *keys)
    assert "index.json: nested too deeply" in line


def plain_decoder(shards: Path) -> ShardDecoder:
    """A decoder of the samples of ``shards``' classes that keeps image bytes."""
    opened = open_shards(train_pattern(shards), "TRAIN.DATASET")
    return ShardDecoder(opened, lambda image: image, lambda data, name: data, False)


def _write_shard(path: Path, label: bytes, key: str = "00000007") -> None:
    """A shard of one sample, ``key``: a PNG and the ``.cls`` ``label``."""
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    with tarfile.open(path, "w") as tar:
        for name, data in ((f"{key}.png", png.getvalue()), (f"{key}.cls", label)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("label", [b"1" * 5000, b"\xd9\xa1", b"-1", b"2", b""])
def test_a_label_that_is_no_class_number_names_its_shard_and_sample(
    shards, tmp_path, label
):
    """(5000 digits are past Python's limit for int(); an Arabic-Indic one.)"""
    decoder = plain_decoder(shards)
    path = tmp_path / "crafted.tar"
    _write_shard(path, label)
    (raw,) = read_shard(str(path), "TRAIN.DATASET")
    with pytest.raises(DataError, match=rf"shard {path}: sample 00000007"):
        decoder(raw)


def test_a_label_with_blanks_around_it_is_read(shards, tmp_path):
    decoder = plain_decoder(shards)
    path = tmp_path / "written-elsewhere.tar"
    _write_shard(path, b" 1\n")
    assert decoder(next(read_shard(str(path), "TRAIN.DATASET")))[1] == 1


@pytest.mark.parametrize("key", ["1" * 5000, "\u00b2", "\udcff", "9" * 30])
def test_any_sample_key_seeds_its_augmentation(shards, tmp_path, key):
    """(A key of digits is its sample's number; 5000 of them are past the
    limit of int(), "²" is a digit int() refuses, and the surrogate stands
    for a byte of a name that is not UTF-8.)"""
    decoder = plain_decoder(shards)
    path = tmp_path / "crafted.tar"
    _write_shard(path, b"1", key)
    raws = read_shard(str(path), "TRAIN.DATASET")
    ((_, label),) = decoder.readable(raws, seed=lambda number: number)
    assert label == 1


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\u2028b", "tab\there"])
def test_a_class_name_classes_txt_cannot_hold_is_refused(tmp_path, capsys, name):
    source = make_image_folder(tmp_path / "src", 2, per_class=1)
    for split in ("train", "val"):
        os.rename(source / split / "c01", source / split / name)
    line = refused_by_make_shards(capsys, source, tmp_path / "out", "class folder")
    assert repr(name) in line


def test_a_file_that_is_no_image_is_refused_and_nothing_is_left(tmp_path, capsys):
    source = make_image_folder(tmp_path / "src", 2, per_class=3)
    (source / "val" / "c01" / "9.jpg").write_bytes(b"root:x:0:0:root:/root:/bin/sh\n")
    # train is written first, one shard a sample: the val shards come after
    refused_by_make_shards(
        capsys, source, tmp_path / "out", "val/c01/9.jpg: not an image"
    )


@pytest.mark.parametrize("linked", ["file", "folder"])
def test_a_link_out_of_the_source_is_refused(tmp_path, capsys, linked):
    source = make_image_folder(tmp_path / "src", 2, per_class=1)
    private = tmp_path / "private"  # images, so that only the link tells
    private.mkdir()
    Image.new("RGB", (4, 4)).save(private / "passwd.jpg")
    if linked == "file":
        os.symlink(private / "passwd.jpg", source / "train" / "c00" / "passwd.jpg")
    else:  # a folder inside a class folder
        os.symlink(private, source / "train" / "c00" / "more")
    line = refused_by_make_shards(capsys, source, tmp_path / "out", "passwd.jpg")
    assert f"leads through a link to {os.path.realpath(private / 'passwd.jpg')}" in line


def test_links_inside_the_source_and_linked_class_folders_are_copied(tmp_path, capsys):
    source = make_image_folder(tmp_path / "src", 2, per_class=1)
    elsewhere = make_image_folder(tmp_path / "elsewhere", 1, per_class=2)
    for split in ("train", "val"):  # a class folder linked into place
        os.symlink(elsewhere / split / "c00", source / split / "c02")
    os.symlink("../c00/0.jpg", source / "train" / "c01" / "linked.jpg")
    code, errors = make_shards(capsys, str(source), str(tmp_path / "out"))
    assert code == 0, errors
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["shards"]["train-000000.tar"]["samples"] == 5


@pytest.mark.parametrize("existing", [False, True])
def test_a_fifo_named_as_an_image_is_never_read(tmp_path, capsys, existing):
    source = make_image_folder(tmp_path / "src", 2, per_class=1)
    fifo = source / "train" / "c00" / "pipe.jpg"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    if existing:
        out.mkdir()  # an empty OUT stays, empty
    # Should a reader block on the FIFO, a writer that comes and goes ends it.
    unblock = threading.Timer(10, lambda: _open_and_close(fifo))
    unblock.start()
    try:
        code, errors = make_shards(capsys, str(source), str(out))
    finally:
        unblock.cancel()
    if code == 0:  # the folder listing left it out (regular files only)
        index = json.loads((out / "index.json").read_text())
        assert index["shards"]["train-000000.tar"]["samples"] == 2
        return
    assert code == 2 and len(errors) == 1 and "pipe.jpg" in errors[0], errors
    assert os.listdir(out) == [] if existing else not out.exists()


def _open_and_close(fifo: Path) -> None:
    with contextlib.suppress(OSError):  # fails when no one reads it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
