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
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from distribuuuu.data import datasets as ds

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


def _fast_path(header: JpegHeader | None) -> bool:
    """True for a plain 8-bit JPEG within the pixel limit (see
    :attr:`JpegHeader.plain_8bit`)."""
    if header is None or not header.plain_8bit:
        return False
    limit = ds.max_image_pixels()
    return limit is None or header.width * header.height <= limit


def read_image_fused(path: str) -> torch.Tensor:
    """Read the image file at ``path`` as an RGB uint8 tensor (3 x H x W):
    the pixels, limit and errors of :func:`~distribuuuu.data.datasets.\
decode_image_file`, faster for 8-bit JPEGs (see the module doc).

    The tensor is a view of the decoder's height x width x 3 buffer, the
    layout the antialiased resize after it reads without a copy.
    """
    if decode_jpeg is None:
        return ds.decode_image_file(path)
    try:
        with open(path, "rb") as f:  # into the buffer the decoder reads: one copy
            data = bytearray(os.fstat(f.fileno()).st_size)
            del data[f.readinto(data) :]
    except OSError:
        return ds.decode_image_file(path)  # names the file as it always does
    if not _fast_path(jpeg_header(data)):
        return ds.decode_image_file(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            encoded = torch.frombuffer(data, dtype=torch.uint8)
            return decode_jpeg(encoded, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError):
        return ds.decode_image_file(path)  # damaged: PIL decides, as for tensor
