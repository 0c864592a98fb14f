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

import torch

from distribuuuu.data import datasets as ds

try:  # deprecated in torchvision 0.29, like the decoder of datasets.py
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # gone: every file takes the tensor decoder's path
    decode_jpeg = None

# Frame headers (SOFn) whose pixels torchvision's libjpeg-turbo decodes to 8
# bits: baseline, extended sequential and progressive, Huffman-coded.  The
# other SOFn (lossless, arithmetic-coded) take the tensor decoder's path.
_FRAMES = (0xC0, 0xC1, 0xC2)
_ALL_FRAMES = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC}  # C4, C8, CC: not frames
# Markers without a length field: TEM and the restart markers (EOI ends below).
_STANDALONE = {0x01, *range(0xD0, 0xD8)}


def jpeg_frame(data: bytes | bytearray) -> tuple[int, int, int, int, int] | None:
    """(marker, precision, height, width, components) of the JPEG ``data``'s
    frame header; None when ``data`` is not a JPEG or its header is cut short
    or malformed before the frame.

    Walks the marker segments from the start of the file (each names its own
    length), so a damaged file ends the walk within its length.
    """
    if data[:3] != b"\xff\xd8\xff":
        return None
    position, end = 2, len(data)
    while position + 4 <= end:
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
            continue
        if marker in _STANDALONE:
            position += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or scan before a frame
            return None
        length = (data[position + 2] << 8) | data[position + 3]
        if marker in _ALL_FRAMES:
            if length < 8 or position + 10 > end:
                return None
            fields = data[position + 4 : position + 10]
            height, width = (fields[1] << 8) | fields[2], (fields[3] << 8) | fields[4]
            return marker, fields[0], height, width, fields[5]
        if length < 2:
            return None
        position += 2 + length
    return None


def _fast_path(frame: tuple[int, int, int, int, int] | None) -> bool:
    """True for an 8-bit grey or YCbCr/RGB JPEG within the pixel limit whose
    height is in its frame header (not deferred to a DNL marker)."""
    if frame is None:
        return False
    marker, precision, height, width, components = frame
    limit = ds.max_image_pixels()
    return (
        marker in _FRAMES
        and precision == 8
        and components in (1, 3)
        and height > 0
        and width > 0
        and (limit is None or width * height <= limit)
    )


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
    if not _fast_path(jpeg_frame(data)):
        return ds.decode_image_file(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            encoded = torch.frombuffer(data, dtype=torch.uint8)
            return decode_jpeg(encoded, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError):
        return ds.decode_image_file(path)  # damaged: PIL decides, as for tensor
