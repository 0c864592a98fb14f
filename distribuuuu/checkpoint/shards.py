"""Sharded checkpoints (DCP folders), written by every rank and read safely.

DCP itself unpickles its ``.metadata`` and the non-tensor items of its shards
with ``pickle`` and ``weights_only=False``; we never let it:
:class:`SafeShardReader` reads the metadata with an unpickler that builds
exact ``(module, name)`` pairs of DCP's metadata classes only and checks every
entry against the files on disk, and :class:`SafeLoadPlanner` loads non-tensor
items weights-only.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import FLATTEN_MAPPING
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    STATE_DICT_TYPE,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from distribuuuu.checkpoint.files import (
    CHECKPOINT_DIR,
    SHARDED_SUFFIX,
    error_summary,
    refused,
    sharded_dir,
)
from distribuuuu.checkpoint.format import shards_folder
from distribuuuu.dist import group as du
from distribuuuu.errors import DamagedCheckpointError, RefusedCheckpointError
from distribuuuu.fileio import fsync_dir, raise_if_disk_full


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_manifest(directory: str, group: Any = None) -> dict[str, list]:
    """``{file: [size, sha256]}`` of a DCP directory; a collective (over
    ``group``, a group of every process, when given).

    Every rank hashes a share of the files, so the cost is spread.
    """
    names = du.broadcast_object(sorted(os.listdir(directory)), group=group)
    rank, world = du.get_rank(), du.get_world_size()
    mine = {}
    for name in names[rank::world]:
        path = os.path.join(directory, name)
        mine[name] = [os.path.getsize(path), _sha256(path)]
    manifest: dict[str, list] = {}
    for part in du.all_gather_object(mine, group):
        manifest.update(part)
    return manifest


def save_folder(
    out_dir: str, name: str, suffix: str, write: Callable[[str], None], inner=""
) -> tuple[str, dict]:
    """Every rank writes its part of checkpoint ``name``'s folder (``suffix``)
    with ``write(folder)``; the folder's name and the manifest of its files.

    A collective.  The files go to a temporary folder that rank 0 renames into
    place once every rank has written and synced its files, so a folder under
    its final name is always complete.  The manifest holds the size and
    SHA-256 of every file in its sub-folder ``inner``, checked before resuming.
    When ``write`` fails, rank 0 removes the temporary folder and a full disk
    raises DiskFullError naming the folder; the checkpoints saved before stay
    as they were.
    """
    folder = FolderSave.prepare(out_dir, name, suffix)
    try:
        write(folder.tmp)
    except Exception as error:
        folder.fail(error)
    return folder.complete(inner)


@dataclass(frozen=True)
class FolderSave:
    """The folder of a checkpoint while every rank writes its part: written
    under ``tmp``, renamed to ``final`` by rank 0 once complete."""

    directory: str  # OUT_DIR/checkpoints
    final: str
    tmp: str

    @classmethod
    def prepare(cls, out_dir: str, name: str, suffix: str) -> FolderSave:
        """Rank 0 makes the empty temporary folder; a collective (over the
        default group) that returns once it is there."""
        directory = os.path.join(out_dir, CHECKPOINT_DIR)
        final = sharded_dir(os.path.join(directory, name), suffix)
        folder = cls(directory, final, final + ".tmp")
        if du.is_main_process():
            shutil.rmtree(folder.tmp, ignore_errors=True)
            os.makedirs(folder.tmp)
        du.barrier()
        return folder

    def fail(self, error: BaseException) -> NoReturn:
        """Raise ``error`` of this rank's write; rank 0 removes the half-written
        folder, which would only hold the space a next save needs."""
        if du.is_main_process():
            shutil.rmtree(self.tmp, ignore_errors=True)
        raise_if_disk_full(error, self.directory, self.final)
        raise error

    def complete(self, inner: str = "", group: Any = None) -> tuple[str, dict]:
        """Once every rank has written its files: their manifest, and the
        folder renamed into place by rank 0 (its name and the manifest).  A
        collective over ``group`` (a group of every process; None: the
        default one)."""
        du.barrier(group)
        manifest = shard_manifest(os.path.join(self.tmp, inner), group)
        if du.is_main_process():
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.tmp, self.final)
            fsync_dir(self.directory)
        du.barrier(group)
        return os.path.basename(self.final), manifest


def save_sharded(out_dir: str, name: str, state: dict) -> tuple[str, dict]:
    """Every rank writes its shards of ``state`` with DCP (which fsyncs each
    file) into the ``.dcp`` folder of checkpoint ``name``; its name and
    manifest (see :func:`save_folder`)."""

    def write(folder: str) -> None:
        try:
            dcp.save(state, checkpoint_id=folder)
        except CheckpointException as error:  # the same one on every rank
            raise save_failure(error, folder) from error

    return save_folder(out_dir, name, SHARDED_SUFFIX, write)


def save_failure(error: CheckpointException, folder: str) -> Exception:
    """The error of the first rank whose part of DCP's save failed: DCP wraps
    it in a CheckpointException, a BaseException that ``except Exception``
    (and so the one ``error:`` line of the tools) would miss."""
    rank = min(error.failures)
    failure, _ = error.failures[rank]
    if isinstance(failure, Exception):
        return failure
    return RuntimeError(
        f"rank {rank} failed to save its shards in {folder}: {error_summary(failure)}"
    )


# The exact globals a DCP .metadata pickle builds (measured on torch 2.14's
# files): DCP's metadata classes, torch.Size, layouts, dtypes and paths.  A
# name is matched whole: pickle protocol 4 resolves dotted names through
# attributes, so a prefix or module match would reach anything.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, cls.__name__)
        for cls in (
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
        )
    }
    | {
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
    | {("torch", name) for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
)
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class _ForbiddenGlobalError(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses any other global."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _METADATA_GLOBALS:
            raise _ForbiddenGlobalError(f"{module}.{name}")
        return super().find_class(module, name)


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(n >= 0 for n in value)


def _check_metadata(directory: str, metadata: Any) -> None:
    """Refuse metadata of the wrong shape or naming files outside ``directory``;
    call it damaged when the files are shorter than it says."""
    path = os.path.join(directory, ".metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not (
        isinstance(metadata, Metadata)
        and isinstance(entries, dict)
        and isinstance(storage, dict)
    ):
        raise refused(f"{path}: not DCP checkpoint metadata")
    declared = _declared_bytes(path, entries)
    sizes = _shard_file_sizes(directory, path, storage)
    # Tensors are stored whole in the shard files: metadata that declares more
    # bytes than those hold would only make the reader allocate them.
    if declared > sum(sizes.values()):
        raise refused(
            f"{path}: declares {declared} bytes of tensors in "
            f"{sum(sizes.values())} bytes of shards"
        )


def _declared_bytes(path: str, entries: dict) -> int:
    """The bytes of the tensors the metadata ``entries`` declare; refuse
    entries of the wrong shape."""
    declared = 0
    for key, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = getattr(entry.properties, "dtype", None)
            chunks = entry.chunks
            if not (
                isinstance(dtype, torch.dtype)
                and _is_size(entry.size)
                and isinstance(chunks, list)
                and all(
                    isinstance(c, ChunkStorageMetadata)
                    and _is_size(c.offsets)
                    and _is_size(c.sizes)
                    for c in chunks
                )
            ):
                raise refused(f"{path}: malformed entry {key!r}")
            declared += math.prod(entry.size) * dtype.itemsize
        elif not isinstance(entry, BytesStorageMetadata):
            raise refused(f"{path}: malformed entry {key!r}")
    return declared


def _shard_file_sizes(directory: str, path: str, storage: dict) -> dict[str, int]:
    """The size of each shard file the metadata's ``storage`` entries name;
    refuse names outside ``directory``, call short files damaged."""
    sizes: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (
            isinstance(info, _StorageInfo)
            and isinstance(name, str)
            and _SHARD_FILE.match(name)
        ):
            raise refused(f"{path}: names a file outside its directory")
        if name not in sizes:
            try:
                sizes[name] = os.path.getsize(os.path.join(directory, name))
            except OSError:
                raise DamagedCheckpointError(
                    f"{directory}: {name} is missing"
                ) from None
        offset, length = info.offset, info.length
        if (
            not (isinstance(offset, int) and isinstance(length, int))
            or min(offset, length) < 0
        ):
            raise refused(f"{path}: malformed storage entry for {name}")
        if offset + length > sizes[name]:
            raise DamagedCheckpointError(
                f"{directory}: {name} is shorter than its metadata says (truncated?)"
            )
    return sizes


def read_dcp_metadata(directory: str) -> Metadata:
    """The checked metadata of DCP directory ``directory``.

    Raises RefusedCheckpointError for a file that is not DCP's metadata (a global
    other than DCP's own, a file outside the directory) and DamagedCheckpointError
    for one that is incomplete.
    """
    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DamagedCheckpointError(
            f"{directory}: no DCP .metadata (incomplete?)"
        ) from None
    except _ForbiddenGlobalError as error:
        raise refused(
            f"{path}: it would build {error}, which DCP checkpoint metadata never holds"
        ) from None
    except Exception as error:  # truncated or garbled: pickle raises many types
        raise DamagedCheckpointError(
            f"{path}: unreadable ({type(error).__name__}: {error})"
        ) from None
    _check_metadata(directory, metadata)
    return metadata


class SafeShardReader(FileSystemReader):
    """DCP's file reader, with the metadata read by :func:`read_dcp_metadata`.

    Read when the reader is made, so that a refused or damaged file raises our
    error here, before DCP (which logs a traceback for a failed metadata read
    and raises an AssertionError of its own) is involved.
    """

    def __init__(self, directory: str):
        super().__init__(directory)
        self.metadata = read_dcp_metadata(directory)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """Loads the non-tensor items of a DCP checkpoint weights-only.

    DCP's own ``DefaultLoadPlanner.load_bytes`` unpickles them with
    ``weights_only=False``; this one loads them weights-only and places them
    as it does (into the nested state when DCP flattened it).
    """

    # The state of the DCP planner this is mixed into (DefaultLoadPlanner's).
    flatten_state_dict: bool
    original_state_dict: STATE_DICT_TYPE
    mappings: FLATTEN_MAPPING
    state_dict: STATE_DICT_TYPE

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            item = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            if "GLOBAL" not in str(error):
                raise DamagedCheckpointError(f"shard item {name} is garbled") from None
            raise refused(
                f"shard item {name} holds pickled code or objects, which "
                f"weights-only loading never runs ({error_summary(error)})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[name], item)
        else:
            self.state_dict[name] = item


def _unwrap(error: CheckpointException, directory: str) -> ValueError:
    """Our own error inside DCP's CheckpointException (a BaseException, which
    ``except Exception`` would miss), or a DamagedCheckpointError."""
    for failure, _ in error.failures.values():
        if isinstance(failure, RefusedCheckpointError | DamagedCheckpointError):
            failure.args = (f"{directory}: {failure}",)
            return failure
    return DamagedCheckpointError(f"{directory}: {error_summary(error)}")


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor items weights-only."""


class _SafeWholeLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Builds the whole state from the metadata, non-tensor items weights-only."""


def load_shards(state: dict, directory: str) -> None:
    """``dcp.load`` of ``state`` from ``directory`` (a collective), safely."""
    try:
        dcp.load(
            state,
            storage_reader=SafeShardReader(directory),
            planner=SafeLoadPlanner(),
        )
    except CheckpointException as error:
        raise _unwrap(error, directory) from None


def read_sharded(directory: str) -> dict:
    """A DCP checkpoint read whole into this process (no process group used)."""
    return _read_whole(SafeShardReader(directory))


def _read_whole(reader: SafeShardReader, keys: set[str] | None = None) -> dict:
    """The items of ``reader``'s checkpoint (only ``keys``, flattened names as
    in the metadata, if given), read into this process."""
    state: dict = {}
    try:
        _load_state_dict(
            state,
            storage_reader=reader,
            planner=_SafeWholeLoadPlanner(keys),
            no_dist=True,
        )
    except CheckpointException as error:
        raise _unwrap(error, str(reader.path)) from None
    return state


def check_shard_items(directory: str) -> None:
    """Read the non-tensor items of a DCP checkpoint (a few small ones: the
    optimizer's hyper-parameters), so that one holding code is refused before
    a run starts."""
    reader = SafeShardReader(directory)
    keys = {
        key
        for key, entry in reader.metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    if keys:
        _read_whole(reader, keys)


def folder_beside(path: str, name: Any, suffix: str) -> str:
    """The folder ``name`` (ending in ``suffix``) that checkpoint ``path``
    names: it must be a plain name in the folder of ``path``, not a link out
    of it; anything else is refused."""
    folder = os.path.dirname(os.path.abspath(path))
    if (
        not isinstance(name, str)
        or not name.endswith(suffix)
        or name != os.path.basename(name)
        or name.startswith(".")
        or "\0" in name
    ):
        raise refused(f"its shards must be a {suffix} folder beside it, not {name!r}")
    directory = os.path.join(folder, name)
    if os.path.dirname(os.path.realpath(directory)) != os.path.realpath(folder):
        raise refused(f"its shards {name} link out of {folder}")
    return directory


def shards_of(path: str, state: dict) -> str:
    """The DCP directory named by the sharded checkpoint ``path`` (``state``)."""
    return folder_beside(path, shards_folder(state), SHARDED_SUFFIX)


def verify_shards(directory: str, manifest: Any) -> None:
    """Check the files of ``directory`` against the ``sharded_files`` manifest."""
    if not isinstance(manifest, dict):
        raise refused(f"{directory}: malformed shard manifest")
    for name, expected in manifest.items():
        file = os.path.join(directory, str(name))
        if not (isinstance(name, str) and name == os.path.basename(name)):
            raise refused(f"{directory}: malformed shard manifest")
        try:
            size = os.path.getsize(file)
        except OSError:
            raise DamagedCheckpointError(f"{directory}: {name} is missing") from None
        if [size, _sha256(file)] != list(expected):
            raise DamagedCheckpointError(
                f"{directory}: {name} does not match its checksum (damaged)"
            )
