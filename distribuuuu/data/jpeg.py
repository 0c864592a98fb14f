"""JPEG files read straight to uint8 tensors (``DATA.DECODER fused``).

The ``tensor`` decoder opens every file with PIL first, for the pixel limit
and the errors, then hands the bytes to ``torchvision.io``.  For the common
case, an 8-bit JPEG of grey or colour pixels, :func:`read_image_fused` reads
the size from the JPEG's own frame header instead (a few microseconds of
parsing, against about 70 of PIL's ``Image.open``), checks it against the
size libjpeg-turbo's own header read gives for the same bytes (PIL's where
there is no libjpeg-turbo 3: :func:`library_size`), and decodes the buffer it
read the file into with the same libjpeg-turbo call as the ``tensor``
decoder: the same pixels.  Everything else (PNG, WebP, CMYK JPEGs, 12-bit or
lossless JPEGs, a frame header it cannot find, a size the library reads
otherwise, an image over the pixel limit, a file the decoder refuses) goes
through :func:`~distribuuuu.data.image_files.decode_image_bytes`, so the errors,
``DATA.SKIP_CORRUPT`` and the limits are those of the ``tensor`` decoder.

For training, :func:`read_or_defer` leaves such a JPEG undecoded
(:class:`JpegFile`): the crop is drawn from the header's size, and only its
window is decoded (:mod:`distribuuuu.data.turbo`), with the same pixels.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass
from typing import TypeGuard, cast

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from distribuuuu.data import image_files, turbo

try:  # deprecated in torchvision 0.29, like the decoder of image_files.py
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
# Markers without a length, which libjpeg passes over: TEM and the restart
# markers RST0-RST7.
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD8)])
# The other markers libjpeg reads before the first scan, each a segment with
# a length: DHT, DAC, DQT, DNL, DRI, APP0-APP15 and COM.  It refuses any
# marker not listed here (JPG, JPGn, DHP, EXP, reserved ones).
_SEGMENT_MARKERS = frozenset([0xC4, 0xCC, 0xDB, 0xDC, 0xDD, *range(0xE0, 0xF0), 0xFE])
# SOI, EOI and SOS: libjpeg refuses each before the frame header.
_NO_FRAME_YET = frozenset([0xD8, 0xD9, 0xDA])
_FILL_BYTES = re.compile(rb"\xff+")


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


def jpeg_header(data: bytes | bytearray) -> JpegHeader | None:
    """The frame header of the JPEG file ``data``, read without decoding it;
    None when ``data`` is not a JPEG whose frame header libjpeg would find
    before its first scan.

    The markers are found as libjpeg's ``next_marker`` finds them: after a
    segment it passes over any bytes up to the next 0xFF (extraneous data),
    any run of 0xFF (fill bytes) and any 0xFF 0x00 (stuffed data, not a
    marker), so a segment hidden behind such bytes is read here as libjpeg
    reads it.  What follows the frame header (a second one, the scan) is
    left to the library's own header read (:func:`library_size`).  Each step
    moves on and nothing is read past the end of ``data``: any input ends in
    one pass.
    """
    if data[:2] != START_OF_IMAGE:
        return None
    position = 2
    while True:
        marker, position = _next_marker(data, position)
        if marker in _STANDALONE_MARKERS:
            continue
        if marker is None or marker in _NO_FRAME_YET or position + 2 > len(data):
            return None  # cut short, another SOI, the end or a scan first
        length = int.from_bytes(data[position : position + 2], "big")
        if length < 2 or position + length > len(data):
            return None
        if marker in _FRAME_MARKERS:
            return _frame_header(marker, data[position + 2 : position + length])
        if marker not in _SEGMENT_MARKERS:
            return None  # a marker libjpeg does not know, or JPG
        position += length


def _next_marker(data: bytes | bytearray, position: int) -> tuple[int | None, int]:
    """The first marker at or after ``position``, as libjpeg's
    ``next_marker`` finds it (see :func:`jpeg_header`), and the position
    after it; None and the end of ``data`` when there is none."""
    while True:
        position = data.find(b"\xff", position) + 1
        if position == 0 or position >= len(data):
            return None, len(data)
        if data[position] == 0xFF:  # fill bytes: the last 0xFF counts
            # Matches: data[position] is 0xFF.
            position = cast(re.Match, _FILL_BYTES.match(data, position)).end()
            if position >= len(data):
                return None, len(data)
        if data[position] != 0x00:  # 0xFF 0x00 is stuffed data: go on
            return data[position], position + 1


def _frame_header(marker: int, segment: bytes | bytearray) -> JpegHeader | None:
    """The frame header in ``segment`` (after the length), or None where
    libjpeg refuses it: a zero size, no components, or a length that is not
    that of the components listed."""
    if len(segment) < 6:
        return None
    header = JpegHeader(
        height=int.from_bytes(segment[1:3], "big"),
        width=int.from_bytes(segment[3:5], "big"),
        components=segment[5],
        precision=segment[0],
        marker=marker,
    )
    exact = len(segment) == 6 + 3 * header.components
    if not exact or min(header.height, header.width, header.components) == 0:
        return None
    return header


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
        image = image_files.decode_image_bytes(
            bytes(self.data), self.name, as_tensor=True
        )
        return cast(torch.Tensor, image)

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


def _plain(header: JpegHeader | None) -> TypeGuard[JpegHeader]:
    """True for a plain 8-bit JPEG within the pixel limit (see
    :attr:`JpegHeader.plain_8bit`)."""
    if header is None or not header.plain_8bit:
        return False
    limit = image_files.max_image_pixels()
    return limit is None or header.width * header.height <= limit


def library_size(data: bytearray) -> tuple[int, int] | None:
    """(height, width) of the JPEG ``data`` as the decoding library reads its
    header: libjpeg-turbo's own header read where the window decoder has a
    library (:mod:`distribuuuu.data.turbo`), else PIL's, which the tensor
    decoder's pixel limit reads; None when it refuses the header."""
    decoder = turbo.window_decoder()
    if decoder is not None:
        return decoder.image_size(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            width, height = Image.open(io.BytesIO(data)).size
    except Exception:  # refused, damaged or a bomb: the tensor decoder decides
        return None
    return height, width


def jpeg_bytes(data: bytes | bytearray, name: str) -> JpegFile | None:
    """``data`` as a :class:`JpegFile` named ``name`` if it is a plain 8-bit
    JPEG within the pixel limit and the file size limit; None for anything
    else.

    The size parsed here must be the one the library reads from the same
    bytes (:func:`library_size`), or the file takes the tensor decoder's
    path: the crop is drawn, and the pixel limit applied, for the size that
    is decoded.
    """
    if len(data) > image_files.MAX_IMAGE_FILE_BYTES:
        return None
    header = jpeg_header(data)
    if not _plain(header):
        return None
    data = data if isinstance(data, bytearray) else bytearray(data)
    if library_size(data) != (header.height, header.width):
        return None
    return JpegFile(name, data, header)


def read_or_defer(path: str) -> JpegFile | torch.Tensor:
    """The image file at ``path`` as a :class:`JpegFile` to decode later (in
    the crop window the transform draws) if it is a plain 8-bit JPEG, or
    decoded now as :func:`~distribuuuu.data.image_files.decode_image_file`
    decodes it: the reader of DATA.DECODER fused training and of DATA.DECODER
    gpu.  The file is read once, into the buffer the decoders take; a
    DataError names it as the tensor decoder does."""
    data = image_files.read_image_bytes(path)
    image = jpeg_bytes(data, path)
    if image is None:
        decoded = image_files.decode_image_bytes(data, path, as_tensor=True)
        return cast(torch.Tensor, decoded)
    return image


def read_image_fused(path: str) -> torch.Tensor:
    """Read the image file at ``path`` as an RGB uint8 tensor (3 x H x W):
    the pixels, limit and errors of :func:`~distribuuuu.data.image_files.\
decode_image_file`, faster for 8-bit JPEGs (see the module doc)."""
    image = read_or_defer(path)
    return image.decode() if isinstance(image, JpegFile) else image


class BytesReader:
    """What decodes an encoded image of a shard (DATA.DECODER), as
    :func:`distribuuuu.data.image_reader` reads a file; in DATA.DECODER fused
    training a plain JPEG is left for the crop to decode its window, as
    :func:`read_or_defer` leaves a file.  (A class, not a closure: loader
    workers unpickle it.)"""

    def __init__(self, decoder: str, train: bool):
        self.as_tensor = decoder != "pil"  # fused and tensor decode alike
        self.defer = train and decoder == "fused"

    def __call__(self, data: bytes, name: str) -> torch.Tensor | Image.Image | JpegFile:
        image = jpeg_bytes(data, name) if self.defer else None
        if image is None:
            return image_files.decode_image_bytes(data, name, self.as_tensor)
        return image
