"""JPEG files read straight to uint8 tensors (``DATA.DECODER fused``).

The ``tensor`` decoder opens every file with PIL first, for the pixel limit
and the errors, then hands the bytes to ``torchvision.io``.  For the common
case, an 8-bit JPEG of grey or colour pixels, :func:`read_image_fused` reads
the size from the JPEG's own frame header instead (a few microseconds of
parsing, against about 70 of PIL's ``Image.open``), reads the file once into
the buffer the decoder takes, and decodes it with the same libjpeg-turbo call
as the ``tensor`` decoder: the same pixels.  Everything else (PNG, WebP, CMYK
JPEGs, 12-bit or lossless JPEGs, a frame header it cannot find, an image over
the pixel limit, a file the decoder refuses) goes through
:func:`~distribuuuu.data.datasets.decode_image_file`, so the errors,
``DATA.SKIP_CORRUPT`` and the pixel limit are those of the ``tensor`` decoder.

For training, :func:`read_or_defer` leaves such a JPEG undecoded
(:class:`JpegFile`): the crop is drawn from the header's size, and only its
window is decoded (:mod:`distribuuuu.data.turbo`), with the same pixels.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torchvision.transforms.v2 import functional as F

from distribuuuu.data import datasets as ds
from distribuuuu.data import turbo

try:  # deprecated in torchvision 0.29, like the decoder of datasets.py
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # gone: every file takes the tensor decoder's path
    decode_jpeg = None

START_OF_IMAGE = b"\xff\xd8"
# Start-of-frame markers (ITU-T T.81 table B.1): 0xC0-0xCF except DHT (0xC4),
# JPG (0xC8) and DAC (0xCC).
_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Baseline, extended and progressive Huffman coding: the frames that
# libjpeg-turbo (torchvision.io on the CPU) and nvJPEG both decode.
_PLAIN_FRAMES = (0xC0, 0xC1, 0xC2)
# Markers without a length: TEM and the restart markers RST0-RST7.
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD8)])


@dataclass(frozen=True)
class JpegHeader:
    """What a JPEG frame header says: size, samples, and its marker."""

    height: int
    width: int
    components: int
    precision: int
    marker: int

    @property
    def plain_8bit(self) -> bool:
        """True for 8-bit Huffman-coded (baseline, extended or progressive)
        grey or three-component images: what DATA.DECODER fused reads
        straight to the decoder and nvJPEG decodes on the GPU."""
        return (
            self.marker in _PLAIN_FRAMES
            and self.precision == 8
            and self.components in (1, 3)
        )


def jpeg_header(data: bytes) -> JpegHeader | None:
    """The frame header of the JPEG file ``data``, read without decoding it;
    None when ``data`` is not a JPEG with a frame header before its first scan.

    Walks the marker segments from the start, each step at least one byte on,
    and never reads past the end of ``data``: any input ends in one pass.
    """
    if data[:2] != START_OF_IMAGE:
        return None
    position, end = 2, len(data)
    while position + 4 <= end:
        if data[position] != 0xFF:
            return None  # not a marker where one must be
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in _STANDALONE_MARKERS:
            position += 2
            continue
        length = int.from_bytes(data[position + 2 : position + 4], "big")
        if marker in (0xD8, 0xD9, 0xDA) or length < 2:
            return None  # another SOI, the end or a scan before any frame
        if marker in _FRAME_MARKERS:
            segment = data[position + 4 : position + 2 + length]
            if len(segment) < 6:
                return None
            components = segment[5]
            header = JpegHeader(
                height=int.from_bytes(segment[1:3], "big"),
                width=int.from_bytes(segment[3:5], "big"),
                components=components,
                precision=segment[0],
                marker=marker,
            )
            complete = components > 0 and len(segment) >= 6 + 3 * components
            return header if complete and header.height and header.width else None
        position += 2 + length
    return None


# A JPEG file larger than this many bytes per pixel of the pixel limit is not
# read whole here (raw 8-bit RGB is 3 bytes per pixel): the tensor decoder's
# path, which reads the header first, takes it.
_BYTES_PER_PIXEL = 4


def pack_channels(image: torch.Tensor) -> torch.Tensor:
    """``image`` (C x H x W) as a view of a packed H x W x C buffer: the layout
    that torch's antialiased uint8 resize reads fastest on the CPU (93 against
    133 us for a crop viewed in a larger buffer, and 252 for a C x H x W
    tensor, resizing to 224 px here); the same pixels."""
    return image.permute(1, 2, 0).contiguous().permute(2, 0, 1)


@dataclass(frozen=True)
class JpegFile:
    """A plain 8-bit JPEG read but not decoded: its bytes and frame header.

    ``name`` (the file, or a sample of a shard) is what errors name.  It is
    decoded whole (:meth:`decode`) or only in the crop window a training
    transform draws from its size (:meth:`window`).
    """

    name: str
    data: bytearray
    header: JpegHeader

    def decode(self) -> torch.Tensor:
        """The whole image: an RGB uint8 tensor (3 x H x W), a view of the
        decoder's H x W x 3 buffer, the layout the antialiased resize after it
        reads without a copy."""
        if decode_jpeg is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    encoded = torch.frombuffer(self.data, dtype=torch.uint8)
                    return decode_jpeg(encoded, mode=ImageReadMode.RGB)
            except (RuntimeError, ValueError):
                pass  # damaged: PIL decides, as for the tensor decoder
        return ds.decode_image_bytes(bytes(self.data), self.name, as_tensor=True)

    def window(self, top: int, left: int, height: int, width: int) -> torch.Tensor:
        """The ``height`` x ``width`` window at (``top``, ``left``), inside the
        image: the pixels of :meth:`decode` there, decoding only that part
        where libjpeg-turbo's window decoding is available
        (:mod:`distribuuuu.data.turbo`)."""
        decoder = turbo.window_decoder()
        if decoder is not None:
            pixels = decoder.decode(self.data, top, left, height, width)
            if pixels is not None:
                return pixels
        return pack_channels(F.crop_image(self.decode(), top, left, height, width))


def _plain(header: JpegHeader | None) -> bool:
    """True for a plain 8-bit JPEG within the pixel limit (see
    :attr:`JpegHeader.plain_8bit`)."""
    if header is None or not header.plain_8bit:
        return False
    limit = ds.max_image_pixels()
    return limit is None or header.width * header.height <= limit


def jpeg_bytes(data: bytes | bytearray, name: str) -> JpegFile | None:
    """``data`` as a :class:`JpegFile` named ``name`` if it is a plain 8-bit
    JPEG within the pixel limit; None for anything else."""
    header = jpeg_header(data)
    if not _plain(header):
        return None
    return JpegFile(name, data if isinstance(data, bytearray) else bytearray(data),
                    header)  # fmt: skip


def read_jpeg(path: str) -> JpegFile | None:
    """The file at ``path`` as a :class:`JpegFile` if it is a plain 8-bit JPEG
    within the pixel limit, read in one piece into the buffer the decoders
    take; None for any other file and for one that cannot be read (the tensor
    decoder's path names it), without reading more than 4 bytes per pixel of
    the limit."""
    limit = ds.max_image_pixels()
    try:
        with open(path, "rb") as f:
            if f.read(2) != START_OF_IMAGE:
                return None
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > _BYTES_PER_PIXEL * limit:
                return None
            data = bytearray(size)
            data[:2] = START_OF_IMAGE
            del data[2 + f.readinto(memoryview(data)[2:]) :]
    except OSError:
        return None
    return jpeg_bytes(data, path)


def read_or_defer(path: str) -> JpegFile | torch.Tensor:
    """The image file at ``path`` as a :class:`JpegFile` to decode later (in
    the crop window the transform draws), or decoded now by
    :func:`~distribuuuu.data.datasets.decode_image_file` when it is not a
    plain 8-bit JPEG: the reader of DATA.DECODER fused training and of
    DATA.DECODER gpu."""
    image = read_jpeg(path)
    return ds.decode_image_file(path) if image is None else image


def read_image_fused(path: str) -> torch.Tensor:
    """Read the image file at ``path`` as an RGB uint8 tensor (3 x H x W):
    the pixels, limit and errors of :func:`~distribuuuu.data.datasets.\
decode_image_file`, faster for 8-bit JPEGs (see the module doc)."""
    image = read_jpeg(path)
    return ds.decode_image_file(path) if image is None else image.decode()
