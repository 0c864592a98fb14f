"""Read a checkpoint or weights file for inference: kind, cfg, classes, model.

Shared by the tools that inspect, export and predict with trained weights.  A
file is loaded with ``weights_only=True`` (see :func:`checkpoint.load_file`);
its cfg is rebuilt from the defaults and the cfg dump it carries, so that the
model and the evaluation transforms are those of the run that wrote it.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import holds_optimizer, model_weights
from distribuuuu.config import (
    ConfigError,
    get_cfg,
    merge_from_file,
    merge_from_list,
    parse_yaml,
    resolve_data_name,
)
from distribuuuu.models import TIMM_EXTRA, build_model, is_model, timm_installed

KIND_TRAINING_CHECKPOINT = "training checkpoint"
KIND_BEST_WEIGHTS = "best weights"
KIND_STATE_DICT = "plain state_dict"


# Lines of torch.load's weights-only errors that explain the option, not the file.
_TORCH_LOAD_NOTES = ("Weights only load failed", "Please file an issue", "Check the")


class CheckpointError(ValueError):
    """A weights file that cannot be used; the message is one line naming it."""


@dataclass
class Checkpoint:
    """A loaded weights file: what it holds and the model tensors in it."""

    path: str
    kind: str  # KIND_TRAINING_CHECKPOINT, KIND_BEST_WEIGHTS or KIND_STATE_DICT
    state: dict  # the whole file (for a plain state_dict, the weights)
    weights: dict[str, torch.Tensor]  # the model's tensors, without ``module.``

    def get(self, key: str, default=None):
        """A metadata entry of the file (``default`` for a plain state_dict)."""
        return default if self.kind == KIND_STATE_DICT else self.state.get(key, default)


def _refusal(error: Exception) -> str:
    """Why ``torch.load`` refused or failed to read a file, in one line."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line for line in lines if not line.startswith(_TORCH_LOAD_NOTES)]
    if not reasons:
        return f"not a checkpoint torch can read ({type(error).__name__})"
    reason = reasons[-1]
    if not isinstance(error, pickle.UnpicklingError):
        reason = f"{type(error).__name__}: {reason}"
    return f"not a checkpoint torch can read ({reason})"


def checkpoint_kind(state: object) -> str:
    """The kind label of a loaded file (``KIND_*``); a CheckpointError otherwise."""
    weights = model_weights(state)
    if weights is not state and isinstance(weights, dict):
        return KIND_TRAINING_CHECKPOINT if holds_optimizer(state) else KIND_BEST_WEIGHTS
    if (
        isinstance(state, dict)
        and state
        and all(isinstance(value, torch.Tensor) for value in state.values())
    ):
        return KIND_STATE_DICT
    raise CheckpointError(
        f"not a checkpoint or state_dict (it holds a {type(state).__name__} "
        "without model tensors)"
    )


def read_checkpoint(path: str) -> Checkpoint:
    """Load ``path`` on the CPU, never running pickled code; raise CheckpointError."""
    if not os.path.isfile(path):
        reason = "is a directory" if os.path.isdir(path) else "no such file"
        raise CheckpointError(f"{path}: {reason}")
    try:
        state = cp.load_full(path)
    except (cp.RefusedCheckpointError, cp.DamagedCheckpointError) as error:
        raise CheckpointError(f"{path}: {error}") from None
    except Exception as error:  # torch.load raises many types for other files
        raise CheckpointError(f"{path}: {_refusal(error)}") from error
    try:
        kind = checkpoint_kind(state)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    return Checkpoint(path, kind, state, cp.weights_in(state))


def saved_cfg(ckpt: Checkpoint) -> CfgNode | None:
    """The cfg dump a checkpoint carries, as saved (unknown keys kept), or None."""
    text = ckpt.get("cfg")
    if not isinstance(text, str):
        return None
    try:
        return CfgNode(parse_yaml(text))  # bounded: a checkpoint is untrusted
    except Exception as error:  # yaml and yacs raise several types
        raise CheckpointError(f"{ckpt.path}: its cfg is unreadable ({error})") from None


def _merge_known(cfg: CfgNode, saved: CfgNode) -> None:
    """Copy into ``cfg`` the values of ``saved`` whose keys ``cfg`` has."""
    for name, value in saved.items():
        if name not in cfg:
            continue
        if isinstance(cfg[name], CfgNode):
            if isinstance(value, CfgNode):
                _merge_known(cfg[name], value)
        elif not isinstance(value, CfgNode):
            cfg[name] = value


def checkpoint_cfg(ckpt: Checkpoint) -> CfgNode:
    """The defaults updated with the cfg dump of ``ckpt`` (keys known today).

    Without a dump, a saved ``arch`` still sets MODEL.ARCH.  Not validated.
    """
    cfg = get_cfg()
    saved = saved_cfg(ckpt)
    if saved is not None:
        _merge_known(cfg, saved)
    elif isinstance(ckpt.get("arch"), str):
        cfg.MODEL.ARCH = ckpt.get("arch")
    return cfg


def inference_cfg(
    ckpt: Checkpoint, cfg_file: str | None = None, opts: list[str] | None = None
) -> CfgNode:
    """The frozen cfg of ``ckpt``: defaults, its cfg dump, a yaml file, overrides.

    Keys of the dump that the defaults do not know are ignored.  DATA.NAME is
    resolved; the data folders and MODEL.WEIGHTS are not checked (they may be
    on another machine).
    """
    cfg = checkpoint_cfg(ckpt)
    if cfg_file:
        merge_from_file(cfg, cfg_file)
    merge_from_list(cfg, list(opts or []))
    if not is_model(cfg.MODEL.ARCH):
        why = "" if timm_installed() else f" (timm is not installed: {TIMM_EXTRA})"
        raise ConfigError(f"MODEL.ARCH {cfg.MODEL.ARCH!r} is not a known model{why}")
    cfg.DATA.NAME = resolve_data_name(cfg)
    cfg.freeze()
    return cfg


def class_names(ckpt: Checkpoint, num_classes: int) -> list[str]:
    """Names of the ``num_classes`` labels: the saved ``classes``, else "0", "1", ..."""
    saved = ckpt.get("classes")
    names = [str(name) for name in saved] if isinstance(saved, list) else []
    return names[:num_classes] + [str(i) for i in range(len(names), num_classes)]


def build_inference_model(ckpt: Checkpoint, cfg: CfgNode) -> nn.Module:
    """``cfg``'s model holding the weights of ``ckpt``, in eval mode on the CPU."""
    model = build_model(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)
    try:
        cp.load_model_weights(model, ckpt.weights, ckpt.path)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    return model.eval()


def load_for_inference(
    path: str, cfg_file: str | None = None, opts: list[str] | None = None
) -> tuple[nn.Module, CfgNode, list[str]]:
    """The eval-mode model, cfg and class names of the weights file ``path``."""
    ckpt = read_checkpoint(path)
    cfg = inference_cfg(ckpt, cfg_file, opts)
    model = build_inference_model(ckpt, cfg)
    return model, cfg, class_names(ckpt, cfg.MODEL.NUM_CLASSES)
