"""An image folder's (path, label) list packed into three shared tensors.

Loader workers start from a fork server (:mod:`.workers`), so the data set is
pickled into each of them. A list of 1.28 M (path, label) tuples pickles to
about 90 MB, for every worker of every rank, and each worker then holds its
own copy. :class:`PackedSamples` holds the same list as three tensors in
shared memory: pickled for a worker, each travels as a file descriptor, and
every worker reads the one copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import overload

import numpy as np
import torch


def _shared(array: np.ndarray) -> torch.Tensor:
    """``array`` copied into a tensor in shared memory."""
    return torch.tensor(array).share_memory_()


class PackedSamples(Sequence):
    """A read-only sequence of (path, label) pairs: the encoded paths end to
    end in one uint8 tensor, their end offsets and their labels in two int64
    tensors."""

    def __init__(self, samples: Iterable[tuple[str, int]]):
        paths, labels = [], []
        for path, label in samples:
            paths.append(os.fsencode(path))
            labels.append(label)
        text = np.frombuffer(b"".join(paths), dtype=np.uint8)
        ends = np.cumsum([len(path) for path in paths], dtype=np.int64)
        self.text = _shared(text)
        self.ends = _shared(ends)
        self.labels = _shared(np.array(labels, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, index: int | slice):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # negative indices; IndexError past the end
        ends, text = self.ends.numpy(), self.text.numpy()
        start = int(ends[index - 1]) if index else 0
        path = os.fsdecode(text[start : int(ends[index])].tobytes())
        return path, int(self.labels.numpy()[index])
