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
the directory's name (a plain name in the same folder, never a path) and the
size and SHA-256 of every file in it (the keys are named in
:mod:`distribuuuu.checkpoint.format`).  DCP
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

from distribuuuu.checkpoint.deepspeed_files import (
    check_deepspeed_files,
    deepspeed_folder,
)
from distribuuuu.checkpoint.files import (
    BEST_EMA_WEIGHTS,
    BEST_WEIGHTS,
    CHECKPOINT_DIR,
    CHECKPOINT_FILE,
    DEEPSPEED_SUFFIX,
    DEEPSPEED_TAG,
    LAST_POINTER,
    SHARDED_SUFFIX,
    Retention,
    atomic_write,
    best_checkpoints,
    check_output_path,
    check_tool_paths,
    checkpoint_name,
    list_checkpoints,
    load_file,
    read_scores,
    remove_stale_files,
    save_checkpoint,
    save_weights,
    sharded_dir,
)
from distribuuuu.checkpoint.reading import (
    find_resume_checkpoint,
    load_full,
    load_model_weights,
    weights_in,
)
from distribuuuu.checkpoint.writer import CheckpointWriter
from distribuuuu.errors import (
    DamagedCheckpointError,
    DiskFullError,
    OutputPathError,
    RefusedCheckpointError,
)

# The sharded (DCP) side is imported when first used: torch.distributed.checkpoint
# takes about 0.3 s to import, which a run without sharded checkpoints skips.
_SHARDS = (
    "SafeLoadPlanner",
    "SafeShardReader",
    "load_shards",
    "read_dcp_metadata",
    "read_sharded",
    "save_folder",
    "save_sharded",
    "shard_manifest",
    "shards_of",
    "verify_shards",
)


def __getattr__(name: str):
    if name in _SHARDS:
        from distribuuuu.checkpoint import shards

        return getattr(shards, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BEST_EMA_WEIGHTS",
    "BEST_WEIGHTS",
    "CHECKPOINT_DIR",
    "CHECKPOINT_FILE",
    "CheckpointWriter",
    "DEEPSPEED_SUFFIX",
    "DEEPSPEED_TAG",
    "LAST_POINTER",
    "SHARDED_SUFFIX",
    "DamagedCheckpointError",
    "DiskFullError",
    "OutputPathError",
    "RefusedCheckpointError",
    "Retention",
    "SafeLoadPlanner",
    "SafeShardReader",
    "atomic_write",
    "best_checkpoints",
    "check_deepspeed_files",
    "check_output_path",
    "check_tool_paths",
    "checkpoint_name",
    "deepspeed_folder",
    "find_resume_checkpoint",
    "list_checkpoints",
    "load_file",
    "load_full",
    "load_model_weights",
    "load_shards",
    "read_dcp_metadata",
    "read_scores",
    "read_sharded",
    "remove_stale_files",
    "save_checkpoint",
    "save_folder",
    "save_sharded",
    "save_weights",
    "shard_manifest",
    "sharded_dir",
    "shards_of",
    "verify_shards",
    "weights_in",
]
