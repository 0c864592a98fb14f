"""What the config knows about its keys beyond their defaults, and ConfigError.

The values a key may take (choices), the keys that may be null or hold lists,
the old names still accepted, and the helpers that walk a cfg by dotted key
(``OPTIM.BASE_LR``).  Shared by loading, validation and the reference.
"""

from __future__ import annotations

from typing import Any

from yacs.config import CfgNode


class ConfigError(ValueError):
    """A config value, key or file that cannot be used; the message is one line."""


# Keys whose default is null, with the type they take otherwise.
NULLABLE = {"MODEL.WEIGHTS": str, "RNG_SEED": int}
# Element type of list keys (checked on every element).
LIST_ITEMS = {
    "OPTIM.STEPS": (int, float),
    "OPTIM.BETAS": (int, float),
    "DATA.SYNTHETIC_SIZE": (int,),
    "DIST.PIPELINE.SPLIT": (str,),
}
# Old names still accepted, mapped to the current key with a warning.
RENAMED = {
    "TRAIN.PRINT_FEQ": "TRAIN.PRINT_FREQ",
    "TEST.PRINT_FEQ": "TEST.PRINT_FREQ",
    "TRAIN.CHECKPOINT": "MODEL.WEIGHTS",
}

DATA_NAMES = ("auto", "mnist5k", "imagefolder", "cifar10", "cifar100", "synthetic")
LR_POLICIES = ("cos", "steps", "exp", "linear", "onecycle")
OPTIMIZERS = ("sgd", "adamw", "rmsprop", "lamb", "lars")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("", "nccl", "gloo")
DIST_MODES = ("ddp", "dp")
STRATEGIES = ("dp", "ddp", "zero1", "fsdp", "pipeline", "deepspeed")
OFFLOADS = ("none", "cpu", "nvme")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PRECISIONS = ("none", "bf16", "fp16")
AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")

# Keys with a fixed set of values.
CHOICES = {
    "DATA.NAME": DATA_NAMES,
    "DATA.AUTO_AUGMENT": AUTO_AUGMENTS,
    "DATA.DECODER": ("fused", "tensor", "pil"),
    "OPTIM.LR_POLICY": LR_POLICIES,
    "OPTIM.OPTIMIZER": OPTIMIZERS,
    "OPTIM.LR_STEP": ("iter", "epoch"),
    "TRAIN.INTERPOLATION": ("bilinear", "bicubic"),
    "TEST.INTERPOLATION": ("bilinear", "bicubic"),
    "TEST.TTA": ("none", "flip", "five_crop", "ten_crop"),
    "CHECKPOINT.BEST_METRIC": ("top1", "loss"),
    "TRAIN.DISTILL.TYPE": ("soft", "hard"),
    "MODEL.COMPILE_MODE": ("default", "reduce-overhead", "max-autotune"),
    "DIST.BACKEND": BACKENDS,
    "DIST.MODE": DIST_MODES,
    "DIST.STRATEGY": STRATEGIES,
    "DIST.PIPELINE.SCHEDULE": PIPELINE_SCHEDULES,
    "DIST.DEEPSPEED.ZERO_STAGE": (1, 2, 3),
    "DIST.DEEPSPEED.OFFLOAD_OPTIMIZER": OFFLOADS,
    "DIST.DEEPSPEED.OFFLOAD_PARAMS": OFFLOADS,
    "TRAIN.MIXED_PRECISION": PRECISIONS,
    "TRAIN.RESUME_BATCH": ("global", "per_rank"),
    "DEVICE": DEVICES,
}


def all_keys(node: CfgNode, prefix: str = "") -> list[str]:
    """The dotted name of every value (not section) of ``node``, in tree order."""
    keys = []
    for name, value in node.items():
        full = prefix + name
        if isinstance(value, CfgNode):
            keys += all_keys(value, full + ".")
        else:
            keys.append(full)
    return keys


def get_key(cfg: CfgNode, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg``; KeyError when it has no such key."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node
