"""Read a checkpoint or weights file for inference: kind, cfg, classes, model.

Shared by the tools that inspect, export and predict with trained weights.  A
file is loaded with ``weights_only=True`` (see :func:`checkpoint.load_file`);
its cfg is rebuilt from the defaults and the cfg dump it carries, so that the
model and the evaluation transforms are those of the run that wrote it.  This
module is where that cfg stops: the other inference modules take what it
turns it into (an :class:`InferenceSpec`, plain values).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import (
    LOSS_KEY,
    holds_optimizer,
    model_weights,
    saved_loss,
)
from distribuuuu.config import (
    diff_from_defaults,
    get_cfg,
    merge_from_file,
    merge_from_list,
    parse_yaml,
    resolve_data_name,
)
from distribuuuu.config.validation import largest_train_size
from distribuuuu.data.spec import DataSpec, TransformSpec
from distribuuuu.data.transforms import CROP_MODES
from distribuuuu.errors import (
    CheckpointError,
    ConfigError,
    DamagedCheckpointError,
    RefusedCheckpointError,
)
from distribuuuu.models import TIMM_EXTRA, build_model, is_model, timm_installed

KIND_TRAINING_CHECKPOINT = "training checkpoint"
KIND_BEST_WEIGHTS = "best weights"
KIND_STATE_DICT = "plain state_dict"


# Lines of torch.load's weights-only errors that explain the option, not the file.
_TORCH_LOAD_NOTES = ("Weights only load failed", "Please file an issue", "Check the")


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
    except (RefusedCheckpointError, DamagedCheckpointError) as error:
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


def saved_model(ckpt: Checkpoint) -> tuple[str, int]:
    """MODEL.ARCH and MODEL.NUM_CLASSES as the cfg dump of ``ckpt`` sets them
    (:func:`checkpoint_cfg`: the defaults' where it has none)."""
    cfg = checkpoint_cfg(ckpt)
    return cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES


def saved_cfg_diff(ckpt: Checkpoint) -> list[tuple[str, Any, Any, bool]] | None:
    """The values of the cfg dump of ``ckpt`` that differ from the current
    defaults, as ``(key, value, default, whether the defaults know the key)``;
    None when it carries no cfg."""
    saved = saved_cfg(ckpt)
    if saved is None:
        return None
    defaults = get_cfg()
    return [
        (key, value, default, _has_key(defaults, key))
        for key, value, default in diff_from_defaults(saved)
    ]


def _has_key(tree: CfgNode, key: str) -> bool:
    """Whether the dotted ``key`` exists in ``tree``."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


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


def eval_data_spec(cfg: CfgNode) -> DataSpec:
    """The evaluation side of a cfg's data set: what evaluating and
    inference read (``distribuuuu.engine.specs.data_spec`` adds training's
    files and augmentations to it)."""
    test = cfg.TEST
    transform = TransformSpec(
        im_size=largest_train_size(cfg),
        test_im_size=test.IM_SIZE,
        test_crop_size=test.CROP_SIZE,
        test_crop_pct=test.CROP_PCT,
        test_interpolation=test.INTERPOLATION,
        device_crops=test.TTA in CROP_MODES,
    )
    return DataSpec(
        name=resolve_data_name(cfg),
        transform=transform,
        num_classes=cfg.MODEL.NUM_CLASSES,
        decoder=cfg.DATA.DECODER,
        test_dataset=test.DATASET,
        test_split=test.SPLIT,
        download=cfg.DATA.DOWNLOAD,
        skip_corrupt=cfg.DATA.SKIP_CORRUPT,
        synthetic_size=tuple(cfg.DATA.SYNTHETIC_SIZE),
    )


@dataclass(frozen=True)
class InferenceSpec:
    """What exporting and predicting need of a run's cfg: the model and the
    evaluation side of its data set (how images are read and transformed);
    :func:`inference_spec` fills it."""

    arch: str  # MODEL.ARCH
    data: DataSpec  # its num_classes is MODEL.NUM_CLASSES
    loss: str = "ce"  # MODEL.LOSS: softmax logits (ce) or a sigmoid per class
    threshold: float = 0.5  # TEST.THRESHOLD: sigmoid labels predicted at or above

    @property
    def num_classes(self) -> int:
        return self.data.num_classes


def inference_spec(cfg: CfgNode) -> InferenceSpec:
    """The inference spec of ``cfg`` (see :func:`inference_cfg`)."""
    return InferenceSpec(
        arch=cfg.MODEL.ARCH,
        data=eval_data_spec(cfg),
        loss=cfg.MODEL.LOSS,
        threshold=cfg.TEST.THRESHOLD,
    )


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
) -> tuple[nn.Module, InferenceSpec, list[str]]:
    """The eval-mode model, inference spec and class names of the weights
    file ``path`` (its cfg overridden by a yaml file and KEY VALUE ``opts``)."""
    ckpt = read_checkpoint(path)
    cfg = inference_cfg(ckpt, cfg_file, opts)
    model = build_inference_model(ckpt, cfg)
    spec = inference_spec(cfg)
    if ckpt.get(LOSS_KEY) is not None:  # the weights' own record wins
        spec = dataclasses.replace(spec, loss=saved_loss(ckpt.state))
    return model, spec, class_names(ckpt, cfg.MODEL.NUM_CLASSES)
