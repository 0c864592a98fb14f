"""Label sets from a CSV (TRAIN.LABELS_FILE, TEST.LABELS_FILE): multi-label
image folders.

A labels file is UTF-8 CSV with the header ``path,labels`` and one row per
image: its path relative to the split's folder (TRAIN.DATASET/TRAIN.SPLIT or
TEST.DATASET/TEST.SPLIT) and its class names separated by spaces.  The
classes of a run are the sorted names of the training file, and every name
of the validation file must be one of them.  A file is untrusted input: at
most :data:`MAX_LABELS_FILE_BYTES`, read without waiting on a FIFO; a path
must stay inside its split (no absolute path, no ``..``, and no link that
resolves outside it) and name an existing file, listed once, with at least one
label.  The files name the images, so no folder is walked and no folder
index (DATA.INDEX_CACHE) is read or written.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from distribuuuu.data.folder_index import is_relative
from distribuuuu.data.image_files import load_image, open_regular_file
from distribuuuu.data.packed import PackedSamples
from distribuuuu.errors import DataError

# The largest labels file read (ImageNet's 1.28 M rows take about 60 MiB).
MAX_LABELS_FILE_BYTES = 256 << 20
HEADER = ["path", "labels"]

# A labels file's rows: (path relative to the split, class names).
Rows = list[tuple[str, list[str]]]


def _read_text(path: str, key: str) -> str:
    """The text of labels file ``path``, or a DataError naming ``key``."""
    try:
        opened = open_regular_file(path)
    except OSError as error:
        raise DataError(f"{key} {path}: cannot read it ({error.strerror})") from error
    if opened is None:
        raise DataError(f"{key} {path}: not a regular file")
    with opened:
        data = opened.read(MAX_LABELS_FILE_BYTES + 1)
    if len(data) > MAX_LABELS_FILE_BYTES:
        raise DataError(f"{key} {path}: larger than {MAX_LABELS_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{key} {path}: not UTF-8 text (byte {error.start})") from error


def read_labels_file(path: str, key: str) -> Rows:
    """The rows of labels file ``path`` (module doc); a DataError naming
    ``key``, the file and the line for a malformed one."""
    lines = csv.reader(io.StringIO(_read_text(path, key), newline=""))
    rows: Rows = []
    seen: set[str] = set()
    try:
        header = next(lines, None)
        if header != HEADER:
            raise DataError(f"{key} {path}: the first line must be path,labels")
        for row in lines:
            where = f"{key} {path}: line {lines.line_num}"
            if len(row) != 2:
                raise DataError(f"{where}: {len(row)} columns, expected path,labels")
            image, names = row[0], row[1].split()
            if not is_relative(image):  # absolute, or a .. (or . or empty) part
                raise DataError(f"{where}: path {image!r} is outside the split")
            if image in seen:
                raise DataError(f"{where}: {image} is listed twice")
            if not names:
                raise DataError(f"{where}: {image} has no labels")
            seen.add(image)
            rows.append((image, names))
    except csv.Error as error:
        raise DataError(f"{key} {path}: line {lines.line_num}: {error}") from error
    if not rows:
        raise DataError(f"{key} {path}: no images listed")
    return rows


def confine(root: str, rows: Rows, key: str) -> list[str]:
    """The paths of ``rows`` under split folder ``root``; a DataError for one
    that is missing or whose links resolve outside ``root``."""
    real_root = os.path.realpath(root)
    real_folders: dict[str, str] = {}
    paths = []
    for image, _ in rows:
        path = os.path.join(root, image)
        folder, name = os.path.split(image)
        if folder not in real_folders:
            real_folders[folder] = os.path.realpath(os.path.join(root, folder))
        real = os.path.join(real_folders[folder], name)
        if os.path.islink(real):
            real = os.path.realpath(real)
        if os.path.commonpath([real_root, real]) != real_root:
            raise DataError(
                f"{key} {root}: {image} resolves to {real}, outside the split"
            )
        if not os.path.isfile(real):
            raise DataError(f"{key} {root}: no image file {image}")
        paths.append(path)
    return paths


def label_classes(rows: Rows) -> list[str]:
    """The classes of a training file's ``rows``: their sorted names."""
    return sorted({name for _, names in rows for name in names})


def check_known(rows: Rows, classes: list[str], key: str, path: str) -> None:
    """A DataError when a row of ``rows`` names a class outside ``classes``."""
    known = set(classes)
    for image, names in rows:
        unknown = sorted(set(names) - known)
        if unknown:
            raise DataError(
                f"{key} {path}: {image} has class {unknown[0]}, which the "
                "training labels file does not name"
            )


class LabelledImageFiles(Dataset):
    """The images a labels file names, each with its multi-hot float32 target
    over ``classes``; errors name ``key`` and the file (a DataError)."""

    def __init__(
        self,
        root: str,
        samples: list[tuple[str, list[int]]],
        classes: list[str],
        transform: Callable | None,
        key: str,
        loader: Callable = load_image,
    ):
        self.root, self.key, self.classes = root, key, classes
        self.transform, self.loader = transform, loader
        # Shared with the loader's workers, as CheckedImageFolder's samples:
        # the paths, and each image's classes end to end with their ends.
        self.samples = PackedSamples((path, 0) for path, _ in samples)
        ends = torch.tensor([len(labels) for _, labels in samples]).cumsum(0)
        flat = [label for _, labels in samples for label in labels]
        self.ends = ends.to(torch.int64).share_memory_()
        self.flat = torch.tensor(flat, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.samples)

    def target(self, index: int) -> torch.Tensor:
        """Sample ``index``'s multi-hot target."""
        start = int(self.ends[index - 1]) if index else 0
        target = torch.zeros(len(self.classes), dtype=torch.float32)
        target[self.flat[start : int(self.ends[index])]] = 1.0
        return target

    def label_rows(self) -> torch.Tensor:
        """Every sample's multi-hot target, ``N x classes`` float32."""
        counts = torch.diff(self.ends, prepend=self.ends.new_zeros(1))
        rows = torch.arange(len(self)).repeat_interleave(counts)
        targets = torch.zeros((len(self), len(self.classes)), dtype=torch.float32)
        targets[rows, self.flat] = 1.0
        return targets

    def __getitem__(self, index: int) -> tuple:
        path, _ = self.samples[index]
        image = self.loader(path)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.target(index)


# A split: (its folder, the config keys naming it, its labels file).
Split = tuple[str, str, str]


def split_rows(split: Split) -> tuple[Rows, list[str]]:
    """The rows of a split's labels file and their paths under its folder
    (DataErrors: :func:`read_labels_file`, :func:`confine`)."""
    root, key, labels_file = split
    file_key = "TRAIN.LABELS_FILE" if key.startswith("TRAIN") else "TEST.LABELS_FILE"
    rows = read_labels_file(labels_file, file_key)
    return rows, confine(root, rows, f"{file_key} {labels_file}: {key}")


def check_labels_files(train: Split, val: Split, num_classes: int) -> list[str]:
    """Check both labels files and the images they name; the classes.  A
    DataError when MODEL.NUM_CLASSES is not the training file's class count
    or a validation label is not one of them."""
    rows, _ = split_rows(train)
    classes = label_classes(rows)
    if len(classes) != num_classes:
        raise DataError(
            f"TRAIN.LABELS_FILE {train[2]} names {len(classes)} classes but "
            f"MODEL.NUM_CLASSES is {num_classes}; set MODEL.NUM_CLASSES "
            f"{len(classes)}"
        )
    val_rows, _ = split_rows(val)
    check_known(val_rows, classes, "TEST.LABELS_FILE", val[2])
    return classes


def labelled_dataset(
    train: Split, split: Split, transform: Callable | None, loader: Callable
) -> LabelledImageFiles:
    """The images of ``split`` (the training one or the validation one) with
    the classes of ``train``'s labels file."""
    rows, paths = split_rows(split)
    if split != train:  # the classes are the training file's
        classes = label_classes(read_labels_file(train[2], "TRAIN.LABELS_FILE"))
    else:
        classes = label_classes(rows)
    check_known(rows, classes, "TEST.LABELS_FILE", split[2])
    number = {name: label for label, name in enumerate(classes)}
    samples = [
        (path, sorted({number[name] for name in names}))
        for path, (_, names) in zip(paths, rows, strict=True)
    ]
    return LabelledImageFiles(split[0], samples, classes, transform, split[1], loader)
