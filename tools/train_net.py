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
  1    the run failed (an unreadable image, a lost peer, any other error);
       the full traceback is in OUT_DIR/log.txt (log_rank{N}.txt) once logging
       has started, and on stderr with --debug
  2    unusable config or input, found before anything is written: the config
       file, a key or value, the data folders, MODEL.WEIGHTS (missing, of
       another architecture, or holding pickled code) or OUT_DIR (not writable,
       disk full)
  130  interrupted (Ctrl-C); 128+N: stopped by signal N after saving a checkpoint
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
    stats = trainer.test_model(cfg)
    if _is_rank_zero():
        k = stats["topk_k"]
        print(
            f"top1 {stats['top1']:.2f}  top{k} {stats['topk']:.2f}  "
            f"loss {stats['loss']:.4f}  samples {stats['samples']}"
        )


def run(cfg, eval_only: bool, dry_run: bool = False) -> None:
    """:func:`_run_rank`, writing a failure's traceback to this rank's log file."""
    try:
        _run_rank(cfg, eval_only, dry_run)
    except Exception as error:
        _log_traceback(error)
        raise


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


def check_inputs(cfg, keep_out_dir: bool = True, eval_only: bool = False) -> None:
    """Check what ``cfg`` names, before anything is written; raise ConfigError.

    The data folders, MODEL.WEIGHTS (whose head must fit when ``eval_only``,
    MODEL.FINETUNE or not), then OUT_DIR (created, probed writable; removed
    again unless ``keep_out_dir`` when this created it).
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
    check_out_dir(cfg.OUT_DIR, keep_out_dir)


# Errors whose message is written for users: shown without their type name.
_PLAIN_ERRORS = {
    "ConfigError",
    "DataError",
    "DistributedSetupError",
    "FileNotFoundError",
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
    try:
        cfg = load_cfg(args.cfg_file, args.opts)
        if args.print_config:
            print(format_cfg(cfg), end="")
            return 0
        check_inputs(cfg, keep_out_dir=not args.dry_run, eval_only=args.eval_only)
    except ConfigError as error:
        return _fail(error, 2, args.debug)
    except Exception as error:  # not the input's fault: a failure like any other
        return _fail(error, 1, args.debug)
    return launch(cfg, args)


def launch(cfg, args: argparse.Namespace) -> int:
    """Run ``cfg`` in this process or ``--num-procs`` ones; return the exit code."""
    import torch.multiprocessing as mp

    from distribuuuu.distributed import DistributedSetupError
    from distribuuuu.launch import spawn

    try:
        if args.num_procs > 1:
            spawn(args.num_procs, run, (cfg, args.eval_only, args.dry_run))
        else:
            run(cfg, args.eval_only, args.dry_run)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    except DistributedSetupError as error:  # names its rank: every rank reports
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
