"""Reading checkpoints: the one to resume from, whole reads of sharded ones, and
weights matched to a model (a classifier head of another size when fine-tuning).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distribuuuu.checkpoint.deepspeed_files import (
    check_deepspeed_files,
    deepspeed_folder,
)
from distribuuuu.checkpoint.files import (
    CHECKPOINT_DIR,
    CHECKPOINT_FILE,
    DEEPSPEED_TAG,
    LAST_POINTER,
    error_summary,
    list_checkpoints,
    load_file,
)
from distribuuuu.checkpoint.format import (
    MODEL,
    deepspeed_folder_name,
    fuse_qkv,
    is_sharded_checkpoint,
    is_training_checkpoint,
    model_weights,
    shard_manifest_of,
)
from distribuuuu.errors import DamagedCheckpointError, RefusedCheckpointError
from distribuuuu.logger import FILE_ONLY

logger = logging.getLogger(__name__)


def load_full(path: str) -> Any:
    """:func:`load_file`, with the shards of an FSDP checkpoint read in whole."""
    state = load_file(path)
    if is_sharded_checkpoint(state):
        from distribuuuu.checkpoint.shards import read_sharded, shards_of

        state = {**state, **read_sharded(shards_of(path, state))}
        # A tensor-parallel torchvision ViT saves its attention split.
        if isinstance(state.get(MODEL), dict):
            state[MODEL] = fuse_qkv(state[MODEL])
    return state


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
    if not CHECKPOINT_FILE.match(name):
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
            log("skipping unreadable checkpoint %s (%s)", path, error_summary(error))
            log("why %s was skipped:", path, exc_info=True, extra={FILE_ONLY: True})
            continue
        return path, state
    return None


def _check_training_state(path: str, state: Any, checksums: bool) -> None:
    """Raise unless a loaded file is a whole training checkpoint."""
    if not is_training_checkpoint(state):
        raise DamagedCheckpointError("not a training checkpoint")
    sharded = is_sharded_checkpoint(state)
    if deepspeed_folder_name(state) is None and not sharded:
        return  # one file: DCP, which the checks below import, is not needed
    from distribuuuu.checkpoint.shards import (
        check_shard_items,
        shards_of,
        verify_shards,
    )

    if deepspeed_folder_name(state) is not None:
        folder = deepspeed_folder(path, state)
        check_deepspeed_files(folder)  # refused, whatever the manifest says
        manifest = shard_manifest_of(state)
        if checksums and manifest is not None:
            verify_shards(os.path.join(folder, DEEPSPEED_TAG), manifest)
    if not sharded:
        return
    directory = shards_of(path, state)
    manifest = shard_manifest_of(state)
    if checksums and manifest is not None:
        verify_shards(directory, manifest)
    check_shard_items(directory)


def weights_in(state: Any) -> dict:
    """The model weights of a checkpoint or plain state_dict, without ``module.``."""
    weights = model_weights(state)
    if not isinstance(weights, dict):
        raise ValueError("no model weights found in the file")
    prefix = "module."
    return {
        k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()
    }


def is_head_resize(saved: torch.Size, own: torch.Size, num_classes: int) -> bool:
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
    weights = weights_in(state)
    own = model.state_dict()
    skipped = []
    for key, value in own.items():
        if key not in weights:
            raise ValueError(f"{source}: missing key {key}; another architecture?")
        saved = weights[key].shape
        if saved == value.shape:
            continue
        if finetune_classes and is_head_resize(saved, value.shape, finetune_classes):
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
