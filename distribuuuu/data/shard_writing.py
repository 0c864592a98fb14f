"""Writing WebDataset shards (``tools/make_shards.py``) in the layout that
:mod:`distribuuuu.data.shards` reads.

The output depends on the input only: samples in an order shuffled from a
fixed seed (shards mix the classes), tar headers with fixed times and owners,
re-encoding by Pillow with fixed settings.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from PIL import Image

from distribuuuu.data.datasets import (
    DataError,
    decode_image_bytes,
    find_image_classes,
    find_image_files,
    load_mnist5k,
)
from distribuuuu.data.shards import (
    CLASSES_FILE,
    IMAGE_SUFFIXES,
    INDEX_FILE,
    NEEDS_WEBDATASET,
)

# A source sample: a name (for messages), its label and what reads its bytes.
SourceSample = tuple[str, int, Callable[[], tuple[bytes, str]]]


@dataclass(frozen=True)
class ShardLimits:
    """When a shard is full, and how images are re-encoded."""

    samples: int = 1000  # samples a shard (0: no limit)
    bytes: int = 0  # bytes of samples a shard, tar headers included (0: no limit)
    max_side: int = 0  # re-encode images whose shorter side is longer (0: never)
    quality: int = 90  # JPEG quality of re-encoded images


def folder_source(root: str) -> tuple[list[str], list[SourceSample]]:
    """The classes and samples of an ImageFolder split ``root/<class>/<image>``
    (the labels and order of ``DATA.NAME imagefolder``)."""
    classes = find_image_classes(root, root)
    samples: list[SourceSample] = []
    for label, name in enumerate(classes):
        for path in find_image_files(os.path.join(root, name), root):
            samples.append((path, label, _file_reader(path)))
    return classes, samples


def _file_reader(path: str) -> Callable[[], tuple[bytes, str]]:
    def read() -> tuple[bytes, str]:
        with open(path, "rb") as f:
            return f.read(), os.path.splitext(path)[1].lstrip(".").lower()

    return read


def digits_source(train: bool) -> tuple[list[str], list[SourceSample]]:
    """The classes and samples of a split of the embedded digits, as PNGs."""
    images, labels = load_mnist5k(train)

    def png(image) -> Callable[[], tuple[bytes, str]]:
        def read() -> tuple[bytes, str]:
            buffer = io.BytesIO()
            Image.fromarray(image[0].numpy(), mode="L").save(buffer, format="PNG")
            return buffer.getvalue(), "png"

        return read

    samples = [
        (f"digit {i}", int(label), png(images[i])) for i, label in enumerate(labels)
    ]
    return [str(digit) for digit in range(10)], samples


def capped(data: bytes, suffix: str, name: str, limits: ShardLimits):
    """The image ``data`` with its shorter side at most ``limits.max_side``:
    unchanged when it is, else resized (Lanczos) and re-encoded as JPEG."""
    if not limits.max_side:
        return data, suffix
    try:
        width, height = Image.open(io.BytesIO(data)).size  # the header only
    except Exception:  # unreadable: kept as it is, DATA.SKIP_CORRUPT decides
        return data, suffix
    short = min(width, height)
    if short <= limits.max_side:
        return data, suffix
    image = decode_image_bytes(data, name, as_tensor=False)  # RGB, pixel limit
    scale = limits.max_side / short
    if width <= height:
        size = (limits.max_side, max(1, round(height * scale)))
    else:
        size = (max(1, round(width * scale)), limits.max_side)
    buffer = io.BytesIO()
    image.resize(size, Image.Resampling.LANCZOS).save(
        buffer, format="JPEG", quality=limits.quality
    )
    return buffer.getvalue(), "jpg"


def _tar_bytes(members: dict[str, bytes]) -> int:
    """Bytes the members take in a tar: a header and whole blocks each."""
    return sum(512 + -(-len(data) // 512) * 512 for data in members.values())


def _shard_groups(
    samples: list[tuple[int, str, int, Callable[[], tuple[bytes, str]]]],
    limits: ShardLimits,
) -> Iterator[list[tuple[str, dict[str, bytes]]]]:
    """Numbered samples as tar members, grouped into shards within ``limits``."""
    group, size = [], 0
    for number, name, label, read in samples:
        data, suffix = read()
        if suffix not in IMAGE_SUFFIXES:
            raise DataError(f"{name}: .{suffix} is not an image file name")
        data, suffix = capped(data, suffix, name, limits)
        members = {suffix: data, "cls": str(label).encode()}
        more = _tar_bytes(members)
        full = limits.samples and len(group) >= limits.samples
        if group and (full or (limits.bytes and size + more > limits.bytes)):
            yield group
            group, size = [], 0
        group.append((f"{number:08d}", members))
        size += more
    if group:
        yield group


def write_split(
    samples: list[SourceSample], out: str, split: str, limits: ShardLimits, seed: int
) -> dict[str, dict[str, int]]:
    """Write the samples of one split as ``out/<split>-000000.tar`` ...;
    the index entries of the shards written."""
    try:
        from webdataset import TarWriter
    except ImportError as error:
        raise DataError(NEEDS_WEBDATASET) from error
    order = [(number, *sample) for number, sample in enumerate(samples)]
    random.Random(seed).shuffle(order)  # keys: the numbers in the source
    entries = {}
    for number, group in enumerate(_shard_groups(order, limits)):
        name = f"{split}-{number:06d}.tar"
        path = os.path.join(out, name)
        with open(path, "wb") as f:
            writer = TarWriter(f, user="", group="", mtime=0, encoder=False)
            for key, members in group:
                writer.write({"__key__": key, **members})
            writer.close()
        entries[name] = {"samples": len(group), "bytes": os.path.getsize(path)}
    return entries


def pattern_of(out: str, split: str, shards: int) -> str:
    """The brace pattern naming the ``shards`` shards of ``split`` in ``out``."""
    last = f"{shards - 1:06d}"
    names = f"{split}-{last}.tar" if shards == 1 else f"{split}-{{000000..{last}}}.tar"
    return os.path.join(out, names)


def write_index(out: str, classes: list[str], entries: dict) -> None:
    """Write ``classes.txt`` and, last, ``index.json`` (shard -> counts)."""
    with open(os.path.join(out, CLASSES_FILE), "w", encoding="utf-8") as f:
        f.write("".join(f"{name}\n" for name in classes))
    temporary = os.path.join(out, INDEX_FILE + ".tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"shards": entries}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(temporary, os.path.join(out, INDEX_FILE))
