"""Validation of a merged cfg: single values, then each section's invariants.

:func:`validate_cfg` runs the checks in a fixed order (the first problem is
the one reported) and raises a ConfigError of one line naming the key, the
value and what is allowed.  Besides values it checks that MODEL.WEIGHTS and
the data folders exist (a stat, nothing opened or written): a cfg that names
missing inputs is refused as soon as it is loaded, also by ``--print-config``.
Reading the files themselves is :mod:`distribuuuu.preflight`'s work.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any

from yacs.config import CfgNode

from distribuuuu.config.keys import CHOICES, RANGES, TRACKERS, get_key
from distribuuuu.errors import ConfigError

# Classes of the data sets with a fixed label set.
_FIXED_CLASSES = {"mnist5k": 10, "mnist5k_pairs": 10, "cifar10": 10, "cifar100": 100}


def resolve_data_name(cfg: CfgNode) -> str:
    """The data set a cfg trains on, with ``auto`` and DUMMY_INPUT resolved."""
    if cfg.MODEL.DUMMY_INPUT:
        return "synthetic"
    if cfg.DATA.NAME == "auto":
        return "imagefolder" if cfg.TRAIN.DATASET else "mnist5k"
    return cfg.DATA.NAME


def is_multi_label(cfg: CfgNode) -> bool:
    """Whether a cfg's samples carry label sets (multi-hot targets): a labels
    file, or the embedded mnist5k_pairs."""
    name = resolve_data_name(cfg)
    return bool(cfg.TRAIN.LABELS_FILE) or name == "mnist5k_pairs"


def progressive_end_epoch(cfg: CfgNode) -> int:
    """TRAIN.PROGRESSIVE.END_EPOCH with 0 resolved to the last epoch."""
    return cfg.TRAIN.PROGRESSIVE.END_EPOCH or cfg.OPTIM.MAX_EPOCH - 1


def largest_train_size(cfg: CfgNode) -> int:
    """The largest training crop: TRAIN.PROGRESSIVE.END_SIZE (0: TRAIN.IM_SIZE)
    when progressive resizing is on, TRAIN.IM_SIZE otherwise; what the
    evaluation crop, the planner and the micro-batch probe take."""
    ramp = cfg.TRAIN.PROGRESSIVE
    return (ramp.START_SIZE and ramp.END_SIZE) or cfg.TRAIN.IM_SIZE


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {value!r} is invalid: {allowed}")


def check_choice(key: str, value: Any, choices: tuple | list) -> None:
    """ConfigError unless ``value`` is one of ``choices`` (naming the closest)."""
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    shown = ", ".join(repr(c) if c == "" else str(c) for c in list(choices)[:12])
    shown += ", ..." if len(choices) > 12 else ""
    raise ConfigError(f"{key} {value!r} is invalid: choose one of {shown}{hint}")


def _validate_values(cfg: CfgNode) -> None:
    """Each key alone: the choices, the ranges (MODEL.ARCH: pre-flight)."""
    for key, choices in CHOICES.items():
        check_choice(key, get_key(cfg, key), choices)
    for key, (test, allowed) in RANGES.items():
        _check(test(get_key(cfg, key)), key, get_key(cfg, key), allowed)


def _validate_optim(cfg: CfgNode) -> None:
    """OPTIM: MIN_LR below BASE_LR, STEPS inside MAX_EPOCH, Nesterov's needs."""
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
        stacklevel=4,  # the caller of validate_cfg
    )
    cfg.DIST.MODE, cfg.DIST.STRATEGY = "ddp", "dp"


def _validate_dist(cfg: CfgNode) -> None:
    """DIST: the deprecated DIST.MODE dp translated; sequence parallelism
    within tensor parallelism (what a strategy takes is pre-flight's)."""
    _translate_dist_mode(cfg)
    _check(
        not cfg.DIST.SEQUENCE_PARALLEL or cfg.DIST.TENSOR_PARALLEL > 1,
        "DIST.SEQUENCE_PARALLEL",
        True,
        "needs DIST.TENSOR_PARALLEL > 1",
    )


def _validate_micro_batch(cfg: CfgNode) -> None:
    """TRAIN.MICRO_BATCH auto: each rank probes a step alone, so nothing in
    the step may be a collective (SyncBN), and the planner, which chooses the
    micro-batch itself, is not asked as well."""
    if cfg.TRAIN.MICRO_BATCH != "auto":
        return
    _check(
        cfg.DIST.STRATEGY != "auto",
        "TRAIN.MICRO_BATCH",
        "auto",
        "cannot be combined with DIST.STRATEGY auto, whose planner chooses "
        "TRAIN.BATCH_SIZE and TRAIN.ACCUM_STEPS itself; use one or the other",
    )
    _check(
        not cfg.MODEL.SYNCBN,
        "TRAIN.MICRO_BATCH",
        "auto",
        "cannot be combined with MODEL.SYNCBN: each rank probes a step on its "
        "own, and a synchronized BatchNorm would wait for the others",
    )


def _validate_test(cfg: CfgNode) -> None:
    """TEST: the evaluation resize holds the evaluation crop."""
    crop = cfg.TEST.CROP_SIZE or largest_train_size(cfg)
    if cfg.TEST.TTA in ("five_crop", "ten_crop"):
        resize = cfg.TEST.IM_SIZE
        if cfg.TEST.CROP_PCT:
            resize = int(crop / cfg.TEST.CROP_PCT)
        _check(
            resize > crop,
            "TEST.TTA",
            cfg.TEST.TTA,
            f"needs an evaluation resize larger than the crop {crop} to cut its "
            f"views from (TEST.IM_SIZE or TEST.CROP_PCT gives {resize})",
        )
    if cfg.TEST.CROP_PCT:
        return
    _check(
        crop <= cfg.TEST.IM_SIZE,
        "TEST.IM_SIZE",
        cfg.TEST.IM_SIZE,
        f"must be >= the evaluation crop {crop} (TEST.CROP_SIZE, or the largest "
        "training crop when it is 0): evaluation resizes to TEST.IM_SIZE, then "
        "centre-crops",
    )


def _validate_distill(cfg: CfgNode) -> None:
    """TRAIN.DISTILL: a teacher's architecture with its weights, and a
    softmax student (its terms compare distributions over the classes)."""
    distill = cfg.TRAIN.DISTILL
    if not (distill.ARCH or distill.WEIGHTS):
        return
    _check(bool(distill.ARCH), "TRAIN.DISTILL.ARCH", "", "must name the teacher")
    _check(
        cfg.MODEL.LOSS == "ce",
        "TRAIN.DISTILL.ARCH",
        distill.ARCH,
        f"distils softmax distributions (KL or argmax), which MODEL.LOSS "
        f"{cfg.MODEL.LOSS} does not train: use MODEL.LOSS ce or no teacher",
    )
    if not os.path.isfile(distill.WEIGHTS):
        raise ConfigError(
            f"TRAIN.DISTILL.WEIGHTS: no such file {distill.WEIGHTS!r} (the "
            "teacher's trained weights)"
        )


def _validate_model(cfg: CfgNode) -> None:
    """MODEL: FINETUNE has WEIGHTS to start from, MODEL.WEIGHTS is a file,
    and ZERO_INIT_RESIDUAL is not asked of pretrained weights."""
    _check(
        not cfg.MODEL.FINETUNE or bool(cfg.MODEL.WEIGHTS),
        "MODEL.FINETUNE",
        True,
        "needs MODEL.WEIGHTS, the checkpoint to fine-tune",
    )
    _check(
        not (cfg.MODEL.ZERO_INIT_RESIDUAL and cfg.MODEL.PRETRAINED),
        "MODEL.ZERO_INIT_RESIDUAL",
        True,
        "would zero layers of the pretrained weights (MODEL.PRETRAINED True); it "
        "is for a fresh initialisation",
    )
    if cfg.MODEL.WEIGHTS and not os.path.isfile(cfg.MODEL.WEIGHTS):
        raise ConfigError(f"MODEL.WEIGHTS: no such file {cfg.MODEL.WEIGHTS}")


def _check_data_paths(cfg: CfgNode, name: str) -> None:
    """The folders data set ``name`` reads exist (CIFAR: unless DATA.DOWNLOAD)."""
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
    elif name == "webdataset":
        for section in ("TRAIN", "TEST"):
            if not cfg[section].DATASET:
                raise ConfigError(
                    f"{section}.DATASET is empty: webdataset needs a pattern of "
                    "shards, e.g. /data/shards/train-{000000..000009}.tar"
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


def _check_index_cache(cfg: CfgNode, name: str) -> None:
    """DATA.INDEX_CACHE: "", none or a path (a stat, nothing written): no
    NUL or line break, not an existing non-folder, a missing folder that can
    be made, and for imagefolder not inside a split, whose folder times its
    files would change.  An existing folder may be read-only: an index
    prepared for the run (a stale one is listed again, not written)."""
    value = cfg.DATA.INDEX_CACHE
    allowed = '"" (OUT_DIR/data_index), none or a folder'
    _check(not any(c in value for c in "\0\n\r"), "DATA.INDEX_CACHE", value, allowed)
    if value in ("", "none"):
        return
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(f"DATA.INDEX_CACHE {value}: exists but is not a folder")
    nearest = os.path.abspath(value)
    while not os.path.exists(nearest):  # a folder to make: can it be made?
        nearest = os.path.dirname(nearest)
    if nearest != os.path.abspath(value) and not os.access(nearest, os.W_OK):
        raise ConfigError(
            f"DATA.INDEX_CACHE {value}: cannot make it ({nearest} is not writable)"
        )
    if name != "imagefolder":
        return
    folder = os.path.realpath(value)
    for section in ("TRAIN", "TEST"):
        split = os.path.realpath(os.path.join(cfg[section].DATASET, cfg[section].SPLIT))
        if os.path.commonpath([folder, split]) == split:
            raise ConfigError(
                f"DATA.INDEX_CACHE {value} is inside {section}.DATASET/"
                f"{section}.SPLIT {split}: its files would change the split's "
                "folders (a class of none); put it outside"
            )


def _validate_data(cfg: CfgNode) -> None:
    """DATA: resolve DATA.NAME in place, after checking its classes and folders."""
    name = resolve_data_name(cfg)
    classes = _FIXED_CLASSES.get(name)
    _check(
        classes is None or classes <= cfg.MODEL.NUM_CLASSES,
        "MODEL.NUM_CLASSES",
        cfg.MODEL.NUM_CLASSES,
        f"{name} has {classes} classes",
    )
    _check(
        name != "webdataset" or cfg.DATA.REPEATED_AUG == 1,
        "DATA.REPEATED_AUG",
        cfg.DATA.REPEATED_AUG,
        "webdataset streams each reader's shards once an epoch; repeated "
        "augmentation needs a sampler (DATA.NAME imagefolder)",
    )
    _check(
        name != "webdataset" or cfg.DATA.SAMPLER == "random",
        "DATA.SAMPLER",
        cfg.DATA.SAMPLER,
        "webdataset streams each reader's shards once an epoch; only random "
        "sampling works with it (DATA.NAME imagefolder samples by class)",
    )
    _check_data_paths(cfg, name)
    _check_index_cache(cfg, name)
    if cfg.DATA.DECODER == "gpu":
        _validate_gpu_decoder(cfg, name)
    cfg.DATA.NAME = name


def _validate_gpu_decoder(cfg: CfgNode, name: str) -> None:
    """DATA.DECODER gpu: image files, a CUDA device, and no augmentation that
    needs the pixels in the loader's workers."""
    _check(
        cfg.DEVICE != "cpu",
        "DATA.DECODER",
        "gpu",
        "decodes on the CUDA device, but DEVICE is cpu; use DATA.DECODER tensor",
    )
    _check(
        name == "imagefolder",
        "DATA.DECODER",
        "gpu",
        f"decodes image files (DATA.NAME imagefolder), but the data set is {name}",
    )
    why = (
        "is not supported with DATA.DECODER gpu (it works on the pixels in the "
        "loader's workers, which hold only JPEG bytes); use DATA.DECODER tensor"
    )
    augment = cfg.DATA.AUTO_AUGMENT
    _check(augment == "none", "DATA.AUTO_AUGMENT", augment, why)
    erasing = cfg.DATA.RANDOM_ERASING
    _check(erasing == 0, "DATA.RANDOM_ERASING", erasing, why)


def _validate_labels(cfg: CfgNode) -> None:
    """Labels files come in pairs, on image folders; label sets need a loss
    that scores each class on its own, and a best metric they report."""
    train, test = cfg.TRAIN.LABELS_FILE, cfg.TEST.LABELS_FILE
    for key, path in (("TRAIN.LABELS_FILE", train), ("TEST.LABELS_FILE", test)):
        _check(bool(train) == bool(test), key, path, "is set alone: set both")
        if path and not os.path.isfile(path):
            raise ConfigError(f"{key}: no such file {path}")
    name = resolve_data_name(cfg)
    _check(
        not train or name == "imagefolder",
        "TRAIN.LABELS_FILE",
        train,
        f"names images of a folder (DATA.NAME imagefolder), not of {name}",
    )
    multi = is_multi_label(cfg)
    _check(
        not multi or cfg.MODEL.LOSS != "ce",
        "MODEL.LOSS",
        "ce",
        "scores one label per image; multi-label data needs bce or asl",
    )
    metric = cfg.CHECKPOINT.BEST_METRIC
    _check(
        metric == "loss" or (metric == "map") == multi,
        "CHECKPOINT.BEST_METRIC",
        metric,
        "multi-label runs report map and loss, not top1"
        if multi
        else "map is reported by multi-label runs only",
    )


def _validate_progressive(cfg: CfgNode) -> None:
    """TRAIN.PROGRESSIVE: a ramp that grows, within the run's epochs."""
    ramp = cfg.TRAIN.PROGRESSIVE
    if not ramp.START_SIZE:
        return
    end_size = largest_train_size(cfg)
    _check(
        ramp.MULTIPLE <= ramp.START_SIZE <= end_size,
        "TRAIN.PROGRESSIVE.START_SIZE",
        ramp.START_SIZE,
        f"must be in [MULTIPLE {ramp.MULTIPLE}, END_SIZE {end_size}]",
    )
    end = progressive_end_epoch(cfg)
    _check(
        ramp.START_EPOCH < end < cfg.OPTIM.MAX_EPOCH,
        "TRAIN.PROGRESSIVE.END_EPOCH",
        ramp.END_EPOCH,
        f"resolves to {end}: must be after START_EPOCH {ramp.START_EPOCH} and "
        f"before OPTIM.MAX_EPOCH {cfg.OPTIM.MAX_EPOCH}",
    )


def _validate_randaugment(cfg: CfgNode) -> None:
    """DATA.RANDAUG_MSTD and DATA.RANDAUG_INC shape RandAugment only."""
    data = cfg.DATA
    for key, value, off in (
        ("MSTD", data.RANDAUG_MSTD, 0),
        ("INC", data.RANDAUG_INC, False),
    ):
        _check(
            value == off or data.AUTO_AUGMENT == "randaugment",
            f"DATA.RANDAUG_{key}",
            value,
            f"shapes RandAugment, but DATA.AUTO_AUGMENT is {data.AUTO_AUGMENT}: "
            "set DATA.AUTO_AUGMENT randaugment",
        )


def _validate_log(cfg: CfgNode) -> None:
    """LOG.TRACKERS: known trackers, each once."""
    trackers = cfg.LOG.TRACKERS
    for name in trackers:
        check_choice("LOG.TRACKERS", name, TRACKERS)
    twice = sorted({name for name in trackers if trackers.count(name) > 1})
    _check(not twice, "LOG.TRACKERS", trackers, f"lists {', '.join(twice)} twice")


def validate_cfg(cfg: CfgNode) -> None:
    """Check values and cross-key invariants; resolve DATA.NAME in place."""
    _validate_values(cfg)
    _validate_optim(cfg)
    _validate_dist(cfg)
    _validate_micro_batch(cfg)
    _validate_test(cfg)
    _validate_model(cfg)
    _validate_distill(cfg)
    _validate_labels(cfg)
    _validate_progressive(cfg)
    _validate_randaugment(cfg)
    _validate_data(cfg)
    _validate_log(cfg)
