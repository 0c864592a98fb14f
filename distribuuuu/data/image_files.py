"""Reading and decoding one image file, or the encoded bytes of one image.

An image file is untrusted input: a data set may hold any file under an image
name, and a few bytes can cost a worker minutes or gigabytes.  So before any
pixel is decoded, :func:`read_image_bytes` refuses what is not a regular file
(a FIFO would block the reader for ever, a device or a folder is no image),
opening it without blocking, and a file larger than MAX_IMAGE_FILE_BYTES,
which is never read whole (PIL walks a JPEG's fill bytes one at a time); and
:func:`decode_image_bytes` reads the header first and refuses an image of
more than :func:`max_image_pixels` pixels (a decompression bomb).  Every
refusal, and every damaged file, is a DataError naming the file.
"""

from __future__ import annotations

import io
import os
import re
import stat
import warnings
from typing import cast

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms.v2.functional import pil_to_tensor

from distribuuuu.errors import DataError

try:  # torchvision 0.29 deprecates its image decoders in favour of TorchCodec
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # gone in a later torchvision: every file goes through PIL
    decode_image = None


# Formats that the tensor decoder hands to ``torchvision.io`` (PIL's names for
# them; MPO is a JPEG with extra pictures).  GIF goes through PIL, which reads
# its first frame only: torchvision returns every frame of an animated GIF.
_TORCHVISION_FORMATS = ("JPEG", "MPO", "PNG", "WEBP")
# PIL modes of 16-bit single-channel images (a 16-bit grey PNG opens as I;16).
_SIXTEEN_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")


def max_image_pixels() -> int | None:
    """The most pixels (width x height) an image file may have; None: no limit.

    One limit for both decoders: PIL's ``Image.MAX_IMAGE_PIXELS`` (89,478,485,
    about 9459 x 9459), read when a file is opened.  PIL itself only warns up
    to twice that; here a larger image is refused before its pixels are
    decoded, since a few hundred kilobytes of PNG can hold gigabytes of them.
    """
    return Image.MAX_IMAGE_PIXELS


# The most bytes an encoded image (a file, or a sample of a shard) may have,
# for every decoder: far above any photo within the pixel limit, yet bounded,
# since PIL walks a JPEG's fill bytes one at a time (about 0.6 s per MiB).
MAX_IMAGE_FILE_BYTES = 64 * 2**20


def _open_header(source, path: str) -> Image.Image:
    """PIL's image of ``source`` with only its header read, within the pixel limit."""
    limit = max_image_pixels()
    too_large = f"the limit of {limit} pixels for one image (a decompression bomb?)"
    try:
        with warnings.catch_warnings():
            # Between the limit and twice it PIL only warns; refused below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source)
    except Image.DecompressionBombError as error:
        # PIL refuses twice the limit itself; its message holds the pixel count.
        count = re.search(r"\((\d+) pixels\)", str(error))
        size = f"{count.group(1)} pixels" if count else "too many pixels"
        raise DataError(
            f"cannot read image {path}: {size}, more than {too_large}"
        ) from error
    width, height = image.size
    if limit is not None and width * height > limit:
        raise DataError(
            f"cannot read image {path}: {width} x {height} pixels, more than "
            + too_large
        )
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB; 16-bit grey is scaled (not clipped) to 0-255."""
    if image.mode in _SIXTEEN_BIT_MODES:
        pixels = np.asarray(image).astype(np.int64).clip(0, 65535)
        image = Image.fromarray(_sixteen_to_eight_bits(pixels).astype(np.uint8))
    return image.convert("RGB")


def _sixteen_to_eight_bits(pixels):
    """16-bit values (an int64 array or int32 tensor) as 0-255: v * 255 / 65535,
    rounded to the nearest integer."""
    return (pixels * 255 + 32767) // 65535


def _decode_with_torchvision(data: bytes | bytearray) -> torch.Tensor | None:
    """The encoded image ``data`` as an RGB uint8 tensor; None if refused."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            image = decode_image(encoded, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError):
        return None  # not a variant torchvision decodes, or damaged: PIL decides
    if image.dtype == torch.uint16:  # 16-bit PNGs
        image = _sixteen_to_eight_bits(image.to(torch.int32)).to(torch.uint8)
    return image if image.dtype == torch.uint8 and image.dim() == 3 else None


def decode_image_bytes(
    data: bytes | bytearray, name: str, as_tensor: bool
) -> Image.Image | torch.Tensor:
    """The encoded image ``data`` as RGB: a uint8 tensor (``as_tensor``) or a PIL
    image, as :func:`decode_image_file` and :func:`load_image` read a file; a
    DataError names ``name`` (the file, or a sample of a shard) when it cannot,
    or when ``data`` is larger than MAX_IMAGE_FILE_BYTES."""
    _check_file_size(len(data), name)
    try:
        image = _open_header(io.BytesIO(data), name)  # before any pixel is decoded
        if not as_tensor:
            return _to_rgb(image)
        if decode_image is not None and image.format in _TORCHVISION_FORMATS:
            decoded = _decode_with_torchvision(data)
            if decoded is not None:
                return decoded
            image = _open_header(io.BytesIO(data), name)
        return pil_to_tensor(_to_rgb(image))
    except DataError:
        raise
    except UnidentifiedImageError:
        reason = "not an image format PIL can read"
    except Exception as error:  # PIL raises many types for damaged files
        reason = f"{type(error).__name__}: {error}"
    raise DataError(f"cannot read image {name}: {reason}")


def _read_image(path: str, as_tensor: bool) -> Image.Image | torch.Tensor:
    """The image file at ``path`` as RGB (see :func:`load_image`,
    :func:`decode_image_file`); a DataError names an unreadable one."""
    return decode_image_bytes(read_image_bytes(path), path, as_tensor)


def open_regular_file(path: str) -> io.FileIO | None:
    """The file at ``path`` opened for reading, unbuffered, without blocking;
    None (and nothing left open) when it is not a regular file (a FIFO, a
    device, a folder)."""
    # A FIFO opened without O_NONBLOCK waits for a writer for ever, and no
    # signal ends the wait (SIGTERM neither, so neither does a preemption); on
    # a regular file the flag changes nothing.  O_NOCTTY: a terminal named
    # *.jpg is not made the process's own.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    descriptor = os.open(path, flags)
    try:
        regular = stat.S_ISREG(os.fstat(descriptor).st_mode)
    except OSError:
        os.close(descriptor)
        raise
    if not regular:
        os.close(descriptor)
        return None
    return os.fdopen(descriptor, "rb", buffering=0)


def _open_image_file(path: str) -> io.FileIO:
    """:func:`open_regular_file`, or a DataError naming ``path``."""
    opened = open_regular_file(path)
    if opened is None:
        raise DataError(f"cannot read image {path}: not a regular file")
    return opened


def _check_file_size(size: int, name: str) -> None:
    """Refuse an encoded image of more than MAX_IMAGE_FILE_BYTES (a DataError
    naming ``name``)."""
    if size > MAX_IMAGE_FILE_BYTES:
        raise DataError(
            f"cannot read image {name}: {size} bytes, more than the limit of "
            f"{MAX_IMAGE_FILE_BYTES} bytes for one image file "
            "(MAX_IMAGE_FILE_BYTES in distribuuuu/data/image_files.py)"
        )


def read_image_bytes(path: str) -> bytearray:
    """The bytes of the image file at ``path`` in one buffer (what the decoders
    take); a DataError names a file that cannot be read, is not a regular file
    or is larger than MAX_IMAGE_FILE_BYTES, which is never read whole."""
    try:
        with _open_image_file(path) as f:
            size = os.fstat(f.fileno()).st_size
            _check_file_size(size, path)
            data = bytearray(size + 1)  # a byte more: a file grown since fstat
            view, count = memoryview(data), 0
            while count <= size and (got := f.readinto(view[count:])):
                count += got
            view.release()
            del data[count:]
            if count > size:  # grown: read on, up to a byte past the limit
                data += f.read(MAX_IMAGE_FILE_BYTES + 1 - count)
    except OSError as error:
        raise DataError(
            f"cannot read image {path}: {type(error).__name__}: {error}"
        ) from error
    _check_file_size(len(data), path)
    return data


def load_image(path: str) -> Image.Image:
    """Read the image file at ``path`` as an RGB PIL image.

    A DataError names a file that is unreadable or has more pixels than
    :func:`max_image_pixels` (checked from its header, before decoding).
    16-bit images are scaled to 8 bits.
    """
    return cast(Image.Image, _read_image(path, as_tensor=False))


def decode_image_file(path: str) -> torch.Tensor:
    """Read the image file at ``path`` as an RGB uint8 tensor (3 x H x W).

    JPEG, PNG and WebP are decoded by ``torchvision.io`` (libjpeg-turbo
    for JPEG, as in Pillow's wheels), which hands the pixels over as a tensor
    without a PIL image in between; with the tensor transforms after it, the
    loader gives 1.2-1.7x the images per second of PIL's (``tools/benchmark.py``
    on 2 CPU cores).  Other formats, and files it refuses, go through PIL.
    PIL reads the header first in every case, so the pixel limit and the
    errors are those of :func:`load_image`; 16-bit PNGs are scaled to 8 bits.
    """
    return cast(torch.Tensor, _read_image(path, as_tensor=True))
