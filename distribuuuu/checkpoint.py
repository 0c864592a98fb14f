"""Save and load checkpoints: atomic writes, a ``last`` pointer, keep-N, best.

Layout under ``OUT_DIR``::

    checkpoints/ckpt_ep_0007.pth          full training state after epoch 7
    checkpoints/ckpt_ep_0007_it_0120.pth  ... after 7 epochs and 120 steps
    checkpoints/ckpt_ep_0007.dcp/         FSDP: its model and optimizer shards
    checkpoints/last               name of the newest complete checkpoint
    best.pth                       weights of the best evaluation
    best_ema.pth                   ... of the best evaluation of the EMA (MODEL.EMA)

A file is written under a temporary name in the same directory, flushed,
fsynced and renamed into place; ``last`` moves only after that.  Loading uses
``weights_only=True``, so a checkpoint can never run pickled code.

Under DIST.STRATEGY fsdp the model and optimizer are not gathered: every rank
writes its shards with ``torch.distributed.checkpoint`` (DCP) into a ``.dcp``
directory beside the ``.pth``, which then holds the rest of the state and
``"sharded"``: the directory's name (a plain name in the same folder, never a
path), and ``"sharded_files"``: the size and SHA-256 of every file in it.  DCP
re-shards on load, so such a checkpoint resumes on any world size;
:func:`load_full` reads it whole for any other use (DDP resume, export,
inspection).

Every file is untrusted input.  DCP itself unpickles its ``.metadata`` and the
non-tensor items of its shards with ``pickle`` and ``weights_only=False``; we
never let it: :class:`SafeShardReader` reads the metadata with an unpickler
that builds exact ``(module, name)`` pairs of DCP's metadata classes only and
checks every entry against the files on disk, and :class:`SafeLoadPlanner`
loads non-tensor items weights-only.  A file that would build anything else
raises :class:`RefusedCheckpointError`; one that is torn, truncated or fails its
checksum raises :class:`DamagedCheckpointError`, and resuming falls back to an
older checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import math
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from distribuuuu import distributed as du
from distribuuuu.logger import FILE_ONLY

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_POINTER = "last"
BEST_WEIGHTS = "best.pth"
BEST_EMA_WEIGHTS = "best_ema.pth"  # same layout, of the weights' moving average
SHARDED_SUFFIX = ".dcp"
_NAME = re.compile(r"^ckpt_ep_(\d+)(?:_it_(\d+))?\.pth$")


def checkpoint_name(epoch: int, step: int = 0) -> str:
    """Name of the checkpoint after ``epoch`` whole epochs and ``step`` more steps."""
    if step:
        return f"ckpt_ep_{epoch:04d}_it_{step:04d}.pth"
    return f"ckpt_ep_{epoch:04d}.pth"


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskFullError(RuntimeError):
    """No space left while writing a file; the message names it."""


def _disk_full(error: BaseException, directory: str) -> bool:
    """Whether ``error`` came from a full disk.  torch.save reports it as a
    RuntimeError of its zip writer ("unexpected pos"), so the free space of
    ``directory`` decides when the error does not say."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    try:
        usage = os.statvfs(directory)
    except OSError:
        return False
    return usage.f_bavail * usage.f_frsize < (1 << 20)


def atomic_write(path: str, write) -> None:
    """Call ``write(file)`` on a temporary file, fsync it and rename it to ``path``.

    On any failure the temporary file is removed and ``path`` keeps what it
    held; a full disk raises DiskFullError naming ``path``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        if _disk_full(error, directory):
            raise DiskFullError(
                f"no space left on device while writing {path}"
            ) from error
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(directory)


# Temporary names of atomic_write and save_sharded that a killed process
# leaves behind.
_STALE = re.compile(
    r"^\.(ckpt_ep_\w+\.pth|last|best(_ema)?\.pth|.+\.ya?ml)\.tmp\d+$"
    r"|^ckpt_ep_\w+\.dcp\.tmp$"
)


def remove_stale_files(out_dir: str) -> list[str]:
    """Remove half-written files of a killed save (call on rank 0 before a run
    writes anything); their paths."""
    removed = []
    for directory in (out_dir, os.path.join(out_dir, CHECKPOINT_DIR)):
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if not _STALE.match(name) or os.path.islink(path):
                continue
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            removed.append(path)
    return removed


def save_checkpoint(
    out_dir: str, epoch: int, state: dict, keep: int = 0, step: int = 0
) -> str:
    """Write ``state`` as a checkpoint, move the ``last`` pointer, prune old ones.

    Args:
        out_dir: the run's OUT_DIR.
        epoch: whole epochs completed (names the file).
        state: anything ``torch.save`` can store with ``weights_only`` loading.
        keep: keep the newest ``keep`` checkpoints (0 keeps all).
        step: optimizer steps done in the epoch after those (0 at an epoch end).
    """
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    name = checkpoint_name(epoch, step)
    atomic_write(os.path.join(directory, name), lambda f: torch.save(state, f))
    atomic_write(
        os.path.join(directory, LAST_POINTER), lambda f: f.write(name.encode() + b"\n")
    )
    if keep > 0:
        for _, old in list_checkpoints(out_dir)[keep:]:
            os.remove(old)
            shutil.rmtree(sharded_dir(old), ignore_errors=True)
    return os.path.join(directory, name)


class RefusedCheckpointError(ValueError):
    """A file that would build objects or reach files a checkpoint never does."""


def _refused(reason: str) -> RefusedCheckpointError:
    return RefusedCheckpointError(f"refused to load it: {reason}")


class DamagedCheckpointError(ValueError):
    """A checkpoint that is incomplete, truncated or fails its checksums."""


def sharded_dir(path: str) -> str:
    """The DCP directory that goes with checkpoint file ``path``."""
    return os.path.splitext(path)[0] + SHARDED_SUFFIX


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_manifest(directory: str) -> dict[str, list]:
    """``{file: [size, sha256]}`` of a DCP directory; a collective.

    Every rank hashes a share of the files, so the cost is spread.
    """
    names = du.broadcast_object(sorted(os.listdir(directory)))
    rank, world = du.get_rank(), du.get_world_size()
    mine = {}
    for name in names[rank::world]:
        path = os.path.join(directory, name)
        mine[name] = [os.path.getsize(path), _sha256(path)]
    manifest: dict[str, list] = {}
    for part in du.all_gather_object(mine):
        manifest.update(part)
    return manifest


def save_sharded(out_dir: str, name: str, state: dict) -> dict:
    """Every rank writes its shards of ``state``; the checkpoint entries naming them.

    A collective.  The shards go to a temporary directory that rank 0 renames
    into place once DCP has finished (DCP's writer fsyncs each file), so a
    ``.dcp`` directory under its final name is always complete.  Returns
    ``{"sharded": directory name, "sharded_files": manifest}``, the manifest
    holding the size and SHA-256 of every file, checked before resuming.
    """
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    final = sharded_dir(os.path.join(directory, name))
    tmp = final + ".tmp"
    if du.is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    du.barrier()
    dcp.save(state, checkpoint_id=tmp)
    manifest = shard_manifest(tmp)
    if du.is_main_process():
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(directory)
    du.barrier()
    return {"sharded": os.path.basename(final), "sharded_files": manifest}


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
        raise _refused(f"{path}: not DCP checkpoint metadata")
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
                raise _refused(f"{path}: malformed entry {key!r}")
            declared += math.prod(entry.size) * dtype.itemsize
        elif not isinstance(entry, BytesStorageMetadata):
            raise _refused(f"{path}: malformed entry {key!r}")
    sizes: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (
            isinstance(info, _StorageInfo)
            and isinstance(name, str)
            and _SHARD_FILE.match(name)
        ):
            raise _refused(f"{path}: names a file outside its directory")
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
            raise _refused(f"{path}: malformed storage entry for {name}")
        if offset + length > sizes[name]:
            raise DamagedCheckpointError(
                f"{directory}: {name} is shorter than its metadata says (truncated?)"
            )
    # Tensors are stored whole in the shard files: metadata that declares more
    # bytes than those hold would only make the reader allocate them.
    if declared > sum(sizes.values()):
        raise _refused(
            f"{path}: declares {declared} bytes of tensors in "
            f"{sum(sizes.values())} bytes of shards"
        )


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
        raise _refused(
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

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            item = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            if "GLOBAL" not in str(error):
                raise DamagedCheckpointError(f"shard item {name} is garbled") from None
            raise _refused(
                f"shard item {name} holds pickled code or objects, which "
                f"weights-only loading never runs ({_first(error)})"
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
    return DamagedCheckpointError(f"{directory}: {_first(error)}")


def _first(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


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


def _check_shard_items(directory: str) -> None:
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


def shards_of(path: str, state: dict) -> str:
    """The DCP directory named by the sharded checkpoint ``path`` (``state``).

    It must be a plain ``.dcp`` name in the folder of ``path``, not a link out
    of it: anything else is refused.
    """
    name = state.get("sharded")
    folder = os.path.dirname(os.path.abspath(path))
    if (
        not isinstance(name, str)
        or not name.endswith(SHARDED_SUFFIX)
        or name != os.path.basename(name)
        or name.startswith(".")
        or "\0" in name
    ):
        raise _refused(f"its shards must be a .dcp folder beside it, not {name!r}")
    directory = os.path.join(folder, name)
    if os.path.dirname(os.path.realpath(directory)) != os.path.realpath(folder):
        raise _refused(f"its shards {name} link out of {folder}")
    return directory


def verify_shards(directory: str, manifest: Any) -> None:
    """Check the files of ``directory`` against the ``sharded_files`` manifest."""
    if not isinstance(manifest, dict):
        raise _refused(f"{directory}: malformed shard manifest")
    for name, expected in manifest.items():
        file = os.path.join(directory, str(name))
        if not (isinstance(name, str) and name == os.path.basename(name)):
            raise _refused(f"{directory}: malformed shard manifest")
        try:
            size = os.path.getsize(file)
        except OSError:
            raise DamagedCheckpointError(f"{directory}: {name} is missing") from None
        if [size, _sha256(file)] != list(expected):
            raise DamagedCheckpointError(
                f"{directory}: {name} does not match its checksum (damaged)"
            )


def load_full(path: str) -> Any:
    """:func:`load_file`, with the shards of an FSDP checkpoint read in whole."""
    state = load_file(path)
    if isinstance(state, dict) and "sharded" in state:
        state = {**state, **read_sharded(shards_of(path, state))}
    return state


def save_weights(path: str, state: dict) -> None:
    """Atomically write a weights-only file such as ``best.pth``."""
    atomic_write(path, lambda f: torch.save(state, f))


def list_checkpoints(out_dir: str) -> list[tuple[tuple[int, int], str]]:
    """((epoch, step), path) of every checkpoint in the run, newest first."""
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match:
            position = (int(match.group(1)), int(match.group(2) or 0))
            found.append((position, os.path.join(directory, name)))
    return sorted(found, reverse=True)


def load_file(path: str) -> Any:
    """Load a checkpoint or weights file on the CPU, never executing pickled code.

    A file holding pickled code or objects raises RefusedCheckpointError.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        code = re.search(r"GLOBAL ([\w.]+)", str(error))
        if code is None:
            raise
        raise _refused(
            f"it holds pickled code or objects ({code[1]}), which weights-only "
            "loading never runs"
        ) from None


def _last_pointer(directory: str, warn: Callable) -> str | None:
    """The checkpoint that ``last`` names, if it names one of ours in
    ``directory``; anything else is ignored with a warning."""
    pointer = os.path.join(directory, LAST_POINTER)
    if not os.path.isfile(pointer):
        return None
    try:
        with open(pointer, "rb") as f:
            name = f.read(256).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        warn("ignoring unreadable %s (%s)", pointer, error)
        return None
    if not _NAME.match(name):
        warn("ignoring %s: %r is not a checkpoint name", pointer, name[:80])
        return None
    return os.path.join(directory, name)


def _silent(*args, **kwargs) -> None:
    pass


def find_resume_checkpoint(
    out_dir: str, checksums: bool = False, warn: bool = True
) -> tuple[str, dict] | None:
    """The newest checkpoint that loads, trying ``last`` first, then the others.

    A torn, truncated or otherwise damaged file is skipped with a warning
    naming it (unless not ``warn``; its traceback goes to the log files only).
    With ``checksums`` the shards of a sharded checkpoint are checked against
    its manifest.  A checkpoint that holds code is refused:
    RefusedCheckpointError.
    """
    log = logger.warning if warn else _silent
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    candidates = [_last_pointer(directory, log)]
    candidates += [path for _, path in list_checkpoints(out_dir)]
    for path in dict.fromkeys(candidates):  # in order, without repeats
        if path is None or not os.path.isfile(path):
            continue
        try:
            state = load_file(path)
            _check_training_state(path, state, checksums)
        except RefusedCheckpointError as error:
            error.args = (f"{path}: {error}",)
            raise
        except Exception as error:  # a torn or corrupt file: try an older one
            log("skipping unreadable checkpoint %s (%s)", path, _first(error))
            log("why %s was skipped:", path, exc_info=True, extra={FILE_ONLY: True})
            continue
        return path, state
    return None


def _check_training_state(path: str, state: Any, checksums: bool) -> None:
    """Raise unless a loaded file is a whole training checkpoint."""
    if not isinstance(state, dict) or "epoch" not in state:
        raise DamagedCheckpointError("not a training checkpoint")
    if "sharded" not in state:
        if "model" not in state:
            raise DamagedCheckpointError("not a training checkpoint")
        return
    directory = shards_of(path, state)
    if checksums and "sharded_files" in state:
        verify_shards(directory, state["sharded_files"])
    _check_shard_items(directory)


def model_state_dict(state: dict) -> dict:
    """The model weights of a checkpoint or plain state_dict, without ``module.``."""
    weights = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(weights, dict):
        raise ValueError("no model weights found in the file")
    prefix = "module."
    return {
        k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()
    }


def _is_head_resize(saved: torch.Size, own: torch.Size, num_classes: int) -> bool:
    """True when only the class dimension differs: a classifier of another size.

    Every head of the registry keeps the classes in dimension 0 of its weight
    and bias (resnet/regnet ``fc``, efficientnet ``classifier.1``, vit
    ``heads.head``, the small nets' ``fc``; inception/googlenet aux heads too).
    """
    return (
        len(saved) == len(own) > 0
        and own[0] == num_classes
        and saved[0] != own[0]
        and saved[1:] == own[1:]
    )


def load_model_weights(
    model: nn.Module,
    state: dict,
    source: str,
    load: Callable[[dict, bool], None] | None = None,
    finetune_classes: int | None = None,
) -> list[str]:
    """Load weights into ``model`` (unwrapped), naming the first mismatch.

    Args:
        model: the plain model (an FSDP model is its own plain model).
        state: a checkpoint or a plain state_dict.
        source: the file's name, for the messages.
        load: called as ``load(weights, strict)`` instead of
            ``model.load_state_dict`` (for a wrapper that loads differently,
            such as FSDP's).
        finetune_classes: fine-tuning into a head of this many classes: keys
            of a classifier head of another size are skipped, so the head keeps
            its fresh initialisation; any other mismatch is still an error.

    Returns the keys skipped (empty unless fine-tuning changed the head).
    """
    weights = model_state_dict(state)
    own = model.state_dict()
    skipped = []
    for key, value in own.items():
        if key not in weights:
            raise ValueError(f"{source}: missing key {key}; another architecture?")
        saved = weights[key].shape
        if saved == value.shape:
            continue
        if finetune_classes and _is_head_resize(saved, value.shape, finetune_classes):
            skipped.append(key)
            continue
        hint = (
            "another architecture? (MODEL.FINETUNE re-initialises only the "
            "classifier head)"
            if finetune_classes
            else "another architecture or NUM_CLASSES? (MODEL.FINETUNE True "
            "re-initialises a classifier head of another size)"
        )
        raise ValueError(
            f"{source}: {key} has shape {tuple(saved)}, the model expects "
            f"{tuple(value.shape)}; {hint}"
        )
    extra = sorted(set(weights) - set(own))
    if extra:
        raise ValueError(f"{source}: unexpected key {extra[0]}; another architecture?")
    kept = {key: value for key, value in weights.items() if key not in skipped}
    if load is None:
        model.load_state_dict(kept, strict=not skipped)
    else:
        load(kept, not skipped)
    return skipped


def capture_rng_state(devices: Sequence[torch.device] = ()) -> dict:
    """The RNG states of Python, NumPy and torch of this process: the CPU's and
    those of its CUDA ``devices``, in their order (``"cuda_devices"``).

    Only the process's own GPUs (one, or every GPU of a DataParallel): a
    resume may see other GPUs, or another number of them (8 per process at
    save time, 1 under ``srun --gpus-per-task=1`` at resume), whose
    generators are not its.
    """
    version, numbers, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(numbers), gauss],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state(),
    }
    gpus = [device for device in devices if device.type == "cuda"]
    if gpus:
        state["cuda_devices"] = [torch.cuda.get_rng_state(gpu) for gpu in gpus]
    return state


def restore_rng_state(state: dict, devices: Sequence[torch.device] = ()) -> None:
    """Restore states captured by :func:`capture_rng_state`; the CUDA
    ``devices`` get the saved GPU states in order (those without one keep
    theirs).

    Older checkpoints hold the states of every GPU the process saw
    (``"cuda"``, a list by device index): each device gets the entry of its
    index, if there is one.
    """
    version, numbers, gauss = state["python"]
    random.setstate((version, tuple(numbers), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    gpus = [device for device in devices if device.type == "cuda"]
    saved = state.get("cuda_devices")
    if saved is None:  # the older layout
        every = state.get("cuda") or []
        pairs = [(gpu, every[gpu.index]) for gpu in gpus if gpu.index < len(every)]
    else:
        pairs = list(zip(gpus, saved))
    for gpu, gpu_state in pairs:
        torch.cuda.set_rng_state(gpu_state, gpu)
