"""Describe a checkpoint, best.pth or state_dict file without running anything.

The kind of file, the architecture, the training progress, the classes, the
config values that differ from the current defaults, and the tensors, as a
JSON-ready dict (:func:`summarize`) or as text (:func:`format_summary`).
``tools/inspect_ckpt.py`` is the command line.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from distribuuuu.inference.read import (
    KIND_BEST_WEIGHTS,
    KIND_TRAINING_CHECKPOINT,
    Checkpoint,
    class_names,
    saved_cfg_diff,
    saved_model,
)
from distribuuuu.models import build_model, is_model

# Class names shown in the text output; --json lists them all.
SHOWN_CLASSES = 10


def _cfg_diff(ckpt: Checkpoint) -> list[dict] | None:
    """The saved cfg's values that differ from the defaults (None: no cfg saved)."""
    diff = saved_cfg_diff(ckpt)
    if diff is None:
        return None
    return [
        {"key": key, "value": value, "default": default, "known": known}
        for key, value, default, known in diff
    ]


def _parameter_count(arch: str | None, weights: dict) -> int | None:
    """Elements of the file's tensors that are parameters (not buffers) of ``arch``."""
    if not arch or not is_model(arch):
        return None
    try:
        with torch.device("meta"):  # no memory, no initialisation
            model = build_model(arch, 1)
    except Exception:  # a constructor that cannot run on the meta device
        return None
    names = {name for name, _ in model.named_parameters()}
    return sum(t.numel() for name, t in weights.items() if name in names)


def _progress(ckpt: Checkpoint) -> dict:
    """Epoch, iteration, top-1 and batch geometry, where the file has them."""
    info: dict[str, Any] = {"epoch": ckpt.get("epoch")}
    if ckpt.kind == KIND_TRAINING_CHECKPOINT:
        consumed, global_batch = ckpt.get("consumed"), ckpt.get("global_batch")
        if consumed and global_batch:
            info["iteration"] = consumed // global_batch
        info["best_top1"] = ckpt.get("best_top1")
        info["world_size"] = ckpt.get("world_size")
        info["global_batch"] = global_batch
    elif ckpt.kind == KIND_BEST_WEIGHTS:
        info["top1"] = ckpt.get("top1")
    return info


def summarize(ckpt: Checkpoint) -> dict:
    """Everything the inspector reports, as a JSON-ready dict (absent: None)."""
    diff = _cfg_diff(ckpt)
    num_classes: int | None
    saved_arch, num_classes = saved_model(ckpt)
    arch = ckpt.get("arch") or (saved_arch if diff is not None else None)
    if diff is None:  # no cfg: only the saved class names say how many
        num_classes = len(ckpt.get("classes") or []) or None
    tensors = ckpt.weights.values()
    return {
        "path": ckpt.path,
        "file_mb": os.path.getsize(ckpt.path) / 1e6,
        "kind": ckpt.kind,
        "arch": arch,
        **_progress(ckpt),
        "num_classes": num_classes,
        "classes": class_names(ckpt, num_classes) if num_classes else None,
        "cfg_diff": diff,
        "tensors": len(tensors),
        "parameters": _parameter_count(arch, ckpt.weights),
        "size_mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
        "dtypes": dict(Counter(str(t.dtype).replace("torch.", "") for t in tensors)),
    }


def _text(value: Any) -> str:
    """``value`` as the report shows it: a string as it is, else its repr."""
    return value if isinstance(value, str) else repr(value)


def format_summary(info: dict) -> str:
    """The text report of :func:`summarize`, one ``name  value`` per line."""
    rows = [
        ("file", f"{info['path']} ({info['file_mb']:.2f} MB)"),
        ("kind", info["kind"]),
        ("arch", info["arch"]),
        ("epoch", info.get("epoch")),
        ("iteration", info.get("iteration")),
        ("best top-1", info.get("best_top1")),
        ("top-1", info.get("top1")),
        ("world size", info.get("world_size")),
        ("global batch", info.get("global_batch")),
    ]
    classes = info["classes"]
    if classes:
        shown = ", ".join(classes[:SHOWN_CLASSES])
        if len(classes) > SHOWN_CLASSES:
            shown += f", ... ({len(classes) - SHOWN_CLASSES} more)"
        rows.append(("classes", f"{len(classes)}: {shown}"))
    dtypes = ", ".join(f"{name} x {count}" for name, count in info["dtypes"].items())
    parameters = info["parameters"]
    rows += [
        ("tensors", info["tensors"]),
        ("parameters", f"{parameters:,}" if parameters is not None else "unknown"),
        ("size", f"{info['size_mb']:.2f} MB"),
        ("dtypes", dtypes),
    ]
    lines = [f"{name:<13} {_text(value)}" for name, value in rows if value is not None]
    lines += _format_diff(info["cfg_diff"])
    return "\n".join(lines)


def _format_diff(diff: list[dict] | None) -> list[str]:
    """The report's lines of the cfg values that differ from the defaults."""
    if diff is None:
        return [f"{'cfg':<13} none saved"]
    lines = [f"{'cfg':<13} {len(diff)} values differ from the current defaults"]
    for d in diff:
        default = f"default: {_text(d['default'])}" if d["known"] else "unknown key"
        lines.append(f"  {d['key']}: {_text(d['value'])} ({default})")
    return lines
