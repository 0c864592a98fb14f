"""One listing of an image folder for every rank (data/folder_index.py).

The index lists what the walk lists (links, loops, FIFOs, names that are not
UTF-8); a folder that changed anywhere below the split, or was replaced,
makes it stale; a crafted or damaged index file is refused and listed again,
never followed; and on 4 ranks only rank 0 lists the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import import_train_net, run_on_ranks, run_parts

from distribuuuu.config import load_cfg
from distribuuuu.data import build_dataset, check_data
from distribuuuu.data import datasets as ds
from distribuuuu.data import folder_index as fi
from distribuuuu.dist import refusal
from distribuuuu.engine import run_lock
from distribuuuu.engine.specs import data_spec
from distribuuuu.errors import DataError, DeferredRefusalError
from distribuuuu.tools.train_net import main as train_net_main

KEY = "TRAIN.DATASET/TRAIN.SPLIT"
HOUR_NS = 3600 * 10**9


def make_tree(root: Path) -> Path:
    """A split with nested folders, a linked class, a link loop, a FIFO, a
    text file and names that are not UTF-8 or hold a line break; its
    folders' times an hour old.  Returns the split folder."""
    split = root / "train"
    for path in ("a/1.jpg", "a/2.png", "a/notes.txt", "a/sub/3.jpeg",
                 "a/sub/deeper/4.jpg", "b/5.jpg", "e/new\nline.jpg",
                 "outside/6.jpg"):  # fmt: skip
        file = (root if path.startswith("outside") else split) / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(b"")
    os.mkfifo(split / "b" / "fifo.jpg")
    (split / "b" / "loop").symlink_to(split)
    (split / "c").symlink_to(root / "outside")
    odd = os.path.join(os.fsencode(split), b"d\xff")
    os.makedirs(odd)
    open(os.path.join(odd, b"\xfe.jpg"), "wb").close()
    age(root)
    return split


def age(root: Path) -> None:
    """Every folder under ``root`` last changed an hour ago."""
    past = time.time_ns() - HOUR_NS
    for folder, _, _ in os.walk(root):
        os.utime(folder, ns=(past, past))


def walked(split: Path) -> tuple[list[str], list[list[str]]]:
    """The classes and files as the data set listed them before the index."""
    classes = ds.find_image_classes(str(split), KEY)
    files = [ds.find_image_files(str(split / name), str(split)) for name in classes]
    return classes, files


class Scandirs:
    """Counts the calls of ``os.scandir`` while installed."""

    def __init__(self, monkeypatch=None):
        self.calls, self.scandir = 0, os.scandir
        if monkeypatch is not None:
            monkeypatch.setattr(os, "scandir", self)

    def __call__(self, path):
        self.calls += 1
        return self.scandir(path)


def test_the_index_lists_what_the_walk_lists_and_is_read_back(tmp_path, monkeypatch):
    """The index's samples equal the walk's, through the data set, a fresh
    listing and the index file read back, which lists no folder at all."""
    split = make_tree(tmp_path)
    expected = walked(split)
    names = [os.path.basename(path) for path in expected[1][1]]
    assert len(expected[0]) == 5 and names == ["5.jpg"]  # no FIFO, no loop
    dataset = ds.CheckedImageFolder(str(split), None, KEY)
    assert dataset.classes == expected[0]
    flat = [path for files in expected[1] for path in files]
    assert [path for path, _ in dataset.samples] == flat
    cache = tmp_path / "cache"
    assert fi.shared_listing(str(split), KEY) == expected
    assert fi.shared_listing(str(split), KEY, str(cache)) == expected
    (file,) = cache.iterdir()
    assert file.name == os.path.basename(fi.index_file(str(cache), str(split)))
    scandirs = Scandirs(monkeypatch)
    assert fi.shared_listing(str(split), KEY, str(cache)) == expected
    assert scandirs.calls == 0
    listed = ds.CheckedImageFolder(str(split), None, KEY, listing=expected)
    assert [path for path, _ in listed.samples] == flat
    assert listed.classes == dataset.classes


@pytest.mark.parametrize("change", ["add deep", "remove", "replace", "new class"])
def test_a_changed_folder_anywhere_makes_the_index_stale(tmp_path, change, caplog):
    """A file added three folders down, one removed, a folder replaced by a
    copy with the same times (rsync -a), a new class: the split is listed
    again and the new listing is what the walk gives."""
    split = make_tree(tmp_path)
    cache = str(tmp_path / "cache")
    fi.shared_listing(str(split), KEY, cache)
    if change == "add deep":
        (split / "a" / "sub" / "deeper" / "7.jpg").write_bytes(b"")
    elif change == "remove":
        (split / "a" / "sub" / "3.jpeg").unlink()
    elif change == "replace":
        sub, times = split / "a" / "sub", os.stat(split / "a" / "sub")
        os.rename(sub, tmp_path / "old")
        os.mkdir(sub)
        os.rename(tmp_path / "old" / "deeper", sub / "deeper")
        (sub / "8.jpg").write_bytes(b"")
        age(split / "a")
        os.utime(sub, ns=(times.st_atime_ns, times.st_mtime_ns))
    else:
        (split / "f").mkdir()
        (split / "f" / "9.jpg").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger=fi.__name__):
        listing = fi.shared_listing(str(split), KEY, cache)
    assert listing == walked(split)
    assert "is stale" in caplog.text


def _crafted(document: dict, how: str, split: Path) -> bytes | None:
    """The bytes of a valid index ``document`` after a crafted change."""
    images = document["classes"][0][1]
    if how == "dot-dot":
        images.append("../../secret.jpg")
    elif how == "absolute":
        images.append(str(split / "a" / "1.jpg"))
    elif how == "nul":
        images.append("1.jpg\0.txt")
    elif how == "unrecorded-folder":
        images.append("elsewhere/1.jpg")
    elif how == "not-an-image":
        images.append("notes.txt")
    elif how == "other-split":
        document["root"] = "/somewhere/else"
    elif how == "class-outside":
        document["classes"].insert(0, ["..", ["1.jpg"]])
    elif how == "deep":
        return b"[" * 200_000
    elif how == "not-json":
        return b'{"format": "distribuuuu-folder-index", '
    else:
        return None
    return json.dumps(document).encode()


# Crafted paths, and crafted or damaged files.
CRAFTED_PATHS = ("dot-dot", "absolute", "nul", "unrecorded-folder", "not-an-image")
CRAFTED_FILES = ("other-split", "class-outside", "deep", "not-json", "huge", "fifo")


@pytest.mark.parametrize("how", (*CRAFTED_PATHS, *CRAFTED_FILES, "link"))
def test_a_crafted_index_is_refused_and_listed_again(tmp_path, how, caplog):
    """Paths out of the split, a huge file, a FIFO, a link, damaged JSON:
    refused with a warning (a stale one: listed again); the listing is the
    walk's and the file a valid index again."""
    split = make_tree(tmp_path)
    cache = tmp_path / "cache"
    fi.shared_listing(str(split), KEY, str(cache))
    file = Path(fi.index_file(str(cache), str(split)))
    crafted = _crafted(json.loads(file.read_bytes()), how, split)
    if crafted is not None:
        file.write_bytes(crafted)
    elif how == "huge":  # sparse: refused by its size before it is read
        os.truncate(file, fi.MAX_INDEX_BYTES + 1)
    elif how == "fifo":
        file.unlink()
        os.mkfifo(file)
    else:
        (tmp_path / "elsewhere.json").write_bytes(file.read_bytes())
        file.unlink()
        file.symlink_to(tmp_path / "elsewhere.json")
    with caplog.at_level(logging.INFO, logger=fi.__name__):
        listing = fi.shared_listing(str(split), KEY, str(cache))
    assert listing == walked(split)
    assert "secret" not in str(listing) and "elsewhere" not in str(listing)
    assert ("is stale" if how == "other-split" else "refused") in caplog.text
    if how in ("fifo", "link"):  # never written through, nor over a FIFO
        assert "not written" in caplog.text
    else:
        assert fi.read_index(str(file), str(split)) is not None


def test_an_index_of_folders_changed_just_now_is_not_trusted(tmp_path, caplog):
    """A folder changed within the clock's tick of the walk may change
    again unseen: such an index is not written, and not trusted if found."""
    split = make_tree(tmp_path)
    (split / "b" / "10.jpg").write_bytes(b"")  # b changed now
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=fi.__name__):
        fi.shared_listing(str(split), KEY, str(cache))
    assert "not written" in caplog.text and not cache.exists()
    index = fi.scan_split(str(split), KEY)
    assert "just before" in str(fi.stale_reason(index, str(split)))


def test_an_index_missing_a_folder_that_could_not_be_listed_is_not_written(
    tmp_path, monkeypatch, caplog
):
    """A folder that cannot be listed is skipped, as the walk skips it, but
    no index keeps the listing: a change of its permissions would not
    change its time, and its files would stay missing."""
    split = make_tree(tmp_path)
    locked, scandir = str(split / "a" / "sub"), os.scandir

    def refuse(path):
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", path)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=fi.__name__):
        listing = fi.shared_listing(str(split), KEY, str(cache))
    assert listing == walked(split) and "3.jpeg" not in str(listing)
    assert "could not be listed" in caplog.text and not cache.exists()


def test_a_run_writes_the_index_and_the_preflight_reads_it(tmp_path, monkeypatch):
    """DATA.INDEX_CACHE "" is OUT_DIR/data_index; a data set built outside
    a run (a tool, a test; a dry run) writes no index there.  The pre-flight
    check of the classes lists nothing while the index is current."""
    split = make_tree(tmp_path / "data")
    root, out = str(split.parent), tmp_path / "out"
    args = ["DATA.NAME", "imagefolder", "TRAIN.DATASET", root, "TEST.DATASET"]
    args += [root, "TEST.SPLIT", "train", "OUT_DIR", str(out)]
    spec = data_spec(load_cfg(None, [*args, "MODEL.NUM_CLASSES", "5"]))
    assert spec.index_cache == str(out / "data_index")
    build_dataset(spec, train=True)
    assert not out.exists()
    build_dataset(dataclasses.replace(spec, write_index=True), train=True)
    assert len(os.listdir(out / "data_index")) == 1
    scandirs = Scandirs(monkeypatch)
    check_data(spec)
    assert scandirs.calls == 0
    (split / "a" / "sub" / "12.jpg").write_bytes(b"")
    check_data(spec)
    assert scandirs.calls > 0


@pytest.mark.parametrize("value", ["bad\0path", "file", "inside"])
def test_a_bad_index_cache_exits_2(tmp_path, value, capsys):
    """DATA.INDEX_CACHE: a NUL, an existing file, a folder inside a split."""
    split = make_tree(tmp_path / "data")
    (tmp_path / "file").write_bytes(b"")
    path = {"file": str(tmp_path / "file"), "inside": str(split / "idx")}
    args = ["DATA.NAME", "imagefolder", "TRAIN.DATASET", str(split.parent)]
    args += ["TEST.DATASET", str(split.parent), "TEST.SPLIT", "train"]
    args += ["DATA.INDEX_CACHE", path.get(value, value)]
    assert train_net_main(["--print-config", *args]) == 2
    assert "DATA.INDEX_CACHE" in capsys.readouterr().err


def _listing_hash(listing) -> str:
    text = json.dumps(listing).encode("utf-8", "surrogateescape")
    return hashlib.sha256(text).hexdigest()


def _start_args(root: str, split: str, cache: str, out: str) -> list[str]:
    """train_net.py's arguments of a training run on ``split`` of ``root``."""
    args = ["MODEL.ARCH", "lenet5", "DATA.NAME", "imagefolder", "TRAIN.DATASET"]
    args += [root, "TRAIN.SPLIT", split, "TEST.DATASET", root, "TEST.SPLIT", split]
    args += ["MODEL.NUM_CLASSES", "5", "TRAIN.BATCH_SIZE", "2", "TRAIN.WORKERS"]
    return [*args, "0", "DATA.INDEX_CACHE", cache, "OUT_DIR", out]


def _on_four_ranks(rank: int, world: int, split: str, empty: str, cache: str):
    """Each rank's scandir calls and listing: on a first start (pre-flight
    as torchrun's rank, then the listing; no index yet), with its index,
    after rank 0 changed a folder three levels down, on a split with an
    empty class (every rank raises rank 0's error), and the exit code and
    stderr of train_net.py on that split, refused by rank 0's pre-flight."""
    scandirs = Scandirs()
    os.scandir = scandirs  # type: ignore[assignment]  # this process only
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun starts its ranks
    refusal.RANK_ZERO_FIRST_S = 0  # no launcher here to stop rank 0 early
    tool, root = import_train_net(), os.path.dirname(split)

    def listed() -> dict:
        before = scandirs.calls
        listing = fi.shared_listing(split, KEY, cache)
        return {"scandirs": scandirs.calls - before, "hash": _listing_hash(listing)}

    def first_start() -> dict:
        args = _start_args(root, "train", cache, os.path.join(root, "run"))
        tool.load_and_check(tool.parse_args(args))
        refusal.agree_inputs_usable()
        run_lock.release_out_dir_locks()
        return {"preflight": scandirs.calls, **listed()}

    def changed() -> dict:
        if rank == 0:
            Path(split, "a", "sub", "deeper", "11.jpg").write_bytes(b"")
        dist.barrier()
        return listed()

    def refused() -> str:
        try:
            fi.shared_listing(empty, KEY, cache)
        except DataError as error:
            return str(error)
        return "no error"

    def refused_start() -> dict:
        before, err = scandirs.calls, io.StringIO()
        args = _start_args(root, "empty", cache, os.path.join(root, "refused"))
        with contextlib.redirect_stderr(err):
            code = tool.main(args)
        return {
            "code": code,
            "stderr": err.getvalue(),
            "scandirs": scandirs.calls - before,
        }

    parts = {"first": first_start, "cached": listed, "changed": changed}
    parts.update({"empty": refused, "refused start": refused_start})
    return run_parts(parts)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    """One launch of 4 gloo ranks running :func:`_on_four_ranks`."""
    root = tmp_path_factory.mktemp("index")
    split = make_tree(root)
    empty = root / "empty"
    (empty / "only").mkdir(parents=True)
    args = (str(split), str(empty), str(root / "cache"))
    return run_on_ranks(4, _on_four_ranks, args, str(root / "out")), split


def _part(ranks: list[dict], name: str) -> list:
    for result in ranks:
        assert not isinstance(result[name], str) or name == "empty", result[name]
    return [result[name] for result in ranks]


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_lists_the_folder_for_four(four_ranks):
    """Rank 0 lists the split once; ranks 1-3 call scandir never, with or
    without an index, in pre-flight neither, and all get the walk's listing."""
    ranks, split = four_ranks
    first, cached = _part(ranks, "first"), _part(ranks, "cached")
    assert first[0]["preflight"] > 0 and [r["preflight"] for r in first[1:]] == [0] * 3
    assert first[0]["scandirs"] > 0 and cached[0]["scandirs"] == 0
    assert [r["scandirs"] for r in first[1:] + cached[1:]] == [0] * 6
    before = {r["hash"] for r in first + cached}
    assert len(before) == 1
    changed = _part(ranks, "changed")
    assert changed[0]["scandirs"] > 0
    assert [r["scandirs"] for r in changed[1:]] == [0] * 3
    assert {r["hash"] for r in changed} == {_listing_hash(walked(split))}
    assert {r["hash"] for r in changed} != before


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_zeros_data_error_stops_every_rank(four_ranks):
    """An empty class folder: every rank raises rank 0's error at once."""
    errors = _part(four_ranks[0], "empty")
    assert len(set(errors)) == 1 and "empty class folder" in errors[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_zeros_preflight_refusal_exits_2_on_every_rank(four_ranks):
    """An empty class folder found by rank 0's pre-flight alone: every rank
    exits 2 once they joined the group, rank 0 says why in one line, the
    others say nothing and list nothing, and no OUT_DIR is left behind."""
    ranks, split = four_ranks
    starts = _part(ranks, "refused start")
    assert [start["code"] for start in starts] == [2] * 4, starts
    lines = starts[0]["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "empty class folder" in lines[0]
    assert [start["stderr"] for start in starts[1:]] == [""] * 3
    assert [start["scandirs"] for start in starts[1:]] == [0] * 3
    assert not (split.parent / "refused").exists()
    assert (split.parent / "run").is_dir()  # the first start's, accepted


def test_rank_zero_keeps_its_data_refusal_for_the_group(tmp_path, monkeypatch):
    """Rank 0 of a launched job keeps an empty class folder's refusal past
    pre-flight and raises it at the agreement, after removing the OUT_DIR
    its checks made; a later refusal of its own (TRAIN.AUTO_RESUME False
    over an earlier run) gives way to it, as in one process."""
    split = make_tree(tmp_path / "data")
    (split.parent / "empty" / "only").mkdir(parents=True)
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    env.update(LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tool, root = import_train_net(), str(split.parent)
    fresh, earlier = tmp_path / "fresh" / "out", tmp_path / "earlier"
    (earlier / "best.pth").parent.mkdir()
    (earlier / "best.pth").write_bytes(b"an earlier run's")
    try:
        args = _start_args(root, "empty", "none", str(earlier))
        with pytest.raises(DeferredRefusalError, match="empty class folder"):
            tool.load_and_check(tool.parse_args([*args, "TRAIN.AUTO_RESUME", "False"]))
        assert sorted(os.listdir(earlier)) == ["best.pth"]
        refusal.forget_refusal()  # that process has exited 2
        tool.load_and_check(tool.parse_args(_start_args(root, "empty", "", str(fresh))))
        assert (fresh / ".lock").is_file()
        with pytest.raises(DeferredRefusalError, match="empty class folder"):
            refusal.agree_inputs_usable()
        assert not (tmp_path / "fresh").exists()
    finally:
        run_lock.release_out_dir_locks()
