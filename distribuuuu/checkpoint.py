"""Save and load checkpoints: atomic writes, a ``last`` pointer, keep-N, best.

Layout under ``OUT_DIR``::

    checkpoints/ckpt_ep_0007.pth          full training state after epoch 7
    checkpoints/ckpt_ep_0007_it_0120.pth  ... after 7 epochs and 120 steps
    checkpoints/last               name of the newest complete checkpoint
    best.pth                       weights of the best evaluation

A file is written under a temporary name in the same directory, flushed,
fsynced and renamed into place; ``last`` moves only after that.  Loading uses
``weights_only=True``, so a checkpoint can never run pickled code.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_POINTER = "last"
BEST_WEIGHTS = "best.pth"
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
    return os.path.join(directory, name)


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
        if isinstance(state, dict) and "model" in state and "epoch" in state:
            return path, state
        logger.warning("skipping %s: not a training checkpoint", path)
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


def load_model_weights(
    model: nn.Module,
    state: dict,
    source: str,
    load: Callable[[dict], None] | None = None,
) -> None:
    """Load weights into ``model`` (unwrapped), naming the first mismatch.

    ``load`` loads the checked weights instead of ``model.load_state_dict``
    (for a model whose wrapper loads differently, such as FSDP's).
    """
    weights = model_state_dict(state)
    own = model.state_dict()
    for key, value in own.items():
        if key not in weights:
            raise ValueError(f"{source}: missing key {key}; another architecture?")
        if weights[key].shape != value.shape:
            raise ValueError(
                f"{source}: {key} has shape {tuple(weights[key].shape)}, the model "
                f"expects {tuple(value.shape)}; another architecture or NUM_CLASSES?"
            )
    extra = sorted(set(weights) - set(own))
    if extra:
        raise ValueError(f"{source}: unexpected key {extra[0]}; another architecture?")
    (load or model.load_state_dict)(weights)


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
