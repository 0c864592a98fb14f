"""What the config knows about its keys beyond their defaults, and ConfigError.

The values a key may take (choices and ranges), the keys that may be null or
hold lists, the old names still accepted, and the helpers that walk a cfg by
dotted key (``OPTIM.BASE_LR``).  Shared by loading, validation and the reference.
"""

from __future__ import annotations

import re
from typing import Any

from yacs.config import CfgNode

# Keys whose default is null, with the type they take otherwise.
NULLABLE = {"MODEL.WEIGHTS": str, "RNG_SEED": int}
# Element type of list keys (checked on every element).
LIST_ITEMS = {
    "OPTIM.STEPS": (int, float),
    "OPTIM.BETAS": (int, float),
    "DATA.SYNTHETIC_SIZE": (int,),
    "DIST.PIPELINE.SPLIT": (str,),
    "LOG.TRACKERS": (str,),
}
# Old names still accepted, mapped to the current key with a warning.
RENAMED = {
    "TRAIN.PRINT_FEQ": "TRAIN.PRINT_FREQ",
    "TEST.PRINT_FEQ": "TEST.PRINT_FREQ",
    "TRAIN.CHECKPOINT": "MODEL.WEIGHTS",
}

DATA_NAMES = (
    "auto",
    "mnist5k",
    "mnist5k_pairs",
    "imagefolder",
    "webdataset",
    "cifar10",
    "cifar100",
    "synthetic",
)
LR_POLICIES = ("cos", "steps", "exp", "linear", "onecycle")
OPTIMIZERS = ("sgd", "adamw", "rmsprop", "lamb", "lars")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("", "nccl", "gloo")
DIST_MODES = ("ddp", "dp")
STRATEGIES = ("dp", "ddp", "zero1", "fsdp", "hsdp", "pipeline", "deepspeed")
OFFLOADS = ("none", "cpu", "nvme")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PRECISIONS = ("auto", "none", "bf16", "fp16")
AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")
TRACKERS = ("tensorboard", "mlflow", "wandb", "csv", "jsonl")

# Keys with a fixed set of values.
CHOICES: dict[str, tuple] = {
    "DATA.NAME": DATA_NAMES,
    "DATA.AUTO_AUGMENT": AUTO_AUGMENTS,
    "DATA.DECODER": ("fused", "tensor", "pil", "gpu"),
    "DATA.SAMPLER": ("random", "balanced", "sqrt", "repeat_factor"),
    "OPTIM.LR_POLICY": LR_POLICIES,
    "OPTIM.OPTIMIZER": OPTIMIZERS,
    "OPTIM.LR_STEP": ("iter", "epoch"),
    "TRAIN.INTERPOLATION": ("bilinear", "bicubic"),
    "TEST.INTERPOLATION": ("bilinear", "bicubic"),
    "TEST.TTA": ("none", "flip", "five_crop", "ten_crop"),
    "CHECKPOINT.BEST_METRIC": ("top1", "loss", "map"),
    "MODEL.LOSS": ("ce", "bce", "asl"),
    "TRAIN.DISTILL.TYPE": ("soft", "hard"),
    "MODEL.COMPILE_MODE": ("default", "reduce-overhead", "max-autotune"),
    "DIST.BACKEND": BACKENDS,
    "DIST.MODE": DIST_MODES,
    "DIST.STRATEGY": (*STRATEGIES, "auto"),
    "DIST.PIPELINE.SCHEDULE": PIPELINE_SCHEDULES,
    "DIST.DDP.COMM_HOOK": COMM_HOOKS,
    "DIST.DEEPSPEED.ZERO_STAGE": (1, 2, 3),
    "DIST.DEEPSPEED.OFFLOAD_OPTIMIZER": OFFLOADS,
    "DIST.DEEPSPEED.OFFLOAD_PARAMS": OFFLOADS,
    "TRAIN.MIXED_PRECISION": PRECISIONS,
    "TRAIN.RESUME_BATCH": ("global", "per_rank"),
    "TRAIN.MICRO_BATCH": ("off", "auto"),
    "DEVICE": DEVICES,
    "LOG.WANDB.MODE": ("", "online", "offline", "disabled"),
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


# Longest DIST.INIT_TIMEOUT in seconds (7 days): far beyond any start-up.
MAX_INIT_TIMEOUT = 7 * 24 * 3600
# CFG_DEST: a plain file name in OUT_DIR; no file of a run (log.txt, best.pth,
# checkpoints/, tb/, metrics.jsonl, ...) ends in .yaml, so it cannot name one.
_CFG_DEST = re.compile(r"[\w+-][\w.+-]{0,250}\.ya?ml")

# Checks of single values: key -> (test, what is allowed).


def _at_least(low: float, note: str = "") -> tuple:
    """Values >= ``low``."""
    return (lambda v: v >= low, f"must be >= {low}{note}")


def _within(bounds: str, note: str = "") -> tuple:
    """Values in the interval ``bounds``, written as in the message:
    ``"[0, 1)"`` (a bracket includes its end, a parenthesis leaves it out)."""
    low, high = (float(end) for end in bounds[1:-1].split(","))
    closed_low, closed_high = bounds[0] == "[", bounds[-1] == "]"

    def test(v) -> bool:
        above = v >= low if closed_low else v > low
        return above and (v <= high if closed_high else v < high)

    return (test, f"must be in {bounds}{note}")


RANGES = {
    "MODEL.NUM_CLASSES": _at_least(1),
    "DATA.SYNTHETIC_SIZE": (
        lambda v: len(v) == 2 and min(v) >= 1,
        "must be [train_images, val_images], both >= 1",
    ),
    "TRAIN.BATCH_SIZE": _at_least(1),
    "TRAIN.ACCUM_STEPS": _at_least(1),
    "TRAIN.IM_SIZE": _at_least(1),
    "TRAIN.WORKERS": _at_least(0),
    "TRAIN.PRINT_FREQ": _at_least(1),
    "TRAIN.TOPK": _at_least(1),
    "TRAIN.PROFILE_STEPS": _at_least(0, " steps (0 = off)"),
    "TRAIN.DATA_BOUND_SHARE": _within("[0, 1]", " (0 = off)"),
    "TRAIN.SINGLE_PROCESS_IMG_PER_S": _at_least(0, " (0 = off)"),
    "TRAIN.LABEL_SMOOTHING": _within("[0, 1)"),
    "TRAIN.MIXUP_ALPHA": _at_least(0, " (0 = off)"),
    "TRAIN.CUTMIX_ALPHA": _at_least(0, " (0 = off)"),
    "TRAIN.MIX_PROB": _within("[0, 1]"),
    "TRAIN.MIX_SWITCH_PROB": _within("[0, 1]"),
    "TRAIN.PRECISE_BN": _at_least(0, " batches (0 = off)"),
    "MODEL.EMA_DECAY": _within("[0, 1)"),
    "MODEL.EMA_EVERY": _at_least(1),
    "DATA.RANDAUG_N": _at_least(1),
    "DATA.RANDAUG_M": _within("[0, 30]"),
    "DATA.RANDAUG_MSTD": _within("[0, 30]", " (0 = off)"),
    "DATA.RANDOM_ERASING": _within("[0, 1]", " (0 = off)"),
    "DATA.REPEATED_AUG": _at_least(1, " (1 = off)"),
    "DATA.SHUFFLE_BUFFER": _at_least(1, " (1 = shard order)"),
    "DATA.REPEAT_THRESHOLD": _within("(0, 1]"),
    "DATA.TIMEOUT": _at_least(0, " seconds (0 = off)"),
    "TEST.BATCH_SIZE": _at_least(1),
    "TEST.IM_SIZE": _at_least(1),
    "TEST.PRINT_FREQ": _at_least(1),
    "TEST.THRESHOLD": _within("(0, 1)"),
    "MODEL.BCE_THRESHOLD": _within("[0, 1)", " (0 = off)"),
    "MODEL.ASL_GAMMA_NEG": _at_least(0),
    "MODEL.ASL_GAMMA_POS": _at_least(0),
    "MODEL.ASL_CLIP": _within("[0, 1)", " (0 = off)"),
    "TRAIN.PROGRESSIVE.START_SIZE": _at_least(0, " (0 = off)"),
    "TRAIN.PROGRESSIVE.END_SIZE": _at_least(0, " (0 = TRAIN.IM_SIZE)"),
    "TRAIN.PROGRESSIVE.START_EPOCH": _at_least(0),
    "TRAIN.PROGRESSIVE.END_EPOCH": _at_least(0, " (0 = the last epoch)"),
    "TRAIN.PROGRESSIVE.MULTIPLE": _at_least(1),
    "OPTIM.MAX_EPOCH": _at_least(1),
    "OPTIM.BASE_LR": (lambda v: v > 0, "must be > 0"),
    "OPTIM.LR_MULT": _within("(0, 1]"),
    "OPTIM.LR_GAMMA": _within("(0, 1]"),
    "OPTIM.ONECYCLE_PCT_START": _within("(0, 1)"),
    "OPTIM.ONECYCLE_DIV_FACTOR": _at_least(1),
    "OPTIM.BETAS": (
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "must be [beta1, beta2], both in [0, 1)",
    ),
    "OPTIM.EPS": (lambda v: v > 0, "must be > 0"),
    "TRAIN.HFLIP": (lambda v: v == -1 or 0 <= v <= 1, "must be in [0, 1], or -1"),
    "MODEL.DROPOUT": (lambda v: v == -1 or 0 <= v < 1, "must be in [0, 1), or -1"),
    "MODEL.DROP_PATH": (lambda v: v == -1 or 0 <= v < 1, "must be in [0, 1), or -1"),
    "MODEL.BN_MOMENTUM": (lambda v: v == -1 or 0 <= v <= 1, "must be in [0, 1], or -1"),
    "MODEL.BN_EPS": (lambda v: v == -1 or v > 0, "must be > 0, or -1"),
    "TEST.CROP_SIZE": _at_least(0, " (0 = TRAIN.IM_SIZE)"),
    "TEST.CROP_PCT": (lambda v: 0 <= v <= 1, "must be in (0, 1], or 0 (off)"),
    "OPTIM.RMSPROP_ALPHA": _within("[0, 1)"),
    "OPTIM.LAYER_DECAY": _within("(0, 1]", " (1 = off)"),
    "OPTIM.LARS_ETA": (lambda v: v > 0, "must be > 0"),
    "OPTIM.REFERENCE_BATCH": _at_least(0, " (0 = off)"),
    "LOG.CLOSE_TIMEOUT": _at_least(0, " seconds"),
    "LOG.GRAD_SPIKE": _at_least(0, " (0 = off)"),
    "LOG.STRAGGLER_RATIO": (lambda v: v == 0 or v > 1, "must be > 1, or 0 = off"),
    "OPTIM.MOMENTUM": _within("[0, 1)"),
    "OPTIM.DAMPENING": _within("[0, 1]"),
    "OPTIM.WARMUP_FACTOR": _within("(0, 1]"),
    "OPTIM.WARMUP_EPOCHS": _at_least(0),
    "OPTIM.WEIGHT_DECAY": _at_least(0),
    "OPTIM.CLIP_GRAD_NORM": _at_least(0, " (0 = off)"),
    "DIST.INIT_TIMEOUT": (
        lambda v: 0 < v <= MAX_INIT_TIMEOUT,
        f"must be in (0, {MAX_INIT_TIMEOUT}] seconds (7 days)",
    ),
    "DIST.TENSOR_PARALLEL": _at_least(1, " (1 = off)"),
    "DIST.HSDP.SHARD_SIZE": _at_least(0, " (0 = the processes per node)"),
    "DIST.STOP_CHECK_STEPS": _at_least(1),
    "DIST.PIPELINE.STAGES": _at_least(2),
    "DIST.DDP.POWERSGD_RANK": _at_least(1),
    "DIST.DDP.POWERSGD_START_ITER": _at_least(2),
    "DIST.AUTO.HEADROOM": _within("(0, 1]"),
    "DIST.PIPELINE.MICROBATCHES": _at_least(0, " (0 = 2 x STAGES)"),
    "DIST.PIPELINE.VIRTUAL_STAGES": _at_least(1),
    "CHECKPOINT.PERIOD": _at_least(1),
    "CHECKPOINT.KEEP": _at_least(0, " (0 keeps all)"),
    "CHECKPOINT.KEEP_BEST": _at_least(0),
    "TRAIN.DISTILL.TAU": (lambda v: v > 0, "must be > 0"),
    "TRAIN.DISTILL.ALPHA": _within("[0, 1]"),
    "CHECKPOINT.PERIOD_ITERS": _at_least(0, " (0 = off)"),
    "OUT_DIR": (bool, "must name a directory"),
    "CFG_DEST": (
        lambda v: bool(_CFG_DEST.fullmatch(v)),
        "must be a plain file name ending in .yaml or .yml (such as config.yaml), "
        "which no other file of the run has",
    ),
    "RNG_SEED": (lambda v: v is None or 0 <= v < 2**32, "must be in [0, 2**32)"),
}
