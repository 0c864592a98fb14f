"""DATA.DECODER fused: the tensor decoder's crops, pixels and errors, faster.

The JPEGs are made here with PIL: several sizes (odd ones, not whole MCUs),
chroma subsampling 4:2:0, 4:2:2 and 4:4:4, progressive, grey and CMYK (which
takes the tensor decoder's path), beside a PNG.
"""

from __future__ import annotations

import io
import platform
import random
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from distribuuuu.config import load_cfg
from distribuuuu.data import (
    SeededDataset,
    build_dataset,
    describe_decoder,
    image_files,
    image_reader,
    jpeg,
    turbo,
)
from distribuuuu.data.image_files import decode_image_file, load_image
from distribuuuu.data.jpeg import (
    JpegFile,
    jpeg_bytes,
    jpeg_header,
    read_image_fused,
    read_or_defer,
)
from distribuuuu.data.samplers import sample_seed
from distribuuuu.engine.specs import data_spec
from distribuuuu.errors import DataError

# name: (width, height, PIL mode, save options); PNG and CMYK take the
# tensor decoder's path, the others the fused one.
IMAGES = {
    "baseline420.jpg": (500, 375, "RGB", {"quality": 90}),
    "odd422.jpg": (131, 97, "RGB", {"quality": 85, "subsampling": 1}),
    "progressive444.jpg": (97, 141, "RGB", {"progressive": True, "subsampling": 0}),
    "grey.jpg": (120, 90, "L", {"quality": 90}),
    "cmyk.jpg": (90, 70, "CMYK", {"quality": 90}),
    "ramp.png": (80, 60, "RGB", {}),
}
SLOW_PATH = {"cmyk.jpg", "ramp.png"}


def _pixels(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour fields with noise: edges, gradients and fine detail."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3))
    smooth = Image.fromarray(coarse.astype(np.uint8)).resize(
        (width, height), Image.Resampling.BICUBIC
    )
    noise = rng.integers(-20, 21, (height, width, 3))
    return np.clip(np.asarray(smooth, np.int16) + noise, 0, 255).astype(np.uint8)


def _write(path, width: int, height: int, mode: str, options: dict) -> None:
    image = Image.fromarray(_pixels(width, height, len(str(path))))
    image.convert(mode).save(path, **options)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    for label in range(2):
        (root / "train" / f"c{label}").mkdir(parents=True)
    for index, (name, (width, height, mode, options)) in enumerate(IMAGES.items()):
        _write(root / "train" / f"c{index % 2}" / name, width, height, mode, options)
    return root


def _cfg(root, decoder: str):
    words = f"TRAIN.DATASET {root} TEST.DATASET {root} TEST.SPLIT train "
    words += "TRAIN.IM_SIZE 64 TEST.IM_SIZE 72 MODEL.NUM_CLASSES 2 "
    return load_cfg(None, [*words.split(), "DATA.DECODER", decoder])


def test_fused_crops_are_the_tensor_decoders_bit_for_bit(folder, monkeypatch):
    """Same seed, same crop, flip and pixels as torchvision.io.decode_jpeg then
    v2.RandomResizedCrop and v2.RandomHorizontalFlip (the tensor decoder);
    only CMYK and PNG files take the tensor decoder's own path."""
    reference = SeededDataset(
        build_dataset(data_spec(_cfg(folder, "tensor")), train=True)
    )
    reference_val = build_dataset(data_spec(_cfg(folder, "tensor")), train=False)
    slow = []

    class CountedSlowPath:
        """image_files as jpeg.py sees it, counting the files it decodes."""

        def __getattr__(self, name: str):
            return getattr(image_files, name)

        def decode_image_bytes(self, data, name: str, as_tensor: bool):
            slow.append(name.rsplit("/", 1)[1])
            return image_files.decode_image_bytes(data, name, as_tensor)

    monkeypatch.setattr(jpeg, "image_files", CountedSlowPath())
    fused = SeededDataset(build_dataset(data_spec(_cfg(folder, "fused")), train=True))
    fused_val = build_dataset(data_spec(_cfg(folder, "fused")), train=False)
    crops = []
    for epoch in range(3):
        # An epoch's samples all read first, as a batch holds them: none may
        # share pixels with a later one.
        seeds = [sample_seed(7, epoch, i) for i in range(len(fused.dataset))]
        samples = [fused[(index, seed)] for index, seed in enumerate(seeds)]
        for index, (seed, (image, label)) in enumerate(zip(seeds, samples)):
            expected, expected_label = reference[(index, seed)]
            assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
            assert torch.equal(image, expected) and label == expected_label
            crops.append(image)
    assert not torch.equal(crops[0], crops[len(IMAGES)])  # another epoch, crop
    for (image, _), (expected, _) in zip(fused_val, reference_val):
        assert torch.equal(image, expected)
    assert set(slow) == SLOW_PATH


def test_jpeg_header_reads_the_size_and_refuses_damaged_headers():
    def jpeg_frame(data):
        header = jpeg_header(data)
        if header is None:
            return None
        return (header.marker, header.precision, header.height, header.width,
                header.components)  # fmt: skip

    def encoded(mode: str = "RGB", **options) -> bytes:
        out = io.BytesIO()
        Image.fromarray(_pixels(45, 33, 0)).convert(mode).save(out, "JPEG", **options)
        return out.getvalue()

    assert jpeg_frame(encoded()) == (0xC0, 8, 33, 45, 3)
    assert jpeg_frame(encoded(progressive=True)) == (0xC2, 8, 33, 45, 3)
    assert jpeg_frame(encoded("L")) == (0xC0, 8, 33, 45, 1)
    assert jpeg_frame(encoded("CMYK"))[4] == 4
    exif = Image.Exif()
    exif[0x010E] = "x" * 5000  # a long APP1 segment before the frame
    assert jpeg_frame(encoded(exif=exif.tobytes())) == (0xC0, 8, 33, 45, 3)
    data = encoded()
    frame = data.index(b"\xff\xc0")
    assert jpeg_frame(data[: frame + 6]) is None  # cut inside the frame header
    assert jpeg_frame(data[:frame]) is None  # cut before it
    assert jpeg_frame(data[:2] + b"\xff\xe0\x00\x00" + data[2:]) is None  # length 0
    assert jpeg_frame(data[:2] + b"\xff\xda" + data[2:]) is None  # scan first
    assert jpeg_frame(b"\xff\xd8 not really a jpeg") is None
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    assert jpeg_frame(png.getvalue()) is None


def test_markers_are_found_as_libjpeg_finds_them():
    """Before a marker libjpeg passes over extraneous bytes, fill bytes and
    stuffed 0xFF 0x00 (not a marker with a length), and TEM and RSTn (no
    length); it refuses a marker it does not know."""
    out = io.BytesIO()
    Image.fromarray(_pixels(45, 33, 0)).save(out, "JPEG", quality=90)
    data = out.getvalue()
    frame = data.index(b"\xff\xc0")

    def size(before_frame: bytes) -> tuple[int, int] | None:
        header = jpeg_header(data[:frame] + before_frame + data[frame:])
        return None if header is None else (header.height, header.width)

    for passed in (b"junk", b"\xff\x00\x00\x10", b"\xff\xff\xff", b"\xff\x01",
                   b"\xff\xd3", b"\xff\x00\xff\x00"):  # fmt: skip
        assert size(passed) == (33, 45), passed
    for refused in (b"\xff\x02\x00\x04ab", b"\xff\xc8\x00\x04ab", b"\xff\xf0\x00\x02",
                    b"\xff\xd9", b"\xff\xd8"):  # fmt: skip
        assert size(refused) is None, refused


def _error(read, path) -> str:
    with pytest.raises(DataError) as error:
        read(str(path))
    return str(error.value)


def test_fused_errors_and_pixel_limit_are_the_tensor_decoders(tmp_path):
    good = io.BytesIO()
    Image.fromarray(_pixels(64, 48, 1)).save(good, "JPEG", quality=90)
    data = good.getvalue()
    scan = data.index(b"\xff\xda")
    damaged = {
        "garbage.jpg": b"\xff\xd8 not really a jpeg",
        "truncated_header.jpg": data[: scan - 40],
        "no_scan_data.jpg": data[: scan + 20],
        "missing.jpg": None,
    }
    frame = data.index(b"\xff\xc0")  # height and width 5-8 bytes after it
    size = (9000).to_bytes(2, "big") + (12000).to_bytes(2, "big")  # over the limit
    damaged["bomb.jpg"] = data[: frame + 5] + size + data[frame + 9 :]
    for name, content in damaged.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        message = _error(read_image_fused, tmp_path / name)
        assert message == _error(decode_image_file, tmp_path / name)
        assert message.startswith(f"cannot read image {tmp_path / name}: ")
    assert re.search("12000 x 9000 pixels, more than", message)
    read = image_reader("fused")
    assert read is read_image_fused


# --- crop windows decoded by libjpeg-turbo (distribuuuu.data.turbo) ----------

# Where setup.py installs the turbojpeg wheel, whose library decodes windows.
WHEEL_PLATFORM = (
    sys.platform == "linux"
    and platform.machine() == "x86_64"
    and sys.version_info < (3, 14)
)
# (width, height, PIL mode, save options): every subsampling the window
# decoder takes, baseline and progressive, sizes that are not whole iMCUs.
WINDOW_JPEGS = [
    (500, 375, "RGB", {"quality": 90}),
    (257, 193, "RGB", {"quality": 75, "progressive": True}),
    (131, 97, "RGB", {"quality": 85, "subsampling": 1}),
    (97, 141, "RGB", {"quality": 95, "subsampling": 0, "progressive": True}),
    (120, 90, "L", {"quality": 90}),
    (33, 17, "L", {"quality": 90, "progressive": True}),
]


def _window_decoder() -> turbo.WindowDecoder:
    decoder = turbo.window_decoder()
    if decoder is None:
        assert not WHEEL_PLATFORM, "the turbojpeg wheel's library was not found"
        pytest.skip("no libjpeg-turbo 3 on this platform")
    return decoder


def _encoded(width: int, height: int, mode: str, options: dict) -> bytes:
    out = io.BytesIO()
    image = Image.fromarray(_pixels(width, height, width * height))
    image.convert(mode).save(out, "JPEG", **options)
    return out.getvalue()


def _windows(width: int, height: int, count: int, seed: int):
    """The whole image, corners and edge strips, then random windows."""
    yield 0, 0, height, width
    yield 0, 0, 1, 1
    yield height - 1, width - 1, 1, 1
    yield 0, width - 3, height, 3
    yield height - 2, 0, 2, width
    rng = random.Random(seed)
    for _ in range(count):
        h, w = rng.randint(1, height), rng.randint(1, width)
        yield rng.randint(0, height - h), rng.randint(0, width - w), h, w


def test_crop_windows_are_the_whole_decodes_pixels():
    """Bit for bit the pixels of torchvision.io.decode_jpeg then the crop, for
    every subsampling, progressive and grey JPEGs, windows at every edge."""
    decoder = _window_decoder()
    for index, (width, height, mode, options) in enumerate(WINDOW_JPEGS):
        data = _encoded(width, height, mode, options)
        image = jpeg_bytes(data, f"window{index}.jpg")
        full = image.decode()
        for top, left, h, w in _windows(width, height, 120, index):
            expected = full[:, top : top + h, left : left + w]
            window = decoder.decode(bytearray(data), top, left, h, w)
            assert window is not None and torch.equal(window, expected), (
                index, top, left, h, w,
            )  # fmt: skip
            assert torch.equal(image.window(top, left, h, w), expected)
        assert decoder.decode(bytearray(data), 0, 0, height + 1, width) is None
    # Each window owns its pixels: a later decode leaves an earlier one alone
    # (a crop of the whole image comes out of the resize unchanged).
    first_data, second_data = (_encoded(*kind) for kind in WINDOW_JPEGS[4:6])
    first = decoder.decode(bytearray(first_data), 0, 0, 90, 120)
    kept = first.clone()
    decoder.decode(bytearray(second_data), 0, 0, 17, 33)
    assert torch.equal(first, kept)


def test_whole_images_are_decoded_without_a_window_library(
    folder, monkeypatch, tmp_path
):
    """DISTRIBUUUU_TURBOJPEG=0, a path that is no library, or a library that
    fails the pixel check at load: no window decoder, and the crops keep the
    same pixels (the whole image is decoded)."""
    data = _encoded(*WINDOW_JPEGS[0])
    image = jpeg_bytes(data, "whole.jpg")
    expected = image.decode()[:, 40:240, 30:330]
    decoder = _window_decoder()
    fused, tensor = _cfg(folder, "fused"), _cfg(folder, "tensor")
    assert (
        describe_decoder(data_spec(fused)) == f"fused (crop windows by {decoder.path})"
    )
    assert describe_decoder(data_spec(tensor)) == "tensor"
    monkeypatch.setenv(turbo.ENVIRONMENT, decoder.path)
    assert turbo.find_decoder().path == decoder.path
    monkeypatch.setenv(turbo.ENVIRONMENT, "0")
    assert turbo.find_decoder() is None
    (tmp_path / "libturbojpeg.so").write_text("not a library")
    monkeypatch.setenv(turbo.ENVIRONMENT, str(tmp_path / "libturbojpeg.so"))
    assert turbo.find_decoder() is None
    monkeypatch.delenv(turbo.ENVIRONMENT)
    monkeypatch.setattr(turbo, "_MARGIN", 0)  # edges upsampled without neighbours
    assert turbo.find_decoder() is None  # the check at load catches it
    monkeypatch.setattr(turbo, "_decoder", None)
    monkeypatch.setattr(turbo, "_searched", True)
    assert torch.equal(image.window(40, 30, 200, 300), expected)
    described = describe_decoder(data_spec(fused))
    assert described.startswith("fused (whole JPEGs") and turbo.ENVIRONMENT in described


def test_a_truncated_jpeg_is_refused_whatever_the_window(tmp_path):
    """A JPEG cut in its scan: the crop window above the cut (which
    libjpeg-turbo decodes without reading on) is refused as the tensor, pil
    and fused decoders refuse the file; bytes after the end marker are no
    damage, and the window gives the tensor decoder's pixels."""
    data = _encoded(160, 120, "RGB", {"quality": 90})
    cut, trailing = tmp_path / "cut.jpg", tmp_path / "trailing.jpg"
    cut.write_bytes(data[: len(data) * 2 // 3])
    trailing.write_bytes(data + bytes(64))
    message = _error(decode_image_file, cut)
    assert message == _error(load_image, cut) == _error(read_image_fused, cut)
    deferred = read_or_defer(str(cut))
    assert isinstance(deferred, JpegFile)  # the header passes
    with pytest.raises(DataError) as refused:
        deferred.window(0, 0, 8, 8)
    assert str(refused.value) == message
    expected = decode_image_file(str(trailing))[:, :8, :8]
    assert torch.equal(read_or_defer(str(trailing)).window(0, 0, 8, 8), expected)


def test_damaged_jpegs_fail_in_the_window_as_in_the_tensor_decoder(tmp_path):
    """A file whose header reads but whose data is damaged: the window path
    gives the tensor decoder's pixels or its error, naming the file."""
    data = _encoded(64, 48, "RGB", {"quality": 90})
    table = data.index(b"\xff\xc4")  # a Huffman table, after the frame header
    length = int.from_bytes(data[table + 2 : table + 4], "big")
    scan = data.index(b"\xff\xda")
    damaged = {
        "huffman.jpg": data[: table + 4]
        + b"\xff" * (length - 2)
        + data[table + 2 + length :],
        "cut_scan.jpg": data[: scan + 200],
        "noise_scan.jpg": data[: scan + 20] + bytes(range(256)) * 2 + b"\xff\xd9",
    }

    def window(path) -> torch.Tensor:
        deferred = read_or_defer(str(path))
        # The header passes, but for the Huffman table, which libjpeg-turbo's
        # own header read refuses: decoded at once, by the tensor decoder.
        assert isinstance(deferred, JpegFile) == (path.name != "huffman.jpg")
        if isinstance(deferred, JpegFile):
            return deferred.window(5, 6, 40, 44)
        return deferred[:, 5:45, 6:50]

    for name, content in damaged.items():
        path = tmp_path / name
        path.write_bytes(content)
        try:
            expected = decode_image_file(str(path))[:, 5:45, 6:50]
        except DataError as error:
            with pytest.raises(DataError) as raised:
                window(path)
            assert str(raised.value) == str(error) and str(path) in str(error)
        else:
            assert torch.equal(window(path), expected), name
    decoder = turbo.window_decoder()
    if decoder is not None:  # a refused file leaves the next one decodable
        assert decoder.decode(bytearray(damaged["huffman.jpg"]), 0, 0, 8, 8) is None
        assert decoder.decode(bytearray(data), 5, 6, 40, 44) is not None
