"""Hostile data: link loops, decompression bombs and 16-bit images.

A link loop in an image folder is walked once (no hang, each image counted
once), an image with more pixels than the limit is refused from its header by
both decoders, naming the file, and 16-bit PNGs are scaled to 8 bits.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_ok, run_command, train_net
from PIL import Image
from test_hostile import (
    LENET,
    folder_args,
    make_image_folder,
    out_dir,
    run_hostile,
    trained_out_dir,
)
from torchvision.transforms.v2.functional import pil_to_tensor

from distribuuuu.config import load_cfg
from distribuuuu.data import DataError, build_dataset, check_data, image_reader
from distribuuuu.tools import predict

__all__ = ["out_dir", "trained_out_dir"]  # fixtures, from test_hostile

REPO = Path(__file__).resolve().parents[1]
CLASSES, PER_CLASS = 2, 3  # make_image_folder(root, CLASSES, PER_CLASS)


def folder_cfg(root: Path, *words: str):
    """The cfg of a LeNet-5 run on the image folder at ``root``."""
    batches = ["TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4"]
    return load_cfg(None, [*LENET, *batches, *folder_args(root), *words])


def link(path: Path, target: str) -> None:
    """``ln -s target path``."""
    os.symlink(target, path)


def write_png(path: Path, rows, width: int, height: int, depth: int, colour: int):
    """A PNG of ``rows`` (bytes, one per row, without the filter byte).

    ``colour``: 0 grey, 2 RGB.  Written by hand, since PIL writes neither
    16-bit RGB nor a 20000 x 20000 image in a few milliseconds.
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(b"\0" + row) for row in rows) + packer.flush()
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", data)
        + chunk(b"IEND", b"")
    )


def write_black_png(path: Path, width: int, height: int) -> Path:
    """A black 1-bit grey PNG of ``width`` x ``height``: small on disk at any size."""
    row = bytes((width + 7) // 8)
    write_png(path, (row for _ in range(height)), width, height, 1, 0)
    return path


# --------------------------------------------------------------------------- #
# Link loops
# --------------------------------------------------------------------------- #


def test_a_link_loop_counts_each_image_once(tmp_path):
    root = make_image_folder(tmp_path / "data", CLASSES, PER_CLASS)
    for split in ("train", "val"):
        link(root / split / "c00" / "loop", ".")  # ln -s . train/c00/loop
        link(root / split / "c01" / "up", "..")  # the split itself, c00 included
        link(root / split / "c01" / "self", "self")  # resolves to nothing
    cfg = folder_cfg(root, "MODEL.NUM_CLASSES", str(CLASSES))
    check_data(cfg)  # the pre-flight check
    for train in (True, False):
        dataset = build_dataset(cfg, train)
        paths = [path for path, _ in dataset.samples]
        assert len(paths) == CLASSES * PER_CLASS, paths
        labels = [label for _, label in dataset.samples]
        assert labels == [0] * PER_CLASS + [1] * PER_CLASS
        assert all(os.path.dirname(path).endswith(("c00", "c01")) for path in paths)


@pytest.mark.parametrize("target", [".", ".."])
def test_a_class_folder_linked_to_its_split_is_refused(out_dir, tmp_path, target):
    root = make_image_folder(tmp_path / "data", CLASSES, PER_CLASS)
    link(root / "val" / "c09", target)  # every image of val again, or of all
    words = [str(root / "val" / "c09"), "link back", "loop"]
    run_hostile(out_dir, [*LENET, *folder_args(root)], 2, words)


def test_a_folder_linked_in_is_followed_once(tmp_path):
    """A link to a data set elsewhere is followed (users link data into place);
    two links to it count each image once."""
    root = make_image_folder(tmp_path / "data", CLASSES, PER_CLASS)
    extra = tmp_path / "elsewhere" / "more_cats"
    extra.mkdir(parents=True)
    for index in range(2):
        Image.new("RGB", (32, 32), (9, index, 9)).save(extra / f"{index}.png")
    link(root / "train" / "c00" / "more", str(extra))
    link(root / "train" / "c00" / "same", str(extra))
    cfg = folder_cfg(root, "MODEL.NUM_CLASSES", str(CLASSES))
    paths = [path for path, _ in build_dataset(cfg, train=True).samples]
    more = root / "train" / "c00" / "more"
    assert paths[PER_CLASS : PER_CLASS + 2] == [
        str(more / "0.png"),
        str(more / "1.png"),
    ]
    assert len(paths) == CLASSES * PER_CLASS + 2


@pytest.fixture
def two_self_links(tmp_path) -> Path:
    """An image folder whose train/c00 and val/c01 hold ``a -> .`` and ``b -> .``:
    2**40 paths for a walk that follows links until they are too long."""
    root = make_image_folder(tmp_path / "data", CLASSES, PER_CLASS)
    for folder in (root / "train" / "c00", root / "val" / "c01"):
        link(folder / "a", ".")
        link(folder / "b", ".")
    return root


@pytest.mark.slow  # a new interpreter importing torch
def test_two_self_links_do_not_hang_the_run(two_self_links, tmp_path):
    """The pre-flight check and the data set build of a real command (a dry
    run builds both data sets and runs a step) end in seconds."""
    out = tmp_path / "out"
    args = [*LENET, *folder_args(two_self_links), "MODEL.NUM_CLASSES", "2"]
    args += ["TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4"]
    result = train_net("--dry-run", *args, "OUT_DIR", str(out), timeout=60)
    assert_ok(result)
    images = CLASSES * PER_CLASS
    assert f"{images} train / {images} val images" in result.stdout + result.stderr
    assert not out.exists()  # a dry run writes nothing


@pytest.mark.slow  # a new interpreter importing torch
def test_two_self_links_do_not_hang_predict(two_self_links, trained_out_dir):
    weights = str(trained_out_dir / "best.pth")
    folder = str(two_self_links / "train")
    tool = os.path.join(REPO, "tools", "predict.py")
    cmd = [sys.executable, tool, "--weights", weights, "--device", "cpu", "--json"]
    result = run_command([*cmd, folder], timeout=60)
    assert_ok(result)
    printed = [json.loads(line)["path"] for line in result.stdout.splitlines()]
    expected = sorted(str(p) for p in Path(folder).glob("c*/*.*"))
    assert printed == expected and len(printed) == CLASSES * PER_CLASS


# --------------------------------------------------------------------------- #
# Decompression bombs
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> list[Path]:
    """Black PNGs of 20000 x 20000 (400 M pixels, 60 KB; PIL refuses it) and
    10000 x 9000 (just above the limit, where PIL alone only warns)."""
    folder = tmp_path_factory.mktemp("bombs")
    assert 10000 * 9000 > Image.MAX_IMAGE_PIXELS > 10000 * 9000 / 2
    return [
        write_black_png(folder / "huge.png", 20000, 20000),
        write_black_png(folder / "above_limit.png", 10000, 9000),
    ]


@pytest.mark.parametrize("decoder", ["fused", "tensor", "pil"])
def test_both_decoders_refuse_a_decompression_bomb(bombs, decoder):
    read = image_reader(load_cfg(None, ["DATA.DECODER", decoder]))
    for bomb in bombs:
        words = re.escape(f"cannot read image {bomb}: ") + ".* pixels"
        with pytest.raises(DataError, match=words):
            read(str(bomb))


@pytest.mark.slow  # a new interpreter importing torch
def test_a_decompression_bomb_is_refused_before_decoding(bombs):
    """In a fresh process, neither decoder adds 100 MB to its peak memory
    (the 20000 x 20000 image would take 1.2 GB as a tensor)."""
    script = f"""
import json, resource, sys
from distribuuuu.data.datasets import DataError, decode_image_file, load_image
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
before, errors = peak(), []
for read in (decode_image_file, load_image):
    for path in {[str(b) for b in bombs]!r}:
        try:
            read(path)
        except DataError as error:
            errors.append(str(error))
print(json.dumps({{"grown_mb": peak() - before, "errors": errors}}))
"""
    result = run_command([sys.executable, "-c", script], timeout=60)
    assert_ok(result)
    report = json.loads(result.stdout.splitlines()[-1])
    assert len(report["errors"]) == 4, report
    assert report["grown_mb"] < 100, report


def test_skip_corrupt_skips_a_decompression_bomb(bombs, tmp_path):
    root = make_image_folder(tmp_path / "data", CLASSES, PER_CLASS)
    bomb = root / "val" / "c00" / "0.png"  # sample 1, between 0.jpg and 1.png
    bomb.write_bytes(bombs[0].read_bytes())
    cfg = folder_cfg(root, "MODEL.NUM_CLASSES", "2")
    with pytest.raises(DataError, match=re.escape(f"cannot read image {bomb}")):
        build_dataset(cfg, train=False)[1]
    cfg = folder_cfg(root, "MODEL.NUM_CLASSES", "2", "DATA.SKIP_CORRUPT", "True")
    dataset = build_dataset(cfg, train=False)
    image, label = dataset[1]  # 1.png served instead
    assert torch.equal(image, dataset[2][0]) and label == 0


def test_predict_refuses_a_decompression_bomb(bombs, trained_out_dir, capsys):
    weights = str(trained_out_dir / "best.pth")
    for decoder in ("fused", "tensor", "pil"):
        argv = ["--weights", weights, "--device", "cpu", "DATA.DECODER", decoder]
        assert predict.main([*argv, str(bombs[0])]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and captured.out == ""
        assert lines[0].startswith(f"error: cannot read image {bombs[0]}: ")


# --------------------------------------------------------------------------- #
# 16-bit PNGs
# --------------------------------------------------------------------------- #


def sixteen_bit_picture() -> np.ndarray:
    """A 48 x 64 RGB picture of 16-bit values: ramps, a dark corner and noise."""
    y, x = np.mgrid[0:48, 0:64].astype(np.int64)
    noise = np.random.default_rng(0).integers(0, 3000, (48, 64))
    red = x * 1000 + y * 30 + noise
    green = 65535 - y * 1300 - noise
    blue = (x * y * 20) % 65536
    return np.stack([red, green, blue], axis=-1).clip(0, 65535)


@pytest.mark.parametrize("decoder", ["fused", "tensor", "pil"])
def test_sixteen_bit_pngs_are_scaled_to_eight_bits(tmp_path, decoder):
    picture = sixteen_bit_picture()
    eight_bits = ((picture * 255 + 32767) // 65535).astype(np.uint8)
    grey16, rgb16 = picture[..., 1], picture.astype(">u2")
    height, width = grey16.shape
    grey_rows = [row.tobytes() for row in grey16.astype(">u2")]
    write_png(tmp_path / "grey16.png", grey_rows, width, height, 16, 0)
    rgb_rows = [row.tobytes() for row in rgb16]
    write_png(tmp_path / "rgb16.png", rgb_rows, width, height, 16, 2)
    Image.fromarray(eight_bits[..., 1]).save(tmp_path / "grey8.png")
    Image.fromarray(eight_bits).save(tmp_path / "rgb8.png")
    assert Image.open(tmp_path / "grey16.png").mode.startswith("I")  # 16-bit grey
    read = image_reader(load_cfg(None, ["DATA.DECODER", decoder]))

    def pixels(name: str) -> torch.Tensor:
        image = read(str(tmp_path / name))
        image = image if isinstance(image, torch.Tensor) else pil_to_tensor(image)
        assert image.dtype == torch.uint8 and image.shape == (3, height, width)
        return image.int()

    for sixteen, eight in (("grey16.png", "grey8.png"), ("rgb16.png", "rgb8.png")):
        image, reference = pixels(sixteen), pixels(eight)
        difference = (image - reference).abs()
        assert abs(image.float().mean() - reference.float().mean()) < 1, sixteen
        assert difference.max() <= 1, sixteen
