"""Averaging the weights of several checkpoints of a run (as timm's
``avg_checkpoints.py`` does; Izmailov et al. 2018 on why the average of
weights along a run generalises better).

Floating-point tensors, BatchNorm running statistics included, are averaged
in float64 and stored in their own dtype; integer tensors (BatchNorm's
``num_batches_tracked``) come from the newest checkpoint.  The running
statistics are therefore the average of the statistics, not those of the
averaged weights: evaluate the result to see that it helps.  The file written
is a plain weights file with the newest checkpoint's architecture, classes
and config, which ``--eval-only``, ``MODEL.WEIGHTS``, inspect, export and
predict read.
"""

from __future__ import annotations

import os

import torch

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import averaged_weights
from distribuuuu.errors import CheckpointError
from distribuuuu.inference.read import KIND_STATE_DICT, read_checkpoint


def select_checkpoints(
    out_dir: str, last: int = 0, best: int = 0, lower_is_better: bool = False
) -> list[str]:
    """The newest ``last`` checkpoints of run ``out_dir``, or its ``best`` by
    the scores CHECKPOINT.KEEP_BEST records."""
    if last:
        return [path for _, path in cp.list_checkpoints(out_dir)][:last]
    return cp.best_checkpoints(out_dir, best, lower_is_better)


def _layout(weights: dict) -> dict:
    return {key: (value.shape, value.dtype) for key, value in weights.items()}


def average_checkpoints(paths: list[str]) -> dict:
    """The contents of the file averaging the model weights of ``paths``
    (in any order: the newest by epoch gives the rest).

    CheckpointError for a file that cannot be used, fewer than two files, or
    files whose tensors differ in names, shapes or dtypes.
    """
    if len(paths) < 2:
        raise CheckpointError(
            f"averaging needs two checkpoints or more, got {len(paths)}"
        )
    sums: dict[str, torch.Tensor] = {}
    layout: dict | None = None
    newest: tuple[int, dict, dict] | None = None  # (epoch, file, weights)
    for path in paths:
        ckpt = read_checkpoint(path)
        state, weights = ckpt.state, ckpt.weights
        layout = layout or _layout(weights)
        if _layout(weights) != layout:
            raise CheckpointError(
                f"{path}: its tensors differ from those of {paths[0]}"
            )
        for key, value in weights.items():
            if value.is_floating_point():
                value = value.to(torch.float64)
                sums[key] = value + sums[key] if key in sums else value
        meta = state if ckpt.kind != KIND_STATE_DICT else {}
        epoch = meta.get("epoch", -1)
        if newest is None or epoch >= newest[0]:
            newest = (epoch, meta, weights)
    assert newest is not None and layout is not None  # two paths or more
    _, meta, weights = newest
    model = {
        key: (sums[key] / len(paths)).to(dtype) if key in sums else weights[key]
        for key, (_, dtype) in layout.items()
    }
    return averaged_weights(model, meta, [os.path.basename(p) for p in paths])
