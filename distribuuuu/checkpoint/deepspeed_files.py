"""DeepSpeed's checkpoint folder beside one of ours, read without running code.

DeepSpeed loads its files with ``torch.load(weights_only=False)``
(``TorchCheckpointEngine.load`` in DeepSpeed 0.19), which would run whatever a
crafted file pickles.  Two defences, each enough alone:

- :func:`weights_only_loads` makes every ``torch.load`` DeepSpeed makes while
  it resumes weights-only (torch's documented ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
  switch), with the four small classes DeepSpeed pickles allowed by exact
  name.  It reaches every load of DeepSpeed's, whichever function makes it,
  without replacing any of DeepSpeed's code.
- :func:`check_deepspeed_files`, in pre-flight and when choosing the
  checkpoint to resume, refuses a folder before DeepSpeed reads it (exit 2,
  nothing written): a file whose zip layout two readers could read
  differently (:func:`check_zip_layout`), or whose pickle, read through
  torch's own zip reader (exactly the bytes ``torch.load`` unpickles), names
  anything but the exact ``(module, name)`` pairs DeepSpeed's files hold
  (measured on the files of ZeRO stages 1-3, with offload, fp32 and bf16).
  Nothing it builds is kept, and DeepSpeed need not be installed to check.

Python's ``zipfile`` once checked the pickle here: it finds the central
directory where the end record stands, and shifts every offset by the bytes
in between, where torch's reader (miniz) takes the offsets as written; one file
then showed each a different ``data.pkl``.  The layout check therefore accepts
only what ``torch.save`` writes, where every byte belongs to exactly one part.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import re
import struct
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from distribuuuu.checkpoint.files import DEEPSPEED_SUFFIX, DEEPSPEED_TAG, refused
from distribuuuu.checkpoint.format import deepspeed_folder_name
from distribuuuu.errors import ZipLayoutError

# The files DeepSpeed writes into a checkpoint's tag folder.
_DEEPSPEED_FILE = re.compile(
    r"^(bf16_)?(zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt$"
)
# The largest pickle part of one file (the tensors are stored beside it).
_MAX_PICKLE_BYTES = 64 << 20
# The largest central directory (one entry of ~60 bytes per tensor).
_MAX_DIRECTORY_BYTES = 64 << 20

# Globals built as themselves: plain containers, sizes and dtypes.
_REAL: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): torch.Size,
}
_REAL |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
# DeepSpeed's own classes in its files: the loss scaler, the ZeRO stage and
# the addresses of the fp32 fragments.
_DEEPSPEED_CLASSES = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
}
# Globals only named (torch's tensor rebuilding, DeepSpeed's small classes):
# stood in for by a stub, since the objects are never used.
_NAMED = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Tensor"),
    *_DEEPSPEED_CLASSES,
} | {("torch", n) for n in dir(torch) if n.endswith("Storage")}


class _Stub:
    """Stands in for a named global: takes any arguments and state."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass


class _ForbiddenGlobalError(pickle.UnpicklingError):
    pass


class _DeepSpeedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _REAL:
            return _REAL[(module, name)]
        if (module, name) in _NAMED:
            return _Stub
        raise _ForbiddenGlobalError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> None:
        return None  # a tensor's storage: not read


def deepspeed_folder(path: str, state: dict) -> str:
    """The DeepSpeed folder that checkpoint ``path`` (``state``) names, beside it."""
    from distribuuuu.checkpoint.shards import folder_beside  # imports DCP

    return folder_beside(path, deepspeed_folder_name(state), DEEPSPEED_SUFFIX)


# --- the zip layout ------------------------------------------------------- #
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header, before name and extra
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory entry
_CentralHeader = namedtuple(
    "_CentralHeader",
    "sig made_by needed flags method time date crc packed size name_length "
    "extra_length comment_length disk internal external offset",
)
_END = struct.Struct("<4s4H2LH")  # end of central directory record
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_MAX16, _MAX32 = 0xFFFF, 0xFFFFFFFF  # "see the zip64 record / extra field"
# Flags torch.save sets: sizes in a data descriptor (3), UTF-8 names (11).
_KNOWN_FLAGS = 1 << 3 | 1 << 11
# The lengths a data descriptor can have: with or without its signature,
# 4- or 8-byte sizes.
_DESCRIPTOR_LENGTHS = {12: "<3L", 16: "<4x3L", 20: "<L2Q", 24: "<4xL2Q"}


@dataclass
class _Entry:
    name: bytes
    flags: int
    method: int
    crc: int
    size: int  # stored: compressed and uncompressed alike
    offset: int  # of its local header


def _read_at(file: BinaryIO, offset: int, size: int) -> bytes:
    file.seek(offset)
    data = file.read(size)
    if len(data) != size:
        raise ZipLayoutError(f"it ends inside a record at byte {offset}")
    return data


def _directory_bounds(file: BinaryIO) -> tuple[int, int, int]:
    """(entries, start, end) of the central directory, from the end record and
    the zip64 records (which torch.save always writes) between the two."""
    file_size = file.seek(0, os.SEEK_END)
    end_at = file_size - _END.size
    if end_at < 0:
        raise ZipLayoutError("it is too short for a zip")
    sig, disk, start_disk, here, count, size, start, comment = _END.unpack(
        _read_at(file, end_at, _END.size)
    )
    if sig != b"PK\x05\x06" or comment:
        raise ZipLayoutError("it does not end with a zip's end record")
    if disk or start_disk or here != count:
        raise ZipLayoutError("it spans several disks")
    directory_end = end_at
    locator_at = end_at - _ZIP64_LOCATOR.size
    if locator_at >= 0:
        sig, disk, record_at, disks = _ZIP64_LOCATOR.unpack(
            _read_at(file, locator_at, _ZIP64_LOCATOR.size)
        )
        if sig == b"PK\x06\x07":
            values = (count, size, start)
            count, size, start = _zip64_end(file, record_at, locator_at, values)
            if disk or disks != 1:
                raise ZipLayoutError("it spans several disks")
            directory_end = record_at
    if start + size != directory_end:
        raise ZipLayoutError(
            f"its central directory does not end where its end record stands "
            f"(byte {start + size}, not {directory_end})"
        )
    return count, start, directory_end


def _zip64_end(
    file: BinaryIO, record_at: int, locator_at: int, values: tuple[int, int, int]
) -> tuple[int, int, int]:
    """(entries, size, start) of the central directory from the zip64 end
    record at ``record_at``, which must end where the locator begins and agree
    with the values of the end record that are not placeholders."""
    sig, rest, _, _, disk, start_disk, here, count, size, start = _ZIP64_END.unpack(
        _read_at(file, record_at, _ZIP64_END.size)
    )
    if sig != b"PK\x06\x06" or record_at + 12 + rest != locator_at:
        raise ZipLayoutError("its zip64 end record is not where its locator says")
    if disk or start_disk or here != count:
        raise ZipLayoutError("it spans several disks")
    for short, full, placeholder in zip(
        values, (count, size, start), (_MAX16, _MAX32, _MAX32)
    ):
        if short not in (placeholder, full):
            raise ZipLayoutError("its end record and zip64 end record disagree")
    return count, size, start


def _zip64_fields(extra: bytes, wanted: int) -> list[int]:
    """The first ``wanted`` 8-byte values of the zip64 field of ``extra``."""
    fields = {}
    at = 0
    while at + 4 <= len(extra):
        kind, length = struct.unpack_from("<2H", extra, at)
        if kind in fields:
            raise ZipLayoutError(f"an entry has two extra fields of kind {kind}")
        fields[kind] = extra[at + 4 : at + 4 + length]
        at += 4 + length
    if at != len(extra):
        raise ZipLayoutError("an entry's extra fields are torn")
    data = fields.get(1, b"")
    if len(data) < 8 * wanted:
        raise ZipLayoutError("an entry lacks the zip64 sizes it announces")
    return list(struct.unpack_from(f"<{wanted}Q", data))


def _central_entry(directory: bytes, at: int) -> tuple[_Entry, int]:
    """The entry of the central directory at byte ``at``, and where the next starts."""
    if at + _CENTRAL.size > len(directory):
        raise ZipLayoutError("its central directory holds fewer entries than it says")
    header = _CentralHeader._make(_CENTRAL.unpack_from(directory, at))
    at += _CENTRAL.size
    name_end = at + header.name_length
    name = directory[at:name_end]
    extra = directory[name_end : name_end + header.extra_length]
    at += header.name_length + header.extra_length + header.comment_length
    if header.sig != b"PK\x01\x02" or at > len(directory):
        raise ZipLayoutError("its central directory is torn")
    sizes = [header.size, header.packed, header.offset]
    wide = [i for i, value in enumerate(sizes) if value == _MAX32]
    for i, value in zip(wide, _zip64_fields(extra, len(wide))):
        sizes[i] = value
    size, packed, offset = sizes
    flags, method = header.flags, header.method
    if method != 0 or packed != size or flags & ~_KNOWN_FLAGS or header.disk:
        raise ZipLayoutError(f"entry {name!r} is not stored as torch.save stores")
    entry = _Entry(
        name=name,
        flags=flags,
        method=method,
        crc=header.crc,
        size=size,
        offset=offset,
    )
    return entry, at


def _central_entries(file: BinaryIO, count: int, start: int, end: int) -> list[_Entry]:
    """The ``count`` entries of the central directory from ``start`` to ``end``."""
    if end - start > _MAX_DIRECTORY_BYTES:
        raise ZipLayoutError(
            f"its central directory is over {_MAX_DIRECTORY_BYTES >> 20} MiB"
        )
    directory = _read_at(file, start, end - start)
    entries, at = [], 0
    for _ in range(count):
        entry, at = _central_entry(directory, at)
        entries.append(entry)
    if at != len(directory):
        raise ZipLayoutError("its central directory holds more than its entries")
    return entries


def _check_unique(entries: list[_Entry]) -> None:
    """Refuse a name given twice, also in another case (which a reader that
    ignores case, as miniz may, would confuse)."""
    seen = set()
    for entry in entries:
        if entry.name.lower() in seen:
            raise ZipLayoutError(f"it names entry {entry.name!r} twice")
        seen.add(entry.name.lower())


def _check_entry(file: BinaryIO, entry: _Entry, boundary: int) -> None:
    """Check that ``entry`` (its local header, data and data descriptor) ends
    at ``boundary``, where the next part starts, and that its local header
    repeats the central directory's name, method and flags."""
    header = _read_at(file, entry.offset, _LOCAL.size)
    sig, _, flags, method, _, _, crc, _, _, name_length, extra_length = _LOCAL.unpack(
        header
    )
    name = _read_at(file, entry.offset + _LOCAL.size, name_length)
    if sig != b"PK\x03\x04":
        raise ZipLayoutError(f"no local header where entry {entry.name!r} starts")
    if (name, flags, method) != (entry.name, entry.flags, entry.method):
        raise ZipLayoutError(
            f"the local header of entry {entry.name!r} says otherwise ({name!r})"
        )
    data_end = entry.offset + _LOCAL.size + name_length + extra_length + entry.size
    gap = boundary - data_end
    if gap < 0:
        raise ZipLayoutError(f"entry {entry.name!r} overlaps the part after it")
    if not flags & 1 << 3:  # no data descriptor
        if gap:
            raise ZipLayoutError(f"bytes after entry {entry.name!r} belong to none")
        if crc != entry.crc:
            raise ZipLayoutError(f"the local header of entry {entry.name!r} disagrees")
        return
    if gap not in _DESCRIPTOR_LENGTHS:
        raise ZipLayoutError(f"bytes after entry {entry.name!r} belong to none")
    descriptor = _read_at(file, data_end, gap)
    signed = descriptor.startswith(b"PK\x07\x08")
    values = struct.unpack(_DESCRIPTOR_LENGTHS[gap], descriptor)
    if signed != (gap in (16, 24)) or values != (entry.crc, entry.size, entry.size):
        raise ZipLayoutError(f"the data descriptor of entry {entry.name!r} disagrees")


def check_zip_layout(file: BinaryIO) -> None:
    """ZipLayoutError unless ``file`` is laid out as ``torch.save`` writes:
    its entries, stored, one after the other from byte 0, each name once, then
    the central directory, the zip64 records and the end record, no byte
    belonging to two parts or to none (what readers place differently)."""
    count, start, directory_end = _directory_bounds(file)
    entries = sorted(
        _central_entries(file, count, start, directory_end), key=lambda e: e.offset
    )
    _check_unique(entries)
    if (entries[0].offset if entries else start) != 0:
        raise ZipLayoutError("bytes before its first entry belong to none")
    for i, entry in enumerate(entries):
        boundary = entries[i + 1].offset if i + 1 < len(entries) else start
        _check_entry(file, entry, boundary)


def torch_pickle_of(file: BinaryIO) -> bytes:
    """The pickle ``torch.load`` unpickles from ``file``: its ``data.pkl``
    record, read by the zip reader torch.load opens
    (``torch.serialization._open_zipfile_reader``)."""
    file.seek(0)
    reader = torch._C.PyTorchFileReader(file)
    if "constants.pkl" in reader.get_all_records():
        raise ZipLayoutError("it is a TorchScript archive, which torch.load would run")
    pickled = None
    if hasattr(reader, "get_record_size"):
        size = reader.get_record_size("data.pkl")
    else:  # torch 2.11 tells no size before reading (at most the file's)
        pickled = reader.get_record("data.pkl")
        size = len(pickled)
    if size > _MAX_PICKLE_BYTES:
        raise ZipLayoutError(f"its pickle is over {_MAX_PICKLE_BYTES >> 20} MiB")
    return reader.get_record("data.pkl") if pickled is None else pickled


def _check_file(path: str) -> None:
    """Refuse one of DeepSpeed's files (RefusedCheckpointError)."""
    try:
        with open(path, "rb") as file:
            check_zip_layout(file)
            pickled = torch_pickle_of(file)
        _DeepSpeedUnpickler(io.BytesIO(pickled)).load()
    except ZipLayoutError as error:
        raise refused(f"{path} is not a file torch.save wrote: {error}") from None
    except _ForbiddenGlobalError as error:
        raise refused(
            f"{path} holds pickled code or objects ({error}), which are never loaded"
        ) from None
    except Exception as error:  # noqa: BLE001 - whatever a crafted file does
        raise refused(f"{path} is not a file torch.save wrote ({error})") from None


def check_deepspeed_files(folder: str) -> None:
    """Refuse (RefusedCheckpointError) a DeepSpeed checkpoint folder whose tag
    folder holds a file DeepSpeed does not write, one laid out otherwise than
    torch.save lays out its files, or one that pickles code or other objects."""
    directory = os.path.join(folder, DEEPSPEED_TAG)
    if not os.path.isdir(directory) or os.path.islink(directory):
        raise refused(f"{folder}: no {DEEPSPEED_TAG} folder of DeepSpeed's files")
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not _DEEPSPEED_FILE.match(name) or not os.path.isfile(path):
            raise refused(f"{directory}: {name} is not a file DeepSpeed writes")
        _check_file(path)


# --- DeepSpeed's own loads, weights-only ----------------------------------- #
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NOT_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def deepspeed_classes() -> list[type]:
    """DeepSpeed's classes that its checkpoint files pickle (imports DeepSpeed)."""
    return [
        getattr(importlib.import_module(module), name)
        for module, name in sorted(_DEEPSPEED_CLASSES)
    ]


def _global_in(error: Exception) -> str:
    """What torch's weights-only unpickler refused, as its message names it."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found:
        return found.group(1)
    # Its message: a paragraph on weights_only, then the reason, then a link.
    paragraphs = [p.strip() for p in str(error).split("\n\n") if p.strip()]
    return paragraphs[min(1, len(paragraphs) - 1)][:200] if paragraphs else "?"


@contextlib.contextmanager
def weights_only_loads(folder: str) -> Iterator[None]:
    """Every ``torch.load`` inside is weights-only, whatever it asks, with
    DeepSpeed's classes allowed beside torch's; a file that pickles anything
    else raises RefusedCheckpointError naming ``folder``.

    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` is read by each ``torch.load`` call; its
    opposite, which torch refuses beside it, is taken out meanwhile.
    """
    saved = {
        key: os.environ.pop(key, None)
        for key in (_FORCE_WEIGHTS_ONLY, _FORCE_NOT_WEIGHTS_ONLY)
    }
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        # torch types its argument as an (invariant) list of callables or
        # (callable, name) pairs: a list of classes is one.
        with torch.serialization.safe_globals(deepspeed_classes()):  # type: ignore[arg-type]
            yield
    except pickle.UnpicklingError as error:
        raise refused(
            f"{folder} holds pickled code or objects ({_global_in(error)}), which "
            "are never loaded"
        ) from None
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
