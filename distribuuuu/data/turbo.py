"""Decoding only the crop window of a JPEG: libjpeg-turbo's TurboJPEG 3 API.

A training crop of ImageNet's RandomResizedCrop covers about half of the photo
on average (scale 0.08-1).  libjpeg-turbo can decode a window of a JPEG
(``tj3SetCroppingRegion``): rows below it are not decoded at all, rows above
it and columns beside it are entropy-decoded but skip the inverse DCT, the
upsampling and the colour conversion (DALI's ``image_random_crop`` relies on
the same).  The pixels inside the window are the full decode's, except that at
a window edge inside the image the chroma upsampling has no neighbour and
repeats the edge sample.  So the window decoded is the crop widened by 2
pixels on each side (its left edge moved down to an iMCU boundary, the unit
libjpeg-turbo crops columns in), and the crop is cut out of it: bit for bit
the pixels of ``torchvision.io.decode_jpeg`` of the whole image, then the crop
(``tests/data/test_jpeg_decoder.py``, for 4:4:4, 4:2:2, 4:2:0 and grey, baseline
and progressive; other subsamplings are decoded whole).

The library is driven through ``ctypes`` (TurboJPEG's C API is small and
stable; the Python bindings on PyPI do not expose the cropping region).  It is
looked for, first to last:

- ``DISTRIBUUUU_TURBOJPEG``: a path to a libturbojpeg, or ``0`` for none;
- the library inside the ``turbojpeg`` wheel (a dependency on Linux x86-64;
  it bundles libjpeg-turbo 3.0);
- the system's ``libturbojpeg`` (``ctypes.util.find_library``).

A library counts only if it has the TurboJPEG 3 API (libjpeg-turbo 3.0 or
newer) and passes a check at load: windows of a small JPEG decoded here must
equal the same windows of ``torchvision.io.decode_jpeg``'s pixels.  Without
one (:func:`window_decoder` is None) ``DATA.DECODER fused`` decodes whole
images: the same pixels, more work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

ENVIRONMENT = "DISTRIBUUUU_TURBOJPEG"

# turbojpeg.h (libjpeg-turbo 3.0): the constants used here.
_INIT_DECOMPRESS = 1  # TJINIT_DECOMPRESS
_PIXEL_RGB = 0  # TJPF_RGB
_PARAM_STOP_ON_WARNING, _PARAM_SUBSAMP, _PARAM_WIDTH, _PARAM_HEIGHT = 0, 4, 5, 6
# The iMCU width in pixels (tjMCUWidth) of the chroma subsamplings whose
# windows are decoded, by TJSAMP value: 4:4:4, 4:2:2, 4:2:0 and grey, those
# the tests cover.  The rare others (4:4:0, 4:1:1, 4:4:1) are decoded whole.
_IMCU_WIDTH = {0: 8, 1: 16, 2: 16, 3: 8}


# Pixels decoded beyond each side of a window inside the image, for the
# chroma upsampling at its edges (see the module doc).  One column is enough
# for libjpeg-turbo's fancy upsampling (the tests pass with 1, fail with 0;
# rows need none); 2 holds for any 2:1 upsampling, at 1-2% of a crop's work.
_MARGIN = 2

# The largest decoding buffer kept for the next image (a 2364 x 2364 window).
_REUSED_BYTES = 2**24

# The last marker of a JPEG file (EOI).
END_OF_IMAGE = b"\xff\xd9"


class _Region(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("x", "y", "w", "h")]


def _candidates() -> Iterator[str]:
    """Paths of the libraries to try, first to last (see the module doc); the
    system's is looked up (``ldconfig``) only when the others fail."""
    chosen = os.environ.get(ENVIRONMENT, "")
    if chosen:
        if chosen != "0":
            yield chosen
        return
    spec = importlib.util.find_spec("turbojpeg")  # found, not imported
    if spec is not None and spec.origin:
        libs = os.path.join(os.path.dirname(spec.origin), "turbojpeg.libs")
        yield from sorted(glob.glob(os.path.join(libs, "*turbojpeg*")))
    system = ctypes.util.find_library("turbojpeg")
    if system:
        yield system


def _load(path: str) -> ctypes.CDLL | None:
    """The library at ``path`` with the TurboJPEG 3 functions typed; None if it
    cannot be loaded or is older than libjpeg-turbo 3.0."""
    handle, pointer, size = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
    number = ctypes.c_int
    try:
        lib = ctypes.CDLL(path)
        lib.tj3Init.restype = handle
        lib.tj3Init.argtypes = [number]
        lib.tj3Destroy.argtypes = [handle]
        lib.tj3Get.argtypes = [handle, number]
        lib.tj3Set.argtypes = [handle, number, number]
        lib.tj3DecompressHeader.argtypes = [handle, pointer, size]
        lib.tj3SetCroppingRegion.argtypes = [handle, _Region]
        lib.tj3Decompress8.argtypes = [handle, pointer, size, pointer, number, number]
    except (OSError, AttributeError):  # not a library, or no TurboJPEG 3 API
        return None
    return lib


class WindowDecoder:
    """One loaded libturbojpeg, a decompressor per thread."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        self._local = threading.local()

    def _handle(self) -> int:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self.lib.tj3Init(_INIT_DECOMPRESS)
            if not handle:
                raise MemoryError("tj3Init failed")
            # A warning (damaged data) fails the call: the caller's slow path,
            # the tensor decoder's, decides what such a file gives.
            self.lib.tj3Set(handle, _PARAM_STOP_ON_WARNING, 1)
            self._local.handle = handle
        return handle

    def _buffer(self, size: int) -> torch.Tensor:
        """A decoding buffer of ``size`` bytes: this thread's, reused, since the
        window is copied out of it (no allocation per image), up to 16 MiB;
        a new one above, so that one huge image leaves no huge buffer."""
        if size > _REUSED_BYTES:
            return torch.empty(size, dtype=torch.uint8)
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._local.buffer = torch.empty(size, dtype=torch.uint8)
        return buffer[:size]

    def _refused(self) -> None:
        """Destroy this thread's decompressor after the library refused a file
        (libjpeg-turbo 3.0's refuses every later file then: tested)."""
        self.lib.tj3Destroy(self._local.handle)
        self._local.handle = None

    def image_size(self, data: bytearray) -> tuple[int, int] | None:
        """(height, width) of the JPEG ``data`` as libjpeg-turbo reads its
        header; None when it refuses the header or warns."""
        lib, handle = self.lib, self._handle()
        source = ctypes.addressof(ctypes.c_char.from_buffer(data))  # no copy
        if lib.tj3DecompressHeader(handle, source, len(data)) != 0:
            self._refused()
            return None
        return lib.tj3Get(handle, _PARAM_HEIGHT), lib.tj3Get(handle, _PARAM_WIDTH)

    def decode(
        self, data: bytearray, top: int, left: int, height: int, width: int
    ) -> torch.Tensor | None:
        """The ``height`` x ``width`` window at (``top``, ``left``) of the JPEG
        ``data`` as an RGB uint8 tensor (3 x height x width, a view of a
        packed height x width x 3 buffer); None when libjpeg-turbo refuses the
        file or warns, or when ``data`` does not end with EOI (damaged data:
        the caller decodes it the slow way, which decides), for a subsampling
        not listed, or when the window is not inside the image."""
        # libjpeg-turbo reads no further than the window's last row, so a
        # file cut below it would decode without a warning, where the whole
        # decode refuses it.  A file with bytes after its EOI, which every
        # decoder takes, is decoded whole too: the same pixels, more work.
        if not data.endswith(END_OF_IMAGE):
            return None
        lib, handle = self.lib, self._handle()
        source = ctypes.addressof(ctypes.c_char.from_buffer(data))  # no copy
        if lib.tj3DecompressHeader(handle, source, len(data)) != 0:
            self._refused()
            return None
        subsampling = lib.tj3Get(handle, _PARAM_SUBSAMP)
        rows = lib.tj3Get(handle, _PARAM_HEIGHT)
        columns = lib.tj3Get(handle, _PARAM_WIDTH)
        inside = min(top, left) >= 0 and min(height, width) > 0
        inside = inside and top + height <= rows and left + width <= columns
        if subsampling not in _IMCU_WIDTH or not inside:
            return None
        unit = _IMCU_WIDTH[subsampling]  # the window's left edge is on an iMCU
        x0 = max(0, left - _MARGIN) // unit * unit
        x1 = min(columns, left + width + _MARGIN)
        y0, y1 = max(0, top - _MARGIN), min(rows, top + height + _MARGIN)
        if lib.tj3SetCroppingRegion(handle, _Region(x0, y0, x1 - x0, y1 - y0)) != 0:
            self._refused()
            return None
        out = self._buffer((y1 - y0) * (x1 - x0) * 3).view(y1 - y0, x1 - x0, 3)
        pitch = 3 * (x1 - x0)
        status = lib.tj3Decompress8(
            handle, source, len(data), out.data_ptr(), pitch, _PIXEL_RGB
        )
        if status != 0:
            self._refused()
            return None
        window = out[top - y0 : top - y0 + height, left - x0 : left - x0 + width]
        # Copied out of the reused buffer, always (contiguous() would return
        # the buffer itself for a window that fills it), packed for the resize
        # (see pack_channels).
        packed = torch.empty((height, width, 3), dtype=torch.uint8)
        return packed.copy_(window).permute(2, 0, 1)


def _self_check(decoder: WindowDecoder) -> bool:
    """True if ``decoder`` gives torchvision's pixels for windows of a small
    4:2:0 JPEG (the library is the right one and its constants are these)."""
    import warnings

    from torchvision.io import decode_jpeg, encode_jpeg

    generator = torch.Generator().manual_seed(0)
    coarse = torch.rand((1, 3, 12, 10), generator=generator) * 255
    smooth = torch.nn.functional.interpolate(coarse, (60, 52), mode="bilinear")
    image = smooth[0].to(torch.uint8)
    with warnings.catch_warnings():  # deprecated in torchvision 0.29
        warnings.simplefilter("ignore", DeprecationWarning)
        encoded = encode_jpeg(image, quality=90)
        full = decode_jpeg(encoded)
    data = bytearray(encoded.numpy().tobytes())
    for top, left, height, width in ((0, 0, 60, 52), (17, 19, 23, 21), (40, 3, 20, 49)):
        window = decoder.decode(data, top, left, height, width)
        expected = full[:, top : top + height, left : left + width]
        if window is None or not torch.equal(window, expected):
            return False
    return True


def find_decoder() -> WindowDecoder | None:
    """The first library of :func:`_candidates` with the TurboJPEG 3 API that
    passes :func:`_self_check`, or None."""
    for path in _candidates():
        lib = _load(path)
        if lib is not None:
            decoder = WindowDecoder(lib, path)
            if _self_check(decoder):
                return decoder
        logger.debug("libturbojpeg at %s is not usable", path)
    return None


_decoder: WindowDecoder | None = None
_searched = False
_lock = threading.Lock()


def window_decoder() -> WindowDecoder | None:
    """The process's window decoder (:func:`find_decoder`, on first use; the
    lock only then, not for every image)."""
    global _decoder, _searched
    if _searched:
        return _decoder
    with _lock:
        if not _searched:
            _decoder = find_decoder()
            _searched = True  # after _decoder: a reader without the lock
        return _decoder
