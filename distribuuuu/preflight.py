"""Every check made before a run writes anything, each raising a ConfigError.

``tools/train_net.py`` runs them after the config is loaded and validated:
the launch (srun forgotten, CUDA asked for but absent, more processes than
GPUs), the inputs the cfg names (data folders, MODEL.WEIGHTS, checkpoints
already in OUT_DIR), the packages of LOG.TRACKERS, the batch against the
training images, and OUT_DIR itself (:mod:`distribuuuu.engine.out_dir`: not
the root of the file system, created and proved writable, and, for
training, locked by rank 0 for the run: :mod:`distribuuuu.engine.run_lock`).
An unusable input thus ends the run with exit code 2 and one line, before
any file is written.

In a launched job of several processes rank 0 alone checks the data (one
walk of an image folder for every rank) and takes the lock; its refusal is
told to every rank once they joined the process group
(:mod:`distribuuuu.dist.refusal`), so that all exit 2 together.

torch and the modules that import it are imported inside the checks that
need them, so that a run refused early starts fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from yacs.config import CfgNode

from distribuuuu.cli import is_rank_zero
from distribuuuu.config import load_cfg
from distribuuuu.config.validation import check_choice, largest_train_size
from distribuuuu.dist import refusal
from distribuuuu.engine import out_dir, run_lock
from distribuuuu.errors import ConfigError, DeferredRefusalError, OutDirInUseError
from distribuuuu.job import is_launched

if TYPE_CHECKING:  # torch only for the annotations: imported where it is used
    from torch import nn


def _model_skeleton(arch: str, num_classes: int) -> nn.Module:
    """Model ``arch`` on the meta device (no memory, no init) or, failing that, CPU."""
    import torch

    from distribuuuu.models import build_model

    try:
        with torch.device("meta"):
            return build_model(arch, num_classes)
    except Exception:  # a constructor that needs real values; build it for real
        return build_model(arch, num_classes)


def check_weights(
    path: str,
    arch: str,
    num_classes: int,
    finetune: bool = False,
    key: str = "MODEL.WEIGHTS",
) -> None:
    """Load the weights of ``key`` safely and match them to the model; raise
    ConfigError.

    With ``finetune`` a classifier head of another size matches (it is
    re-initialised).
    """
    from distribuuuu import checkpoint as cp
    from distribuuuu.errors import CheckpointError
    from distribuuuu.inference.read import read_checkpoint

    try:
        weights = read_checkpoint(path).weights
    except CheckpointError as error:
        raise ConfigError(f"{key} {error}") from error
    model = _model_skeleton(arch, num_classes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # copies into meta tensors are no-ops
            classes = num_classes if finetune else None
            cp.load_model_weights(model, weights, path, finetune_classes=classes)
    except ValueError as error:
        raise ConfigError(f"{key} {error}") from error


def check_launch(cfg: CfgNode, num_procs: int = 1) -> None:
    """Refuse a launch that cannot work (srun forgotten in a batch script,
    DEVICE cuda without CUDA, more processes on a node than GPUs for them;
    ``num_procs``: --num-procs); raise ConfigError."""
    import torch

    from distribuuuu.dist.group import detect_launch, gpu_index
    from distribuuuu.engine.specs import strategy_spec
    from distribuuuu.errors import LaunchError
    from distribuuuu.strategies import strategy_class

    if cfg.DEVICE == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "DEVICE cuda, but CUDA is not available to this process (torch "
            f"{torch.__version__}); set DEVICE auto or cpu"
        )
    if cfg.DATA.DECODER == "gpu" and not torch.cuda.is_available():
        raise ConfigError(
            "DATA.DECODER gpu decodes on a CUDA device, but CUDA is not available "
            f"to this process (DEVICE {cfg.DEVICE}); use DATA.DECODER tensor"
        )
    try:
        info = detect_launch()
        on_gpus = cfg.DEVICE != "cpu" and torch.cuda.is_available()
        one_each = strategy_class(strategy_spec(cfg).name).one_device_per_process
        if on_gpus and one_each:
            local_world = num_procs if num_procs > 1 else info.local_world_size
            gpus = torch.cuda.device_count()
            gpu_index(info.local_rank, local_world, gpus, info.node_gpus)
    except LaunchError as error:
        raise ConfigError(str(error)) from error


def check_layout(cfg: CfgNode, world_size: int) -> None:
    """Refuse a way of spreading the model that cannot work on ``world_size``
    processes (a pipeline that cannot be cut as asked, HSDP's shard groups
    not dividing the world); raise ConfigError."""
    import torch

    from distribuuuu.dist.group import detect_launch
    from distribuuuu.engine.specs import strategy_spec
    from distribuuuu.strategies.chain import check_layout as check_steps

    def skeleton() -> nn.Module:
        return _model_skeleton(cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES)

    on_gpu = cfg.DEVICE != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda:0" if on_gpu else "cpu")  # as a rank will pick
    # The processes on this node: --num-procs starts all of them here.
    local = detect_launch().local_world_size if is_launched() else world_size
    spec = dataclasses.replace(strategy_spec(cfg, device), local_world_size=local)
    try:
        check_steps(spec, world_size, skeleton)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def check_strategy(cfg: CfgNode) -> None:
    """Refuse what the chosen strategy (and tensor parallelism) does not
    take, as its class declares it; raise ConfigError."""
    from distribuuuu.engine.specs import strategy_spec, turned_on
    from distribuuuu.strategies.chain import check_choices as check_steps

    try:
        check_steps(strategy_spec(cfg), turned_on(cfg))
    except ValueError as error:
        raise ConfigError(str(error)) from error


def check_arch(key: str, arch: str) -> None:
    """``arch`` is a name the model registry builds; without timm, a name
    that may be timm's names the extra that installs it."""
    from distribuuuu.models import TIMM_EXTRA, is_model, list_models, timm_installed

    if is_model(arch):
        return
    if not timm_installed():
        close = difflib.get_close_matches(arch, list_models(), n=1)
        hint = f"; or did you mean {close[0]}?" if close else ""
        raise ConfigError(
            f"{key} {arch!r} is not a distribuuuu or torchvision model, and timm, "
            f"which may have it, is not installed: {TIMM_EXTRA}{hint}"
        )
    check_choice(key, arch, list_models())


def check_input_size(cfg: CfgNode) -> None:
    """An input no larger than the model covers (botnet50's position
    encodings)."""
    if cfg.MODEL.ARCH != "botnet50":
        return
    from distribuuuu.models.botnet import MAX_INPUT_SIZE

    size = max(largest_train_size(cfg), cfg.TEST.CROP_SIZE)
    if size > MAX_INPUT_SIZE:
        key = "TEST.CROP_SIZE" if size == cfg.TEST.CROP_SIZE else "TRAIN.IM_SIZE"
        if key == "TRAIN.IM_SIZE" and size != cfg.TRAIN.IM_SIZE:
            key = "TRAIN.PROGRESSIVE.END_SIZE"
        raise ConfigError(
            f"{key} {size!r} is invalid: botnet50's position encodings cover "
            f"inputs up to {MAX_INPUT_SIZE} px"
        )


def check_choices(cfg: CfgNode) -> None:
    """What config/ cannot check, since the registries sit above it: the
    models named exist and fit the input; the strategy takes what is asked."""
    check_arch("MODEL.ARCH", cfg.MODEL.ARCH)
    if cfg.TRAIN.DISTILL.ARCH:
        check_arch("TRAIN.DISTILL.ARCH", cfg.TRAIN.DISTILL.ARCH)
    check_input_size(cfg)
    check_strategy(cfg)


def load_checked_cfg(
    cfg_file: str | None = None, opts: list[str] | None = None
) -> CfgNode:
    """:func:`~distribuuuu.config.load_cfg` and :func:`check_choices`: the
    config a run accepts (what ``train_net.py --print-config`` checks)."""
    cfg = load_cfg(cfg_file, opts)
    check_choices(cfg)
    return cfg


def check_model(cfg: CfgNode) -> None:
    """Refuse a model key that the model has nothing for; raise ConfigError."""
    import torch

    from distribuuuu.engine.specs import model_spec
    from distribuuuu.models import build_configured, zero_init_residual
    from distribuuuu.models.layers import layer_ids

    keys = cfg.MODEL
    values = (keys.DROPOUT, keys.DROP_PATH, keys.BN_MOMENTUM, keys.BN_EPS)
    layered = cfg.OPTIM.LAYER_DECAY < 1
    if not (keys.ZERO_INIT_RESIDUAL or layered or max(values) >= 0):
        return
    # The layers are there without the weights.
    spec = dataclasses.replace(model_spec(cfg), pretrained=False)
    try:
        with torch.device("meta"):
            model = build_configured(spec)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if layered and layer_ids(model) is None:
        raise ConfigError(
            f"OPTIM.LAYER_DECAY: {cfg.MODEL.ARCH} has no layer ids (ViTs and "
            "ConvNeXt have); set it to 1 (off)"
        )
    if cfg.MODEL.ZERO_INIT_RESIDUAL and not zero_init_residual(model):
        raise ConfigError(
            f"MODEL.ZERO_INIT_RESIDUAL: {cfg.MODEL.ARCH} has no residual block "
            "whose last BatchNorm it could zero (ResNets: torchvision's, the "
            "small ones, timm's)"
        )


# Training images of the data sets of a fixed size.
_TRAIN_IMAGES = {
    "mnist5k": 4000,
    "mnist5k_pairs": 4000,
    "cifar10": 50_000,
    "cifar100": 50_000,
}


def check_trackers(cfg: CfgNode) -> None:
    """The packages of LOG.TRACKERS import (mlflow, wandb)."""
    from distribuuuu.reporting.trackers import missing_package

    missing = missing_package(cfg.LOG.TRACKERS)
    if missing:
        raise ConfigError(missing)


def check_batch_fits(cfg: CfgNode, world_size: int) -> None:
    """Refuse a step larger than each process's share of the training images.

    A step is TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS images; each of
    ``world_size`` processes gets its share of the training set.  Raises
    ConfigError.
    """
    from distribuuuu.data import count_images, count_shard_samples
    from distribuuuu.data.labels_files import read_labels_file

    step = cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS
    name, where = cfg.DATA.NAME, ""
    if name == "synthetic":
        images = cfg.DATA.SYNTHETIC_SIZE[0]
    elif name == "imagefolder" and cfg.TRAIN.LABELS_FILE:  # the rows it lists
        images = len(read_labels_file(cfg.TRAIN.LABELS_FILE, "TRAIN.LABELS_FILE"))
        where = f" in {cfg.TRAIN.LABELS_FILE}"
    elif name == "imagefolder":
        root = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
        images, where = count_images(root, step * world_size), f" in {root}"
    elif name == "webdataset":
        images = count_shard_samples(cfg.TRAIN.DATASET)
        where = f" in {cfg.TRAIN.DATASET}"
    else:
        images = _TRAIN_IMAGES[name]
    per_process = -(-images // world_size)  # the sampler pads to the world size
    if name == "webdataset":  # whole steps only, on every process
        per_process = images // world_size
    if per_process < step:
        each = "the one process"
        if world_size > 1:
            each = f"each of the {world_size} processes"
        raise ConfigError(
            f"TRAIN.BATCH_SIZE {cfg.TRAIN.BATCH_SIZE} x TRAIN.ACCUM_STEPS "
            f"{cfg.TRAIN.ACCUM_STEPS}: a step of {step} images, more than the "
            f"{per_process} training images of {each} ({images} in all{where}); "
            "lower TRAIN.BATCH_SIZE"
        )


def _replicas(cfg: CfgNode, world_size: int) -> int:
    """The data-parallel replicas (the readers of the data) of ``world_size``
    processes under the run's strategy."""
    from distribuuuu.engine.specs import strategy_spec
    from distribuuuu.strategies import strategy_class

    spec = strategy_spec(cfg)
    return strategy_class(spec.name).replicas(spec, world_size)


def rank_zero_checks_for_all(world_size: int) -> bool:
    """True in a rank of a launched job of ``world_size`` > 1 processes,
    where rank 0 checks the data (:func:`check_data_once`) and OUT_DIR's lock
    for every rank."""
    return world_size > 1 and is_launched()


def check_data_once(check: Callable[[], None], world_size: int) -> None:
    """Run ``check``, a check of the data (the folders, the batch against
    the images), here; in a launched job of ``world_size`` > 1 processes on
    rank 0 alone, which keeps its refusal until every rank can be told
    (:func:`~distribuuuu.dist.refusal.agree_inputs_usable`): one walk of an
    image folder, not one per rank, and no rank waits for one that exited."""
    if not rank_zero_checks_for_all(world_size):
        check()
        return
    if not is_rank_zero() or refusal.deferred_refusal() is not None:
        return
    try:
        check()
    except ConfigError as error:
        refusal.defer_refusal(DeferredRefusalError(str(error)))


def _check_data(cfg: CfgNode, eval_only: bool, world_size: int) -> None:
    """The data folders or shards of ``cfg`` (:func:`distribuuuu.data.check_data`)."""
    from distribuuuu.data import check_data
    from distribuuuu.engine.specs import data_spec
    from distribuuuu.errors import DataError

    try:
        readers = None
        if cfg.DATA.NAME == "webdataset" and not eval_only:
            readers = _replicas(cfg, world_size)
        check_data(data_spec(cfg), readers, workers=cfg.TRAIN.WORKERS)
    except DataError as error:
        raise ConfigError(str(error)) from error


def check_inputs(
    cfg: CfgNode,
    keep_out_dir: bool = True,
    eval_only: bool = False,
    world_size: int = 1,
    dry_run: bool = False,
) -> None:
    """Check what ``cfg`` names, before anything is written; raise ConfigError.

    OUT_DIR not the root of the file system, the data folders (on rank 0
    alone in a launched job: :func:`check_data_once`), MODEL.WEIGHTS (whose
    head must fit when ``eval_only``, MODEL.FINETUNE or not), then OUT_DIR
    (created, probed writable; removed again unless ``keep_out_dir`` when
    this created it) and, for training, what :func:`check_training_out_dir`
    checks with ``world_size`` processes.  A later refusal of rank 0 raises
    the data's refusal that it kept, as one process would have.
    """
    out_dir.check_out_dir_path(cfg.OUT_DIR)
    check_data_once(lambda: _check_data(cfg, eval_only, world_size), world_size)
    try:
        if cfg.MODEL.WEIGHTS:
            finetune = cfg.MODEL.FINETUNE and not eval_only
            check_weights(
                cfg.MODEL.WEIGHTS, cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES, finetune
            )
        distill = cfg.TRAIN.DISTILL
        if distill.ARCH and not eval_only:
            check_weights(distill.WEIGHTS, distill.ARCH, cfg.MODEL.NUM_CLASSES,
                          key="TRAIN.DISTILL.WEIGHTS")  # fmt: skip
        created = out_dir.missing_dirs(cfg.OUT_DIR) if keep_out_dir else []
        if rank_zero_checks_for_all(world_size):
            refusal.undo_on_refusal(lambda: out_dir.remove_dirs(created))
        if eval_only:
            out_dir.check_out_dir(cfg.OUT_DIR, keep_out_dir)
        else:
            check_training_out_dir(cfg, world_size, keep_out_dir, dry_run)
    except ConfigError as error:
        kept = refusal.deferred_refusal()
        if kept is None:
            raise
        raise kept from error


def check_training_out_dir(
    cfg: CfgNode, world_size: int, keep: bool = True, dry_run: bool = False
) -> None:
    """The batch against the training images (unless a checkpoint, whose
    batch wins, may be resumed; on rank 0 alone in a launched job), OUT_DIR
    (see :func:`~distribuuuu.engine.out_dir.check_out_dir`), its lock (taken
    by rank 0 for the run, not for ``dry_run``), then the checkpoints of an
    earlier run in it; raise ConfigError."""
    checkpoints, _ = out_dir.checkpoints_in(cfg.OUT_DIR)
    if not (checkpoints and cfg.TRAIN.AUTO_RESUME):
        replicas = _replicas(cfg, world_size)
        check_data_once(lambda: check_batch_fits(cfg, replicas), world_size)
    created = out_dir.missing_dirs(cfg.OUT_DIR)
    out_dir.check_out_dir(cfg.OUT_DIR, keep)
    # The lock before the checks that read the checkpoints in OUT_DIR: none
    # of a live run is read (nor resumed from, later) by a second one.
    lock = None
    try:
        if not dry_run:
            lock = claim_out_dir(cfg.OUT_DIR, world_size)
        out_dir.check_previous_run(cfg.OUT_DIR, cfg.TRAIN.AUTO_RESUME, dry_run)
    except BaseException:  # refused (or stopped): leave OUT_DIR as it was
        run_lock.release_out_dir(lock)
        out_dir.remove_dirs(created if keep else [])
        raise
    run_lock.record_holder(lock)
    if rank_zero_checks_for_all(world_size):
        refusal.undo_on_refusal(lambda: run_lock.release_out_dir(lock), release=True)


def claim_out_dir(out_dir_path: str, world_size: int) -> run_lock.RunLock | None:
    """On rank 0, take the lock of the existing ``out_dir_path`` for this run.

    A refusal raises OutDirInUseError (ConfigError: a lock file that cannot
    be locked), except on rank 0 of a launched job of ``world_size`` > 1
    processes: there it waits for the process group, so that every rank exits
    2 (:func:`~distribuuuu.dist.refusal.agree_inputs_usable`).  None on the
    other ranks and where the file system cannot lock.
    """
    if not is_rank_zero():
        return None
    try:
        return run_lock.lock_out_dir(out_dir_path)
    except ConfigError as error:
        if not rank_zero_checks_for_all(world_size):
            raise
        in_use = isinstance(error, OutDirInUseError)
        refusal.defer_refusal(error if in_use else DeferredRefusalError(str(error)))
        return None
