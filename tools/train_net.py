#!/usr/bin/env python3
"""Train or evaluate an image classifier: the single entry point of distribuuuu.

    python tools/train_net.py [--cfg FILE] [--eval-only | --dry-run] [KEY VALUE ...]
    python tools/train_net.py [--cfg FILE] --print-config [KEY VALUE ...]
    python tools/train_net.py --help-config

Runs as one process, under torchrun / ``python -m torch.distributed.launch``,
or as a Slurm task under srun; see README.md.  Without ``--cfg`` it trains the
embedded default (a small ResNet on 5,000 real MNIST digits).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import traceback

from distribuuuu.config import ConfigError, check_out_dir, format_cfg, load_cfg
from distribuuuu.logger import PACKAGE_LOGGER

EXIT_CODES = """exit codes:
  0    done
  1    the run failed (an unreadable image, a lost peer, a loss or weights that
       became NaN/inf, a full disk, any other error); the full traceback is in
       OUT_DIR/log.txt (log_rank{N}.txt) once logging has started, and on
       stderr with --debug
  2    unusable config or input, found before anything is written: the config
       file, a key or value, the data folders, MODEL.WEIGHTS or a checkpoint in
       OUT_DIR (missing, of another architecture, or refused: it holds pickled
       code or points outside its folder), OUT_DIR (not writable, disk full,
       holding another run with TRAIN.AUTO_RESUME False) or the launch (srun
       forgotten, DEVICE cuda without CUDA, more processes on a node than
       visible GPUs)
  130  interrupted (Ctrl-C); 128+N: stopped by signal N (after saving a
       checkpoint, once training has started)
every error ends with one line on stderr that starts with "error: "."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="train_net.py",
        description="Train (or evaluate) an image classifier with distribuuuu.",
        epilog="example: train_net.py --cfg config/resnet18.yaml OUT_DIR /tmp/r18 "
        "TRAIN.BATCH_SIZE 64\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cfg", dest="cfg_file", help="yaml config file")
    parser.add_argument(
        "--num-procs",
        type=int,
        default=1,
        metavar="N",
        help="start N local processes (torch.multiprocessing) instead of using "
        "torchrun; they share this machine's CPUs or GPUs",
    )
    parser.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate MODEL.WEIGHTS (or OUT_DIR/best.pth) and print top-1/top-k",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build data, model and optimizer, run one training step and one "
        "evaluation batch on every rank, then exit 0; writes nothing",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged, validated config (non-default values marked) and exit",
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="print every config key with its default and description, and exit",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, also print the full traceback (before the error line)",
    )
    # Passed by the deprecated torch.distributed.launch (as --local-rank=N in
    # torch 2.x, --local_rank N before); LOCAL_RANK in the environment wins.
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "opts",
        nargs=argparse.REMAINDER,
        help="KEY VALUE pairs overriding the config, e.g. OPTIM.BASE_LR 0.2",
    )
    return parser.parse_args(argv)


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _launched() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def _run_rank(cfg, eval_only: bool, dry_run: bool = False) -> None:
    """Train or evaluate ``cfg`` in this process (one rank of the job)."""
    from distribuuuu import trainer  # imports torch: after the config checks

    if dry_run:
        trainer.dry_run(cfg)
        return
    if not eval_only:
        stats = trainer.train_model(cfg)
        if "stopped_by" in stats:  # SIGTERM/SIGUSR1: saved, not finished
            # srun --kill-on-bad-exit answers the first rank to exit with a
            # SIGTERM to the others: let them exit 128+N all the same.
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(signum, signal.SIG_IGN)
            raise SystemExit(128 + stats["stopped_by"])
        return
    from distribuuuu.evaluation import evaluate_checkpoint

    stats = evaluate_checkpoint(cfg)
    if _is_rank_zero():
        k = stats["topk_k"]
        print(
            f"top1 {stats['top1']:.2f}  top{k} {stats['topk']:.2f}  "
            f"loss {stats['loss']:.4f}  samples {stats['samples']}"
        )


def run(cfg, eval_only: bool, dry_run: bool = False) -> None:
    """:func:`_run_rank`, writing a failure's traceback to this rank's log file.

    A collective that timed out or lost a peer is told as a PeerLostError that
    names DIST.INIT_TIMEOUT and the ranks that did not answer.  A run that
    finished releases its process groups before the interpreter exits (not
    one that failed: a peer may still hang in a collective).
    """
    from distribuuuu.distributed import release_groups
    from distribuuuu.peers import peer_failure

    try:
        _run_rank(cfg, eval_only, dry_run)
    except Exception as error:
        lost = peer_failure(error)
        _log_traceback(lost or error)
        if lost is not None:
            raise lost from error
        raise
    release_groups()


def _log_traceback(error: Exception) -> None:
    """Write ``error`` and its traceback to the log files, not to the console."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    record = logger.makeRecord(
        logger.name,
        logging.ERROR,
        __file__,
        0,
        "the run failed: %s",
        (describe_error(error),),
        (type(error), error, error.__traceback__),
    )
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _model_skeleton(arch: str, num_classes: int):
    """Model ``arch`` on the meta device (no memory, no init) or, failing that, CPU."""
    import torch

    from distribuuuu.models import build_model

    try:
        with torch.device("meta"):
            return build_model(arch, num_classes)
    except Exception:  # a constructor that needs real values; build it for real
        return build_model(arch, num_classes)


def check_weights(
    path: str, arch: str, num_classes: int, finetune: bool = False
) -> None:
    """Load MODEL.WEIGHTS safely and match it to the model; raise ConfigError.

    With ``finetune`` a classifier head of another size matches (it is
    re-initialised).
    """
    import warnings

    from distribuuuu import checkpoint as cp
    from distribuuuu.inference import CheckpointError, read_checkpoint

    try:
        weights = read_checkpoint(path).weights
    except CheckpointError as error:
        raise ConfigError(f"MODEL.WEIGHTS {error}") from error
    model = _model_skeleton(arch, num_classes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # copies into meta tensors are no-ops
            classes = num_classes if finetune else None
            cp.load_model_weights(model, weights, path, finetune_classes=classes)
    except ValueError as error:
        raise ConfigError(f"MODEL.WEIGHTS {error}") from error


def check_launch(cfg, num_procs: int = 1) -> None:
    """Refuse a launch that cannot work: srun forgotten in a batch script,
    DEVICE cuda without CUDA, or more processes on a node than GPUs for them
    (``num_procs``: --num-procs)."""
    import torch

    from distribuuuu.distributed import LaunchError, detect_launch, gpu_index

    if cfg.DEVICE == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "DEVICE cuda, but CUDA is not available to this process (torch "
            f"{torch.__version__}); set DEVICE auto or cpu"
        )
    try:
        info = detect_launch()
        on_gpus = cfg.DEVICE != "cpu" and torch.cuda.is_available()
        if on_gpus and cfg.DIST.STRATEGY != "dp":
            local_world = num_procs if num_procs > 1 else info.local_world_size
            visible = torch.cuda.device_count()
            gpu_index(info.local_rank, local_world, visible, info.node_gpus)
    except LaunchError as error:
        raise ConfigError(str(error)) from error


# Training images of the data sets of a fixed size.
_TRAIN_IMAGES = {"mnist5k": 4000, "cifar10": 50_000, "cifar100": 50_000}


def check_batch_fits(cfg, world_size: int) -> None:
    """Refuse a step (TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS) larger than the
    training images each of ``world_size`` processes gets; raise ConfigError."""
    from distribuuuu.data import count_images

    step = cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS
    name, where = cfg.DATA.NAME, ""
    if name == "synthetic":
        images = cfg.DATA.SYNTHETIC_SIZE[0]
    elif name == "imagefolder":
        root = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
        images, where = count_images(root, step * world_size), f" in {root}"
    else:
        images = _TRAIN_IMAGES[name]
    per_process = -(-images // world_size)  # the sampler pads to the world size
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


def _checkpoints_in(out_dir: str) -> tuple[list[str], list[str]]:
    """The training checkpoints and best weights in ``out_dir``."""
    from distribuuuu import checkpoint as cp

    checkpoints = [path for _, path in cp.list_checkpoints(out_dir)]
    best = [os.path.join(out_dir, n) for n in (cp.BEST_WEIGHTS, cp.BEST_EMA_WEIGHTS)]
    return checkpoints, [path for path in best if os.path.lexists(path)]


def check_inputs(
    cfg,
    keep_out_dir: bool = True,
    eval_only: bool = False,
    world_size: int = 1,
    dry_run: bool = False,
) -> None:
    """Check what ``cfg`` names, before anything is written; raise ConfigError.

    The data folders, MODEL.WEIGHTS (whose head must fit when ``eval_only``,
    MODEL.FINETUNE or not), for training: the checkpoints already in OUT_DIR
    (kept only by TRAIN.AUTO_RESUME) and the batch against the training images
    of ``world_size`` processes (unless a checkpoint, whose batch wins, may be
    resumed), then OUT_DIR (created, probed writable; removed again unless
    ``keep_out_dir`` when this created it).
    """
    from distribuuuu.data import DataError, check_data

    try:
        check_data(cfg)
    except DataError as error:
        raise ConfigError(str(error)) from error
    if cfg.MODEL.WEIGHTS:
        finetune = cfg.MODEL.FINETUNE and not eval_only
        check_weights(
            cfg.MODEL.WEIGHTS, cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES, finetune
        )
    if not eval_only:
        checkpoints, best = _checkpoints_in(cfg.OUT_DIR)
        found = checkpoints + best
        if found and not cfg.TRAIN.AUTO_RESUME and not dry_run:
            raise ConfigError(
                f"TRAIN.AUTO_RESUME False: OUT_DIR {cfg.OUT_DIR} already holds "
                f"{len(found)} checkpoint files of a run ({found[0]}"
                f"{', ...' * (len(found) > 1)}), which a new run would overwrite; use "
                "a fresh OUT_DIR, or TRAIN.AUTO_RESUME True to continue that run"
            )
        if cfg.TRAIN.AUTO_RESUME:
            check_resume(cfg.OUT_DIR)
        if not (checkpoints and cfg.TRAIN.AUTO_RESUME):
            check_batch_fits(cfg, world_size)
    check_out_dir(cfg.OUT_DIR, keep_out_dir)


def check_resume(out_dir: str) -> None:
    """Refuse a run whose OUT_DIR holds a checkpoint that would build code or
    reach files elsewhere (damaged ones are skipped when resuming)."""
    from distribuuuu import checkpoint as cp

    try:
        cp.find_resume_checkpoint(out_dir, warn=False)
    except cp.RefusedCheckpointError as error:
        raise ConfigError(f"OUT_DIR checkpoint {error}; remove it") from error


# Errors whose message is written for users: shown without their type name.
_PLAIN_ERRORS = {
    "ConfigError",
    "DataError",
    "DiskFullError",
    "DistributedSetupError",
    "FileNotFoundError",
    "NonFiniteError",
    "PeerLostError",
}
_TYPE_NAME = re.compile(r"^[A-Za-z_][\w.]*$")


def describe_error(error: BaseException) -> str:
    """``error`` in one line: ``Type: message`` (just the message for some types).

    A message carrying a traceback (an error re-raised from a data loader
    worker or a spawned process) is reduced to its last line.
    """
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    name, message = type(error).__name__, " ".join(lines[:1])
    if "Traceback (most recent call last)" in text:
        head, colon, rest = lines[-1].partition(": ")
        if colon and _TYPE_NAME.match(head):
            name, message = head.rsplit(".", 1)[-1], rest
        else:
            message = lines[-1]
    elif len(lines) > 1:
        message += " [...]"
    if name in _PLAIN_ERRORS and message:
        return message
    return f"{name}: {message}" if message else name


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _fail(
    error: BaseException,
    code: int,
    debug: bool,
    message: str | None = None,
    every_rank: bool = False,
) -> int:
    """Report ``error`` in one line (after its traceback with --debug); return code.

    Only rank 0 reports, unless ``every_rank``.
    """
    if not (every_rank or _is_rank_zero()):
        return code
    if debug:
        traceback.print_exception(error)
    return _error(message or describe_error(error), code)


class StartupStop(BaseException):
    """SIGTERM or SIGUSR1 before the training loop takes them over (the loop
    saves a checkpoint and stops); like KeyboardInterrupt, no ``Exception``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def message(self, eval_only: bool, dry_run: bool) -> str:
        name = signal.Signals(self.signum).name
        if eval_only or dry_run:
            return f"stopped by {name}; run the same command again"
        return (
            f"stopped by {name} during start-up; nothing was trained, run the "
            "same command again"
        )


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _raise_stop(signum: int, frame) -> None:
    raise StartupStop(signum)


def _world_size(args: argparse.Namespace) -> int:
    """Processes of the job: --num-procs, or what the launcher says."""
    from distribuuuu.distributed import detect_launch

    return args.num_procs if args.num_procs > 1 else detect_launch().world_size


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if args.num_procs < 1 or (args.num_procs > 1 and _launched()):
        return _error(
            f"--num-procs {args.num_procs}: give N >= 1, and do not combine it "
            "with torchrun or srun, which start the processes themselves",
            2,
        )
    if args.help_config:
        from distribuuuu.config import format_config_reference

        print(format_config_reference(), end="")
        return 0
    if args.dry_run and args.eval_only:
        return _error("--dry-run and --eval-only: give one of them", 2)
    # SIGTERM/SIGUSR1 end the start-up with an error line (exit 128+N) until
    # the training loop installs its own handlers, which save and stop.
    previous = {signum: signal.signal(signum, _raise_stop) for signum in _STOP_SIGNALS}
    try:
        return _check_and_launch(args)
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is _raise_stop:  # not ignored by a stop
                signal.signal(signum, handler)


def _check_and_launch(args: argparse.Namespace) -> int:
    """Load and check the config, then run it; return the exit code."""
    try:
        cfg = load_cfg(args.cfg_file, args.opts)
        if args.print_config:
            print(format_cfg(cfg), end="")
            return 0
        check_launch(cfg, args.num_procs)
        check_inputs(
            cfg,
            keep_out_dir=not args.dry_run,
            eval_only=args.eval_only,
            world_size=_world_size(args),
            dry_run=args.dry_run,
        )
    except ConfigError as error:
        return _fail(error, 2, args.debug)
    except KeyboardInterrupt as error:
        message = "interrupted during start-up; nothing was written"
        return _fail(error, 130, args.debug, message)
    except StartupStop as stop:
        message = stop.message(args.eval_only, args.dry_run)
        return _fail(stop, 128 + stop.signum, args.debug, message)
    except Exception as error:  # not the input's fault: a failure like any other
        return _fail(error, 1, args.debug)
    if args.num_procs > 1:  # the parent only waits: a signal ends it, as before
        for signum in _STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
    return launch(cfg, args)


def launch(cfg, args: argparse.Namespace) -> int:
    """Run ``cfg`` in this process or ``--num-procs`` ones; return the exit code."""
    import torch.multiprocessing as mp

    from distribuuuu.distributed import DistributedSetupError
    from distribuuuu.launch import spawn
    from distribuuuu.peers import PeerLostError

    try:
        if args.num_procs > 1:
            spawn(args.num_procs, run, (cfg, args.eval_only, args.dry_run))
        else:
            run(cfg, args.eval_only, args.dry_run)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    except StartupStop as stop:  # before the training loop took the signal over
        message = stop.message(args.eval_only, args.dry_run)
        return _fail(stop, 128 + stop.signum, args.debug, message)
    except (DistributedSetupError, PeerLostError) as error:  # every rank reports
        return _fail(error, 1, args.debug, every_rank=True)
    except mp.ProcessRaisedException as error:
        where = f"process {error.error_index} of {args.num_procs} failed"
        return _fail(error, 1, args.debug, f"{where}: {describe_error(error)}")
    except mp.ProcessExitedException as error:
        message = f"{error}; the other processes were stopped"
        return _fail(error, 1, args.debug, message)
    except Exception as error:  # any other failure of the run
        return _fail(error, 1, args.debug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
