"""Checkpoint files: names, atomic writes, the ``last`` pointer, keep-N pruning,
and weights-only loading."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distribuuuu.errors import (
    OutputPathError,
    RefusedCheckpointError,
)
from distribuuuu.fileio import (
    atomic_write,
    check_output_path,
)

CHECKPOINT_DIR = "checkpoints"
LAST_POINTER = "last"
BEST_WEIGHTS = "best.pth"
BEST_EMA_WEIGHTS = "best_ema.pth"  # same layout, of the weights' moving average
SHARDED_SUFFIX = ".dcp"
DEEPSPEED_SUFFIX = ".ds"  # DeepSpeed's own checkpoint folder (DIST.STRATEGY deepspeed)
DEEPSPEED_TAG = "zero"  # its sub-folder (DeepSpeed's tag) holding DeepSpeed's files
SCORES = "scores.json"  # the score of each checkpoint saved after an evaluation
MAX_SCORES_BYTES = 1 << 20
CHECKPOINT_FILE = re.compile(r"^ckpt_ep_(\d+)(?:_it_(\d+))?\.pth$")


def checkpoint_name(epoch: int, step: int = 0) -> str:
    """Name of the checkpoint after ``epoch`` whole epochs and ``step`` more steps."""
    if step:
        return f"ckpt_ep_{epoch:04d}_it_{step:04d}.pth"
    return f"ckpt_ep_{epoch:04d}.pth"


def _identity(path: str) -> tuple:
    """What two paths share when they name one file: its device and inode
    (through links), or for a path not there yet, its resolved name."""
    try:
        info = os.stat(path)
    except OSError:
        return ("new", os.path.realpath(path))
    return ("file", info.st_dev, info.st_ino)


def check_tool_paths(
    outputs: Sequence[tuple[str, str | None]],
    inputs: Sequence[tuple[str, str | None]] = (),
) -> None:
    """Refuse a tool's paths before it does any work: an output that
    :func:`check_output_path` refuses, two outputs on one file, an output that
    is an input, and an input given twice.

    Args:
        outputs, inputs: ``(argument, path)`` pairs, the argument as the error
            names it (``--out``); a None path is skipped.  Hard links and
            links to one file count as the same file.
    """
    named = [(arg, path, True) for arg, path in outputs if path]
    named += [(arg, path, False) for arg, path in inputs if path]
    for _, path, is_output in named:
        if is_output:
            check_output_path(path)
    seen: dict[tuple, tuple[str, str, bool]] = {}
    for entry in named:
        same = _identity(entry[1])
        if same in seen:
            _refuse_same(seen[same], entry)
        seen[same] = entry


def _refuse_same(first: tuple[str, str, bool], second: tuple[str, str, bool]):
    """Raise OutputPathError: ``first`` and ``second`` name one file."""
    if first[2] and second[2]:
        why = "give each output a path of its own"
    elif first[2] or second[2]:
        why = "refusing to replace an input; write the output elsewhere"
    else:
        why = "give each input once (it would count twice)"
    raise OutputPathError(
        f"{first[0]} {first[1]} and {second[0]} {second[1]} are the same file: {why}"
    )


# Temporary names of atomic_write and save_sharded that a killed process
# leaves behind.
_STALE = re.compile(
    r"^\.(ckpt_ep_\w+\.pth|last|scores\.json|best(_ema)?\.pth|.+\.ya?ml)\.tmp\d+$"
    r"|^ckpt_ep_\w+\.(dcp|ds)\.tmp$"
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


@dataclass(frozen=True)
class Retention:
    """Which checkpoints a run keeps: the newest ``keep`` (0 keeps all) and,
    besides them, the ``best`` with the best scores (lowest where
    ``lower_is_better``), among the checkpoints saved with a score."""

    keep: int = 0
    best: int = 0
    lower_is_better: bool = False


def save_checkpoint(
    out_dir: str,
    epoch: int,
    state: dict,
    retention: Retention = Retention(),
    step: int = 0,
    score: float | None = None,
) -> str:
    """Write ``state`` as a checkpoint, move the ``last`` pointer, prune old ones.

    Args:
        out_dir: the run's OUT_DIR.
        epoch: whole epochs completed (names the file).
        state: anything ``torch.save`` can store with ``weights_only`` loading.
        retention: the checkpoints to keep.
        step: optimizer steps done in the epoch after those (0 at an epoch end).
        score: the metric of this checkpoint's evaluation, recorded in
            ``checkpoints/scores.json`` for the best ones to be kept.
    """
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    name = checkpoint_name(epoch, step)
    atomic_write(os.path.join(directory, name), lambda f: torch.save(state, f))
    if score is not None:
        _write_scores(directory, {**read_scores(directory), name: float(score)})
    atomic_write(
        os.path.join(directory, LAST_POINTER), lambda f: f.write(name.encode() + b"\n")
    )
    if retention.keep > 0:
        _prune(out_dir, retention)
    return os.path.join(directory, name)


def read_scores(directory: str) -> dict[str, float]:
    """The scores of the checkpoints in ``directory`` (``scores.json``); a
    missing, oversized or malformed file counts as none."""
    path = os.path.join(directory, SCORES)
    try:
        if os.path.getsize(path) > MAX_SCORES_BYTES:
            return {}
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {
        name: float(value)
        for name, value in loaded.items()
        if CHECKPOINT_FILE.match(str(name))
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def _write_scores(directory: str, scores: dict[str, float]) -> None:
    text = json.dumps(scores, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(directory, SCORES), lambda f: f.write(text))


def best_checkpoints(out_dir: str, count: int, lower_is_better: bool) -> list[str]:
    """The ``count`` best-scored checkpoints of run ``out_dir``, best first (of
    equal scores the newer), by ``checkpoints/scores.json``."""
    scores = read_scores(os.path.join(out_dir, CHECKPOINT_DIR))
    scored = [
        path
        for _, path in list_checkpoints(out_dir)  # newest first; the sort is stable
        if os.path.basename(path) in scores
    ]
    scored.sort(key=lambda p: scores[os.path.basename(p)], reverse=not lower_is_better)
    return scored[:count]


def _prune(out_dir: str, retention: Retention) -> None:
    """Remove the checkpoints (and their folders) that ``retention`` does not keep."""
    found = [path for _, path in list_checkpoints(out_dir)]  # newest first
    kept = set(found[: retention.keep])
    kept.update(best_checkpoints(out_dir, retention.best, retention.lower_is_better))
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    scores = read_scores(directory)
    for old in found:
        if old not in kept:
            os.remove(old)
            for suffix in (SHARDED_SUFFIX, DEEPSPEED_SUFFIX):
                shutil.rmtree(sharded_dir(old, suffix), ignore_errors=True)
    names = {os.path.basename(path) for path in kept}
    if set(scores) - names:
        _write_scores(directory, {n: v for n, v in scores.items() if n in names})


def refused(reason: str) -> RefusedCheckpointError:
    """A RefusedCheckpointError saying why."""
    return RefusedCheckpointError(f"refused to load it: {reason}")


def sharded_dir(path: str, suffix: str = SHARDED_SUFFIX) -> str:
    """The DCP directory (or with ``suffix``, DeepSpeed's) that goes with
    checkpoint file ``path``."""
    return os.path.splitext(path)[0] + suffix


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
        match = CHECKPOINT_FILE.match(name)
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
        raise refused(
            f"it holds pickled code or objects ({code[1]}), which weights-only "
            "loading never runs"
        ) from None


def error_summary(error: BaseException) -> str:
    """The last line of ``error``'s message (its type name if it has none)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
