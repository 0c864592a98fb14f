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
``"sharded"``: the directory's name.  DCP re-shards on load, so such a
checkpoint resumes on any world size; :func:`load_full` reads it whole for
any other use (DDP resume, export, inspection).  DCP reads its ``.metadata``
file with ``pickle``; :func:`_check_dcp_metadata` first refuses one that
would build anything but DCP's own metadata classes.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distribuuuu import distributed as du

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


def atomic_write(path: str, write) -> None:
    """Call ``write(file)`` on a temporary file, fsync it and rename it to ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(directory)


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


def sharded_dir(path: str) -> str:
    """The DCP directory that goes with checkpoint file ``path``."""
    return os.path.splitext(path)[0] + SHARDED_SUFFIX


def save_sharded(out_dir: str, name: str, state: dict) -> str:
    """Every rank writes its shards of ``state``; returns the directory's name.

    A collective.  The shards go to a temporary directory that rank 0 renames
    into place once DCP has finished (DCP's writer fsyncs each file), so a
    ``.dcp`` directory under its final name is always complete.
    """
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    final = sharded_dir(os.path.join(directory, name))
    tmp = final + ".tmp"
    if du.is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    du.barrier()
    dcp.save(state, checkpoint_id=tmp)
    if du.is_main_process():
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(directory)
    du.barrier()
    return os.path.basename(final)


# What a DCP .metadata pickle may build besides torch dtypes: DCP's classes
# and the few others they hold (measured on torch 2.14's files).
_DCP_PICKLE_MODULE = "torch.distributed.checkpoint."
_DCP_PICKLE_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses any other global."""

    def find_class(self, module: str, name: str):
        allowed = (
            module.startswith(_DCP_PICKLE_MODULE)
            or (module, name) in _DCP_PICKLE_NAMES
            or (
                module == "torch"
                and isinstance(getattr(torch, name, None), torch.dtype)
            )
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to build {module}.{name}")
        return super().find_class(module, name)


def _check_dcp_metadata(directory: str) -> None:
    """Raise ValueError unless ``directory`` holds safe DCP metadata."""
    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ValueError(f"{directory}: no DCP .metadata (incomplete?)") from None
    except pickle.UnpicklingError as error:
        raise ValueError(f"{path}: not DCP checkpoint metadata ({error})") from None


def read_sharded(directory: str) -> dict:
    """A DCP checkpoint read whole into this process (no process group used).

    Through DCP's own converter to a ``torch.save`` file (in a temporary
    directory beside it, where there is room for it), loaded weights-only.
    """
    _check_dcp_metadata(directory)
    parent = os.path.dirname(os.path.abspath(directory))
    with tempfile.TemporaryDirectory(dir=parent, prefix=".read_sharded") as tmp:
        whole = os.path.join(tmp, "whole.pth")
        dcp_to_torch_save(directory, whole)
        return load_file(whole)


def shards_of(path: str, state: dict) -> str:
    """The DCP directory named by the sharded checkpoint ``path`` (``state``)."""
    return os.path.join(os.path.dirname(path), state["sharded"])


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
    """Load a checkpoint or weights file on the CPU, never executing pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def find_resume_checkpoint(out_dir: str) -> tuple[str, dict] | None:
    """The newest checkpoint that loads, trying ``last`` first, then the others.

    A truncated or corrupt file is skipped with a warning naming it.
    """
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    candidates = []
    pointer = os.path.join(directory, LAST_POINTER)
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as f:
            candidates.append(os.path.join(directory, f.read().strip()))
    candidates += [path for _, path in list_checkpoints(out_dir)]
    for path in dict.fromkeys(candidates):  # in order, without repeats
        if not os.path.isfile(path):
            continue
        try:
            state = load_file(path)
        except Exception as error:  # a torn or corrupt file: try an older one
            logger.warning("skipping unreadable checkpoint %s (%s)", path, error)
            continue
        problem = _training_state_problem(path, state)
        if problem is None:
            return path, state
        logger.warning("skipping %s: %s", path, problem)
    return None


def _training_state_problem(path: str, state: Any) -> str | None:
    """Why a loaded file is not a whole training checkpoint; None if it is."""
    if not isinstance(state, dict) or "epoch" not in state:
        return "not a training checkpoint"
    if "sharded" not in state:
        return None if "model" in state else "not a training checkpoint"
    try:
        _check_dcp_metadata(shards_of(path, state))
    except ValueError as error:
        return str(error)
    return None


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


def capture_rng_state() -> dict:
    """The RNG states of Python, NumPy and torch (CPU and CUDA) of this process."""
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
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore states captured by :func:`capture_rng_state`."""
    version, numbers, gauss = state["python"]
    random.setstate((version, tuple(numbers), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
