"""DATA.NAME webdataset: shards written by tools/make_shards.py, read by every
rank and loader worker, evaluated exactly, against the same ImageFolder."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import tarfile

import pytest
import torch
from helpers import (
    assert_ok,
    import_tool,
    keep_only_checkpoint,
    last_checkpoint_weights,
    read_metrics,
    read_text,
    refused,
    torchrun,
)
from PIL import Image

from distribuuuu.config import load_cfg
from distribuuuu.data import build_dataset, build_test_loader, build_train_loader
from distribuuuu.data.datasets import load_mnist5k
from distribuuuu.data.labels import labels_only
from distribuuuu.data.shards import (
    ShardDecoder,
    ShardedImages,
    open_shards,
    read_shard,
)
from distribuuuu.engine.specs import data_spec, loader_spec
from distribuuuu.engine.trainer import train_model
from distribuuuu.errors import DataError
from distribuuuu.logger import setup_logging

CPU = torch.device("cpu")
TRAIN_PER_CLASS = 50  # 500 training digits: a short run; all 1000 for validation
# Full-batch training of LeNet-5 (no BatchNorm): one step an epoch over every
# training image, so the order in which a pipeline serves them cannot change
# the step, and both pipelines crop each image alike (seeded by its number).
RECIPE = [
    "MODEL.ARCH", "lenet5", "TRAIN.IM_SIZE", "28", "TEST.IM_SIZE", "28",
    "TRAIN.HFLIP", "0", "TRAIN.BATCH_SIZE", "500", "TEST.BATCH_SIZE", "250",
    "OPTIM.MAX_EPOCH", "4", "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.OPTIMIZER", "adamw",
    "OPTIM.BASE_LR", "0.003", "OPTIM.WEIGHT_DECAY", "0", "TRAIN.PRINT_FREQ", "1",
]  # fmt: skip


def make_shards(*args: str) -> str:
    """stdout of ``tools/make_shards.py ARGS`` run in this process (exit 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert import_tool("make_shards").main(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits as an ImageFolder (PNG and JPEG files; 50 training images
    a class, the 1000 validation images) and as shards of 125 samples."""
    root = tmp_path_factory.mktemp("digits")
    folder, shards = root / "folder", root / "shards"
    for split in ("train", "val"):
        images, labels = load_mnist5k(split == "train")
        seen = [0] * 10
        for i, (image, label) in enumerate(zip(images, labels.tolist())):
            seen[label] += 1
            if split == "train" and seen[label] > TRAIN_PER_CLASS:
                continue
            (folder / split / str(label)).mkdir(parents=True, exist_ok=True)
            name = f"{i:05d}.{'jpg' if i % 2 else 'png'}"
            Image.fromarray(image[0].numpy()).save(folder / split / str(label) / name)
    printed = make_shards(str(folder), str(shards), "--samples", "125")
    train = str(shards / "train-{000000..000003}.tar")
    val = str(shards / "val-{000000..000007}.tar")
    assert train in printed and val in printed
    return {"folder": str(folder), "shards": str(shards), "train": train, "val": val}


def shard_keys(digits) -> list[str]:
    return ["DATA.NAME", "webdataset", "TRAIN.DATASET", digits["train"],
            "TEST.DATASET", digits["val"]]  # fmt: skip


def folder_keys(digits) -> list[str]:
    root = digits["folder"]
    return ["DATA.NAME", "imagefolder", "TRAIN.DATASET", root, "TEST.DATASET", root]


def _digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.numpy().tobytes()).hexdigest()


def test_shards_hold_the_folder_byte_for_byte_and_are_deterministic(digits, tmp_path):
    shards = open_shards(digits["val"], "TEST.DATASET")
    assert shards.total == 1000 and shards.classes == tuple("0123456789")
    assert open_shards(digits["train"], "TRAIN.DATASET").counts == (125,) * 4
    again = tmp_path / "again"
    make_shards(digits["folder"], str(again), "--samples", "125", "--splits", "train")
    for name in [f"train-00000{i}.tar" for i in range(4)] + ["classes.txt"]:
        with open(os.path.join(digits["shards"], name), "rb") as f:
            assert f.read() == (again / name).read_bytes(), name
    # Every shard mixes the classes (the order is shuffled when writing).
    with tarfile.open(os.path.join(digits["shards"], "val-000000.tar")) as tar:
        labels = {tar.extractfile(m).read() for m in tar if m.name.endswith(".cls")}
    assert len(labels) == 10


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 0), (3, 2)])
def test_evaluation_reads_every_sample_once(digits, world, workers):
    """The validation images of all ranks are the folder's 1000, each once,
    pixel for pixel; the ranks' batch counts differ by at most one."""
    keys = [*RECIPE, "TRAIN.WORKERS", str(workers)]
    folder_cfg = load_cfg(None, [*keys, *folder_keys(digits)])
    folder = build_dataset(data_spec(folder_cfg), train=False)
    expected = sorted(_digest(image) + str(label) for image, label in folder)
    cfg = load_cfg(None, [*keys, *shard_keys(digits)])
    val_set, seen, batches = build_dataset(data_spec(cfg), train=False), [], []
    for rank in range(world):
        loader = build_test_loader(loader_spec(cfg), val_set, rank, world, CPU)
        batches.append(len(loader))
        for images, labels in loader:
            seen += [_digest(i) + str(int(t)) for i, t in zip(images, labels)]
        assert sum(1 for _ in loader) == len(loader)
    assert len(seen) == 1000 and sorted(seen) == expected
    assert max(batches) - min(batches) <= 1
    # What evaluate() gives sharded models as the empty forwards that even out
    # the batch counts: an image of the evaluation's shape.
    assert loader.dataset[0][0].shape == (3, 28, 28)


def _number(data: bytes, name: str) -> torch.Tensor:
    return torch.tensor([int(name.rsplit(":", 1)[1].split(".")[0])])


def _same(image):
    # A function of the module, not a lambda: the workers unpickle it.
    return image


def _numbered(digits, rank: int, world: int, workers: int, batch: int, value=_number):
    """The training loader of a rank whose images are the sample numbers (or
    ``value(data, name)``)."""
    cfg = load_cfg(None, [*RECIPE, *shard_keys(digits)])
    shards = open_shards(digits["train"], "TRAIN.DATASET")
    images = ShardedImages(shards, ShardDecoder(shards, _same, value, False))
    return build_train_loader(
        dataclasses.replace(loader_spec(cfg), workers=workers),
        images,
        rank=rank,
        world_size=world,
        seed=7,
        device=CPU,
        batch_size=batch,
    )


def _epoch(loader, epoch: int, start: int = 0) -> list[list[int]]:
    loader.sampler.set_epoch(epoch, start)
    return [images.flatten().tolist() for images, _ in loader]


def test_training_ranks_read_disjoint_shards_and_take_equal_steps(digits):
    """2 ranks x 2 workers = 4 readers of one 125-sample shard each; 5 steps
    of 50 a rank: worker 0 serves 150 (its shard, then 25 again), worker 1
    100 (25 dropped)."""
    epochs = {}
    for rank in range(2):
        loader = _numbered(digits, rank, 2, 2, 50)
        assert len(loader) == 5
        epochs[rank] = [_epoch(loader, 0), _epoch(loader, 1)]
        assert all(len(batch) == 50 for batch in epochs[rank][0])
    first = [set(sum(epochs[rank][0], [])) for rank in range(2)]
    assert not first[0] & first[1]  # no sample on both ranks
    assert len(first[0] | first[1]) == 500 - 50  # 2 x 25 dropped
    assert epochs[0][0] != epochs[0][1]  # shards dealt anew each epoch
    # Each rank's readers read whole shards of their own: 125-sample blocks.
    assert {len(first[0]), len(first[1])} == {225}


def _pid(data: bytes, name: str) -> torch.Tensor:
    return torch.tensor([os.getpid()])


def test_the_loader_keeps_its_workers_from_epoch_to_epoch(digits):
    loader = _numbered(digits, 0, 1, 2, 50, _pid)
    pids = [set(sum(_epoch(loader, epoch), [])) for epoch in range(3)]
    assert len(pids[0]) == 2 and os.getpid() not in pids[0]
    assert pids[0] == pids[1] == pids[2]


def test_mid_epoch_resume_takes_the_remaining_batches(digits):
    loader = _numbered(digits, 1, 2, 2, 50)
    whole = _epoch(loader, 3)
    # 3 steps done (3 x 50 x 2 samples of the epoch): the other 2 follow, in
    # order (the loader's worker 0 now serves the reader of worker 1).
    assert len(loader) == 5 and _epoch(loader, 3, 300) == whole[3:]
    assert len(loader) == 2
    assert _epoch(loader, 3, 200) == whole[2:]


def _labels(loader, epoch: int, start: int = 0) -> list[list[int]]:
    loader.sampler.set_epoch(epoch, start)
    return [labels.tolist() for _, labels in loader]


def _unread(data: bytes, name: str) -> torch.Tensor:
    raise AssertionError(f"{name} was read")


@pytest.mark.parametrize("rank, workers", [(0, 0), (1, 2)])
def test_labels_only_batches_hold_the_labels_of_the_full_loader(digits, rank, workers):
    """A pipeline's later stage: a rank of 2, the labels of each batch the
    loader's workers serve in turn, from an epoch's start and resumed after a
    step (worker 0 then serves the reader of worker 1); no image decoded, nor
    its bytes read (the tar headers are)."""
    full = _numbered(digits, rank, 2, workers, 50)
    expected = [_labels(full, 2), _labels(full, 2, 100)]
    shards = full.dataset.shards
    images = ShardedImages(shards, ShardDecoder(shards, _same, _unread, False))
    spec = dataclasses.replace(loader_spec(load_cfg()), workers=workers)
    where = dict(rank=rank, world_size=2, seed=7, device=CPU, batch_size=50)
    labels = labels_only(build_train_loader(spec, images, **where), images, 28)
    assert [_labels(labels, 2), _labels(labels, 2, 100)] == expected
    assert len(expected[0]) == 5 and len(expected[1]) == 4
    _, _, members = next(read_shard(shards.paths[0], "TRAIN.DATASET", 0, True))
    (image,) = members.keys() - {"cls"}
    assert members[image] == b"" and members["cls"].strip().isdigit()


def test_max_side_caps_the_shorter_side_and_copies_the_rest(tmp_path):
    sizes = {"wide.jpg": (300, 200), "tall.png": (90, 160), "small.png": (40, 50)}
    for name, size in sizes.items():
        (tmp_path / "src" / "train" / "a").mkdir(parents=True, exist_ok=True)
        noise = torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8)
        Image.fromarray(noise.numpy()).save(tmp_path / "src" / "train" / "a" / name)
    out = tmp_path / "out"
    make_shards(str(tmp_path / "src"), str(out), "--splits", "train", "--max-side",
                "64", "--quality", "80")  # fmt: skip
    with tarfile.open(out / "train-000000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar}
    got = [
        (member.split(".", 1)[1], Image.open(io.BytesIO(data)).size)
        for member, data in members.items()
        if not member.endswith(".cls")
    ]
    small = (tmp_path / "src" / "train" / "a" / "small.png").read_bytes()
    assert sorted(got) == [("jpg", (64, 114)), ("jpg", (96, 64)),
                                   ("png", (40, 50))]  # fmt: skip
    assert small in members.values()  # not re-encoded: under the cap


def _break(path: str, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 3000)
    elif how == "not a tar":
        size = os.path.getsize(path)
        with open(path, "wb") as f:
            f.write(b"\x89PNG not a tar " * (size // 15) + b"x" * (size % 15))
    else:
        os.remove(path)


@pytest.mark.parametrize(
    "how, victim, expected",
    [
        ("truncated", "train-000002.tar", "train-000002.tar has"),
        ("not a tar", "val-000001.tar", "not an uncompressed tar file"),
        ("missing", "classes.txt", "no class list"),
        ("missing", "index.json", "no index"),
    ],
)
def test_damaged_shards_are_refused_before_training(
    digits, tmp_path, how, victim, expected
):
    copy = tmp_path / "shards"
    make_shards(digits["folder"], str(copy), "--samples", "125")
    _break(str(copy / victim), how)
    keys = ["DATA.NAME", "webdataset",
            "TRAIN.DATASET", str(copy / "train-{000000..000003}.tar"),
            "TEST.DATASET", str(copy / "val-{000000..000007}.tar")]  # fmt: skip
    line = refused(str(tmp_path / "run"), *RECIPE, *keys)
    assert expected in line


def test_patterns_and_readers_are_checked_before_training(digits, tmp_path):
    keys = shard_keys(digits)
    nothing = [*keys, "TRAIN.DATASET", digits["shards"] + "/x-{0..3}.tar"]
    assert "matches no shard file" in refused(str(tmp_path / "a"), *RECIPE, *nothing)
    piped = [*keys, "TEST.DATASET", "pipe:curl -s http://x/val-{0..3}.tar"]
    assert "only local shard files" in refused(str(tmp_path / "b"), *RECIPE, *piped)
    line = refused(str(tmp_path / "c"), *RECIPE, *keys, "TRAIN.WORKERS", "5")
    assert "4 shards for 1 processes x 5 loader workers" in line
    line = refused(str(tmp_path / "d"), *RECIPE, *keys, "TRAIN.BATCH_SIZE", "501")
    assert "more than the 500 training images" in line
    line = refused(str(tmp_path / "e"), *RECIPE, *keys, "DATA.REPEATED_AUG", "2")
    assert line.startswith("error: DATA.REPEATED_AUG 2 is invalid")


@pytest.mark.parametrize("skip", [False, True])
def test_a_corrupt_image_in_a_shard_follows_skip_corrupt(digits, tmp_path, skip):
    source = tmp_path / "src"
    for split in ("train", "val"):
        (source / split / "0").mkdir(parents=True)
        for i in range(4):
            image = Image.new("RGB", (30, 30), (i * 60, 10, 10))
            image.save(source / split / "0" / f"{i}.png")
    (source / "val" / "0" / "2.png").write_bytes(b"\x89PNG broken")
    make_shards(str(source), str(tmp_path / "out"), "--samples", "2")
    out = tmp_path / "out"
    cfg = load_cfg(None, [*RECIPE, "DATA.NAME", "webdataset", "TRAIN.DATASET",
                          str(out / "train-{000000..000001}.tar"), "TEST.DATASET",
                          str(out / "val-{000000..000001}.tar"),
                          "DATA.SKIP_CORRUPT", str(skip)])  # fmt: skip
    loader = build_test_loader(
        loader_spec(cfg), build_dataset(data_spec(cfg), train=False), 0, 1, CPU
    )
    if not skip:
        with pytest.raises(DataError, match="cannot read image .*val-00000"):
            list(loader)
        return
    (images, labels), *_ = list(loader)
    assert len(labels) == 4  # a readable image stands in: the count stays


@pytest.mark.parametrize("skip", [False, True])
def test_a_jpeg_damaged_past_its_header_follows_skip_corrupt_in_training(
    digits, tmp_path, skip
):
    """DATA.DECODER fused decodes a training JPEG in the crop: an error there
    is a corrupt image, as when the sample is read."""
    source = tmp_path / "src"
    for split in ("train", "val"):
        (source / split / "0").mkdir(parents=True)
        for i in range(4):
            image = Image.new("RGB", (40, 30), (i * 60, 10, 10))
            image.save(source / split / "0" / f"{i}.jpg", quality=90)
    data = (source / "train" / "0" / "2.jpg").read_bytes()
    table = data.index(b"\xff\xc4")  # a Huffman table, after the frame header
    length = int.from_bytes(data[table + 2 : table + 4], "big")
    broken = data[: table + 4] + b"\xff" * (length - 2) + data[table + 2 + length :]
    (source / "train" / "0" / "2.jpg").write_bytes(broken)
    make_shards(str(source), str(tmp_path / "out"), "--samples", "2")
    out = tmp_path / "out"
    cfg = load_cfg(None, [*RECIPE, "DATA.NAME", "webdataset", "TRAIN.DATASET",
                          str(out / "train-{000000..000001}.tar"), "TEST.DATASET",
                          str(out / "val-{000000..000001}.tar"), "TRAIN.IM_SIZE",
                          "24", "DATA.SKIP_CORRUPT", str(skip)])  # fmt: skip
    assert cfg.DATA.DECODER == "fused"
    dataset = build_dataset(data_spec(cfg), train=True)
    loader = build_train_loader(
        loader_spec(cfg),
        dataset,
        rank=0,
        world_size=1,
        seed=0,
        device=CPU,
        batch_size=4,
    )
    loader.sampler.set_epoch(0)
    if not skip:
        with pytest.raises(DataError, match=r"read image .*train-0.*2\.jpg: "):
            list(loader)
        return
    ((images, labels),) = list(loader)
    assert images.shape == (4, 3, 24, 24)  # a readable image stands in


def _train_in_process(out_dir: str, *keys: str) -> dict:
    try:
        train_model(load_cfg(None, [*RECIPE, *keys, "OUT_DIR", out_dir]))
    finally:
        setup_logging(None, 1)  # close the log file, leave no handler behind
    return read_metrics(out_dir, "val")[-1]


@pytest.mark.slow
def test_training_on_shards_matches_the_folder_on_1_and_2_ranks(digits, tmp_path):
    """The same recipe from the folder and from its shards: the same top-1
    within 0.5 points, on 1 and on 2 processes, every validation sample
    counted once."""
    results = {}
    for name, keys in (("folder", folder_keys(digits)), ("shards", shard_keys(digits))):
        results[name, 1] = _train_in_process(str(tmp_path / f"{name}1"), *keys)
        out = str(tmp_path / f"{name}2")
        run = torchrun(2, *RECIPE, *keys, "TRAIN.BATCH_SIZE", "250", "OUT_DIR", out)
        assert_ok(run)
        results[name, 2] = read_metrics(out, "val")[-1]
    for world in (1, 2):
        folder, shards = results["folder", world], results["shards", world]
        assert folder["samples"] == shards["samples"] == 1000
        assert abs(folder["top1"] - shards["top1"]) <= 0.5, (world, folder, shards)
        assert shards["top1"] > 20  # it learns (4 full-batch steps)
    assert "0 samples dropped" in read_text(str(tmp_path), "shards2", "log.txt")


def test_a_run_resumed_mid_epoch_ends_with_the_same_weights(digits, tmp_path):
    """10 steps of 50 from the shards with 2 loader workers, a checkpoint
    every 5; resumed from the one after step 5, the run ends bit for bit
    where the uninterrupted one did."""
    keys = [*shard_keys(digits), "TRAIN.BATCH_SIZE", "50", "OPTIM.MAX_EPOCH", "1",
            "TRAIN.WORKERS", "2", "CHECKPOINT.PERIOD_ITERS", "5"]  # fmt: skip
    reference, resumed = str(tmp_path / "reference"), str(tmp_path / "resumed")
    _train_in_process(reference, *keys)
    shutil.copytree(reference, resumed)
    keep_only_checkpoint(resumed, "ckpt_ep_0000_it_0005.pth")
    _train_in_process(resumed, *keys)
    log = read_text(resumed, "log.txt")
    assert "resumed from" in log and "after 5 batches" in log
    expected = last_checkpoint_weights(reference)
    actual = last_checkpoint_weights(resumed)
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
