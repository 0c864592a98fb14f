"""Hostile data: link loops, FIFOs, decompression bombs, crafted JPEGs and
16-bit images.

A link loop in an image folder is walked once (no hang, each image counted
once), a FIFO is never listed nor waited on, an image with more pixels than
the limit (also one whose frame header hides behind stuffed bytes) or a file
larger than the size limit is refused before decoding by every decoder,
naming the file, and 16-bit PNGs are scaled to 8 bits.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import struct
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_ok, run_command, run_python, train_net
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
from distribuuuu.data import (
    SeededDataset,
    build_dataset,
    check_data,
    image_files,
    image_reader,
    turbo,
)
from distribuuuu.data import datasets as ds
from distribuuuu.data.jpeg import JpegFile, jpeg_bytes, jpeg_header, read_or_defer
from distribuuuu.engine.specs import data_spec
from distribuuuu.errors import DataError
from distribuuuu.inference.predict import find_images
from distribuuuu.tools import predict

__all__ = ["out_dir", "trained_out_dir"]  # fixtures, from test_hostile

REPO = Path(__file__).resolve().parents[2]
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
    check_data(data_spec(cfg))  # the pre-flight check
    for train in (True, False):
        dataset = build_dataset(data_spec(cfg), train)
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
    paths = [path for path, _ in build_dataset(data_spec(cfg), train=True).samples]
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


@pytest.mark.slow
def test_two_self_links_do_not_hang_predict(two_self_links, trained_out_dir):
    weights = str(trained_out_dir / "best.pth")
    folder = str(two_self_links / "train")
    tool = os.path.join(REPO, "tools", "predict.py")
    cmd = [tool, "--weights", weights, "--device", "cpu", "--json"]
    result = run_python([*cmd, folder], timeout=60)
    assert_ok(result)
    printed = [json.loads(line)["path"] for line in result.stdout.splitlines()]
    expected = sorted(str(p) for p in Path(folder).glob("c*/*.*"))
    assert printed == expected and len(printed) == CLASSES * PER_CLASS


# --------------------------------------------------------------------------- #
# FIFOs
# --------------------------------------------------------------------------- #


def refused_at_once(read, path: Path) -> str:
    """The DataError message of ``read(path)``, run in a thread; a read that
    waits on the FIFO ``path`` for a writer fails the test (the FIFO is then
    opened for writing, which ends the wait)."""
    outcome = []

    def attempt() -> None:
        try:
            outcome.append(f"returned {read(str(path))!r}")
        except Exception as error:
            outcome.append(str(error))

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(2)
    if thread.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(2)
        pytest.fail(f"{read} waited on the FIFO {path}")
    return outcome[0]


def test_a_fifo_named_like_an_image_is_never_listed_nor_waited_on(tmp_path):
    """Listing (data set, class folders, pre-flight count, predict) skips a
    FIFO; one swapped in after the listing is refused at once by every
    reader, naming the file: nothing waits for a writer, for ever."""
    root = make_image_folder(tmp_path / "data", CLASSES, PER_CLASS)
    split, fifo = root / "train", root / "train" / "c00" / "pipe.jpg"
    os.mkfifo(fifo)
    lonely = split / "c02"
    lonely.mkdir()
    os.mkfifo(lonely / "pipe.png")  # a class folder with no image but a FIFO
    with pytest.raises(DataError, match=re.escape(f"empty class folder {lonely}")):
        ds.find_image_classes(str(split), "TRAIN.DATASET")
    os.rename(lonely / "pipe.png", split / "c01" / "pipe.png")
    lonely.rmdir()
    images = CLASSES * PER_CLASS
    assert ds.count_images(str(split), 100) == images
    listed = ds.find_image_files(str(split))
    assert len(listed) == images and not any("pipe" in path for path in listed)
    assert find_images([str(split)]) == sorted(listed)
    with pytest.raises(DataError, match=re.escape(f"{fifo}: not a regular file")):
        find_images([str(fifo)])
    cfg = folder_cfg(root, "MODEL.NUM_CLASSES", str(CLASSES))
    assert [
        path for path, _ in build_dataset(data_spec(cfg), train=True).samples
    ] == listed
    readers = [read_or_defer, image_files.read_image_bytes]
    readers += [image_reader(decoder)
                for decoder in ("fused", "tensor", "pil")]  # fmt: skip
    for read in readers:
        message = refused_at_once(read, fifo)
        assert message == f"cannot read image {fifo}: not a regular file", read


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
    read = image_reader(decoder)
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
from distribuuuu.data.image_files import decode_image_file, load_image
from distribuuuu.errors import DataError
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
        build_dataset(data_spec(cfg), train=False)[1]
    cfg = folder_cfg(root, "MODEL.NUM_CLASSES", "2", "DATA.SKIP_CORRUPT", "True")
    dataset = build_dataset(data_spec(cfg), train=False)
    image, label = dataset[1]  # 1.png served instead
    assert torch.equal(image, dataset[2][0]) and label == 0


def test_predict_refuses_a_decompression_bomb(
    bombs, hidden_frame, trained_out_dir, capsys
):
    weights = str(trained_out_dir / "best.pth")
    for decoder, bomb in itertools.product(("fused", "tensor", "pil"),
                                           (bombs[0], hidden_frame)):  # fmt: skip
        argv = ["--weights", weights, "--device", "cpu", "DATA.DECODER", decoder]
        assert predict.main([*argv, str(bomb)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and captured.out == ""
        assert lines[0].startswith(f"error: cannot read image {bomb}: ")


# --------------------------------------------------------------------------- #
# Crafted JPEGs and oversized files
# --------------------------------------------------------------------------- #


def hidden_frame_jpeg(height: int, width: int) -> bytes:
    """A 16 x 16 JPEG whose frame header says ``height`` x ``width``, hidden
    from a parser that reads 0xFF 0x00 as a marker with a length: such a
    parser skips it and finds a decoy 16 x 16 frame header after it, which
    libjpeg and PIL (which skip 0xFF 0x00 as stuffed data) read inside an
    APP1 segment."""
    pixels = np.random.default_rng(3).integers(0, 256, (16, 16, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    data = out.getvalue()
    start = data.index(b"\xff\xc0")
    end = start + 2 + int.from_bytes(data[start + 2 : start + 4], "big")
    decoy = data[start:end]
    real = decoy[:5] + struct.pack(">HH", height, width) + decoy[9:]
    hidden = real + b"\xff\xe1" + struct.pack(">H", 2 + len(decoy))
    stuffed = b"\xff\x00" + struct.pack(">H", 2 + len(hidden)) + hidden
    return data[:start] + stuffed + decoy + data[end:]


@pytest.fixture(scope="module")
def hidden_frame(tmp_path_factory) -> Path:
    """881 bytes that libjpeg decodes as 12000 x 12000 (1.1 GB of pixels)."""
    path = tmp_path_factory.mktemp("crafted") / "hidden.jpg"
    path.write_bytes(hidden_frame_jpeg(12000, 12000))
    return path


def every_reader() -> list:
    """The readers of image files: DATA.DECODER fused, tensor and pil
    (training, evaluation and predict), and the reader of the fused training
    crop windows and of DATA.DECODER gpu's workers."""
    readers = [image_reader(decoder)
               for decoder in ("fused", "tensor", "pil")]  # fmt: skip
    return [*readers, read_or_defer]


def assert_refused_by_every_decoder(path: Path, words: str) -> None:
    """Each of :func:`every_reader` refuses the file at ``path``, and so does
    the decoder of a shard sample of its bytes, with a DataError holding
    ``words``."""
    for read in every_reader():
        with pytest.raises(DataError, match=re.escape(words)):
            read(str(path))
    data = path.read_bytes()
    assert jpeg_bytes(data, str(path)) is None
    with pytest.raises(DataError, match=re.escape(words)):
        image_files.decode_image_bytes(data, str(path), as_tensor=True)


def test_a_frame_header_hidden_behind_stuffed_bytes_is_refused(hidden_frame):
    """The size is the one libjpeg decodes, so the pixel limit refuses the
    file from its header in every decoder, a shard sample too."""
    header = jpeg_header(hidden_frame.read_bytes())
    assert (header.height, header.width) == (12000, 12000)
    words = f"cannot read image {hidden_frame}: 12000 x 12000 pixels, more than"
    assert_refused_by_every_decoder(hidden_frame, words)


def test_crops_are_drawn_for_the_size_decoded(tmp_path, monkeypatch):
    """A frame header hidden behind stuffed bytes below the pixel limit, and
    fill bytes before every marker: the fused decoder's crops, with and
    without libjpeg-turbo, are the tensor decoder's for the same seeds, and
    the gpu decoder's workers draw for the size decoded."""
    root = tmp_path / "data"
    (root / "train" / "c00").mkdir(parents=True)
    (root / "train" / "c01").mkdir()
    hidden = root / "train" / "c00" / "hidden.jpg"
    hidden.write_bytes(hidden_frame_jpeg(96, 80))
    filled = root / "train" / "c01" / "filled.jpg"
    Image.fromarray(sixteen_bit_picture().astype(np.uint8)).save(filled, quality=90)
    data = filled.read_bytes()
    for marker in (b"\xdb", b"\xc0", b"\xc4", b"\xda"):  # before the scan
        data = data.replace(b"\xff" + marker, b"\xff\xff\xff" + marker)
    filled.write_bytes(data)
    assert isinstance(read_or_defer(str(filled)), JpegFile)  # the fused path
    for path, size in ((hidden, (96, 80)), (filled, (48, 64))):
        image = read_or_defer(str(path))  # what the gpu decoder's workers read
        header = image.header if isinstance(image, JpegFile) else None
        assert ((header.height, header.width) if header else image.shape[1:]) == size
    words = ("TEST.SPLIT", "train", "DATA.DECODER")
    reference = build_dataset(data_spec(folder_cfg(root, *words, "tensor")), train=True)
    tensor, cfg = SeededDataset(reference), folder_cfg(root, *words, "fused")
    for library in (turbo.window_decoder(), None):
        monkeypatch.setattr(turbo, "_decoder", library)
        monkeypatch.setattr(turbo, "_searched", True)
        fused = SeededDataset(build_dataset(data_spec(cfg), train=True))
        for index, seed in itertools.product((0, 1), range(6)):
            image, expected = fused[(index, seed)][0], tensor[(index, seed)][0]
            assert torch.equal(image, expected), (index, seed, library)


def test_an_image_file_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    """A JPEG padded with fill bytes (PIL walks them at about 0.6 s per MiB)
    past MAX_IMAGE_FILE_BYTES is refused by every decoder, naming the file
    and the limit; a sparse 1 GiB file is refused without being read."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 30)).save(out, "JPEG")
    data = out.getvalue()
    padded = data[:2] + b"\xff" * 5000 + data[2:]  # fill bytes: a valid JPEG
    path = tmp_path / "padded.jpg"
    path.write_bytes(padded)
    monkeypatch.setattr(image_files, "MAX_IMAGE_FILE_BYTES", 4096)
    words = f"cannot read image {path}: {len(padded)} bytes, more than the limit "
    words += "of 4096 bytes for one image file (MAX_IMAGE_FILE_BYTES"
    assert_refused_by_every_decoder(path, words)
    monkeypatch.undo()
    huge = tmp_path / "huge.jpg"
    with open(huge, "wb") as f:
        f.write(data)
        f.truncate(2**30)  # a sparse file: no disk is used
    words = f"cannot read image {huge}: {2**30} bytes, more than the limit"
    for read in every_reader():
        with pytest.raises(DataError, match=re.escape(words)):
            read(str(huge))


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
    read = image_reader(decoder)

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
