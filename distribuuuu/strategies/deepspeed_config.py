"""The DeepSpeed config of a run: generated from our keys, with a user's
``ds_config.json`` merged over it.

Our keys stay the one source of the batch, accumulation, clipping, precision
and ZeRO settings: the json may add what we have no key for (bucket sizes,
``overlap_comm``, ...), and a value in it that says otherwise than one of our
keys is refused, naming both.  This module never imports DeepSpeed.

The json's top-level sections are allow-listed: those of our generated config
and a few that tune communication, asynchronous I/O and timing reports, none of
which names a file.  An allow-list, rather than a refusal of path-valued keys
outside OUT_DIR, because DeepSpeed's other sections act beyond the engine's
arithmetic in ways a path check cannot see: the flops profiler and the
monitors (tensorboard, wandb, csv_monitor, comet) write where their keys say
or, by default, under the current directory; ``checkpoint`` changes how
checkpoints are written and read (its universal loading unpickles files by
itself); autotuning, elasticity and compile change the run itself.  A check of
paths would have to know every path-valued key of every DeepSpeed version, and
a new one would slip through; an allow-list refuses what it does not know.
"""

from __future__ import annotations

import json
import os
from typing import Any

from distribuuuu.strategies.spec import DeepSpeedSpec, StrategySpec

# The largest ds_config.json read (a DeepSpeed config is a few KiB).
MAX_JSON_BYTES = 1 << 20
# Where the merged config is written, beside config.yaml.
DS_CONFIG_FILE = "ds_config.json"
# Top-level sections a user's json may bring beside those of our generated
# config: they tune communication, asynchronous I/O (nvme offload) and the
# engine's timing reports (in our log), and name no file (the one path among
# the allowed sections, an offload's nvme_path, is used only by an nvme
# offload, whose path DIST.DEEPSPEED.NVME_PATH sets and the json may not change).
_EXTRA_SECTIONS = (
    "aio",
    "communication_data_type",
    "gradient_predivide_factor",
    "memory_breakdown",
    "prescale_gradients",
    "wall_clock_breakdown",
)
# Sections our own code drives: a user's json may not bring its own.
_OURS = {
    "optimizer": "OPTIM.* (our optimizer builder drives DeepSpeed's engine)",
    "scheduler": "OPTIM.LR_POLICY (our LR schedule drives DeepSpeed's engine)",
}


def _offload(device: str, nvme_path: str) -> dict:
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def _precision(name: str) -> dict:
    """The precision sections for TRAIN.MIXED_PRECISION ``name``: bf16 is
    torch's autocast over fp32 weights (``torch_autocast``), as under our other
    strategies.  DeepSpeed's own bf16 and fp16 modes stay off: they cast the
    parameters but not the buffers (BatchNorm then meets bf16 weights beside
    fp32 running statistics and fails), and an EMA of bf16 parameters would be
    kept in bf16, where a small step rounds away.  fp16 is refused (the
    strategy declares it, pre-flight asks): under torch autocast DeepSpeed 0.19.8's
    ZeRO takes the norm of, clips and checks for overflow the gradients still
    scaled by the GradScaler, and skips an overflowing step without lowering
    the scale (on the CPU, ZeRO-2 skipped every step of a linear layer)."""
    autocast: dict[str, Any] = {"enabled": name == "bf16"}
    if name == "bf16":
        autocast["dtype"] = "bfloat16"
    return {
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "torch_autocast": autocast,
    }


def generated_config(spec: StrategySpec, world_size: int) -> dict:
    """The DeepSpeed config that our keys give, for ``world_size`` processes."""
    ds = spec.deepspeed
    # The offload sections are always there ("device": "none" when off), so
    # that a json turning one on contradicts the key that says off.
    zero = {
        "stage": ds.zero_stage,
        "offload_optimizer": _offload(ds.offload_optimizer, ds.nvme_path),
        "offload_param": _offload(ds.offload_params, ds.nvme_path),
    }
    micro, accum = spec.batch_size, spec.accum_steps
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "gradient_clipping": float(spec.clip_grad_norm),
        **_precision(spec.precision),
        "zero_optimization": zero,
        # Our optimizers (SGD, AdamW) are torch's, not DeepSpeed's fused ones,
        # offloaded too (DeepSpeed's CPU Adam would change the update).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # Our log reports the steps; DeepSpeed's own print would repeat them.
        "steps_per_print": 2**31 - 1,
    }


# The keys of ours that each generated value comes from, for the messages.
_SOURCES = {
    "train_micro_batch_size_per_gpu": "TRAIN.BATCH_SIZE",
    "gradient_accumulation_steps": "TRAIN.ACCUM_STEPS",
    "train_batch_size": "TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS x processes",
    "gradient_clipping": "OPTIM.CLIP_GRAD_NORM",
    "bf16": "TRAIN.MIXED_PRECISION",
    "fp16": "TRAIN.MIXED_PRECISION",
    "torch_autocast": "TRAIN.MIXED_PRECISION",
    "zero_optimization.stage": "DIST.DEEPSPEED.ZERO_STAGE",
    "zero_optimization.offload_optimizer": "DIST.DEEPSPEED.OFFLOAD_OPTIMIZER",
    "zero_optimization.offload_param": "DIST.DEEPSPEED.OFFLOAD_PARAMS",
}


def _source(path: str) -> str:
    for prefix, key in _SOURCES.items():
        if path == prefix or path.startswith(prefix + "."):
            if "nvme_path" in path:
                return "DIST.DEEPSPEED.NVME_PATH"
            return key
    return "our generated config"


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return ours is theirs
    return ours == theirs  # 1 == 1.0: json writes a clipping of 1 either way


def _check_section(key: str, ours: dict) -> None:
    """ValueError unless a user's json may hold top-level section ``key``
    beside our generated config ``ours``."""
    if key in _OURS:
        raise ValueError(
            f"DIST.DEEPSPEED.CONFIG: its {key!r} section contradicts "
            f"{_OURS[key]}; remove it from the json"
        )
    if key not in ours and key not in _EXTRA_SECTIONS:
        allowed = ", ".join(sorted({*ours, *_EXTRA_SECTIONS}))
        raise ValueError(
            f"DIST.DEEPSPEED.CONFIG: its {key[:80]!r} section is not passed to "
            "DeepSpeed (sections such as the profiler's and the monitors' "
            f"write files of their own); remove it. Allowed: {allowed}"
        )


def merge(ours: dict, theirs: dict, path: str = "") -> dict:
    """``theirs`` merged over ``ours``; ValueError where a value of ``theirs``
    differs from one ``ours`` sets (the message names both), or where it
    brings a top-level section that is not allowed."""
    merged = dict(ours)
    for key, value in theirs.items():
        where = f"{path}{key}"
        if not path:
            _check_section(key, ours)
        if key not in ours:
            merged[key] = value
        elif isinstance(ours[key], dict) and isinstance(value, dict):
            merged[key] = merge(ours[key], value, where + ".")
        elif not _same(ours[key], value):
            raise ValueError(
                f"DIST.DEEPSPEED.CONFIG: {where} {json.dumps(value)} contradicts "
                f"{_source(where)} (which gives {json.dumps(ours[key])}); set it "
                "in one place only"
            )
    return merged


def read_user_config(path: str) -> dict:
    """The JSON object of a user's ds_config.json; ValueError naming what is
    wrong with it (missing, too large, not JSON, not an object)."""
    where = f"DIST.DEEPSPEED.CONFIG {path}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise ValueError(f"{where}: larger than {MAX_JSON_BYTES >> 10} KiB")
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: not JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{where}: must hold a JSON object, not {type(loaded).__name__}"
        )
    return loaded


def run_config(spec: StrategySpec, world_size: int) -> dict:
    """The config the engine runs with: ours, the user's json merged over it."""
    ours = generated_config(spec, world_size)
    if not spec.deepspeed.config:
        return ours
    return merge(ours, read_user_config(spec.deepspeed.config))


def check_nvme(ds: DeepSpeedSpec) -> None:
    """ValueError unless an ``nvme`` offload has a writable DIST.DEEPSPEED.NVME_PATH."""
    if "nvme" not in (ds.offload_optimizer, ds.offload_params):
        return
    if not ds.nvme_path:
        raise ValueError(
            "DIST.DEEPSPEED offload to nvme needs DIST.DEEPSPEED.NVME_PATH, a "
            "writable directory on the fast disk"
        )
    if not (os.path.isdir(ds.nvme_path) and os.access(ds.nvme_path, os.W_OK | os.X_OK)):
        raise ValueError(
            f"DIST.DEEPSPEED.NVME_PATH {ds.nvme_path!r} is not a writable directory"
        )
