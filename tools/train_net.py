#!/usr/bin/env python3
"""Train or evaluate an image classifier: the single entry point of distribuuuu.

    python tools/train_net.py [--cfg FILE] [--eval-only | --dry-run] [KEY VALUE ...]
    python tools/train_net.py [--cfg FILE] --print-config [KEY VALUE ...]
    python tools/train_net.py --help-config

Runs as one process, under torchrun / ``python -m torch.distributed.launch``,
or as a Slurm task under srun; see docs/launching.md.  Without ``--cfg`` it trains the
embedded default (a small ResNet on 5,000 real MNIST digits).
"""

from __future__ import annotations

import argparse
import os
import sys

from yacs.config import CfgNode

from distribuuuu import cli, job, preflight
from distribuuuu.config import (
    format_cfg,
    format_config_reference,
    merge_cfg,
    validate_cfg,
)
from distribuuuu.dist import worker_server
from distribuuuu.engine import run_lock
from distribuuuu.errors import DeferredRefusalError, OutDirInUseError

EXIT_CODES = """exit codes:
  0    done
  1    the run failed (an unreadable image, a lost peer, a loss or weights that
       became NaN/inf, a full disk, any other error); the full traceback is in
       OUT_DIR/log.txt (log_rank{N}.txt) once logging has started, and on
       stderr with --debug
  2    unusable config or input, found before anything is written: the config
       file, a key or value, the data folders, MODEL.WEIGHTS or a checkpoint in
       OUT_DIR (missing, of another architecture, or refused: it holds pickled
       code or points outside its folder), OUT_DIR (the root of the file
       system, not writable, disk full, in use by a live run, holding another
       run with TRAIN.AUTO_RESUME False) or the launch (srun
       forgotten, DEVICE cuda without CUDA, more processes on a node than
       visible GPUs)
  130  interrupted (Ctrl-C); 128+N: stopped by signal N (after saving a
       checkpoint, once training has started)
every error ends with one line on stderr that starts with "error: "."""


# Another run holds OUT_DIR's lock, or rank 0 refused the data: found before
# the run in one process, or told to every rank of a launched job once they
# joined the process group (distribuuuu/dist/refusal.py).
RANK_ZERO_REFUSED = cli.ErrorExit(
    (OutDirInUseError, DeferredRefusalError), cli.EXIT_UNUSABLE_INPUT, cli.plain_message
)


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
    cli.add_debug_option(parser)
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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if args.num_procs < 1 or (args.num_procs > 1 and job.is_launched()):
        return cli.print_error(
            f"--num-procs {args.num_procs}: give N >= 1, and do not combine it "
            "with torchrun or srun, which start the processes themselves",
            cli.EXIT_UNUSABLE_INPUT,
        )
    if args.help_config:
        print(format_config_reference(), end="")
        return cli.EXIT_OK
    if args.dry_run and args.eval_only:
        return cli.print_error(
            "--dry-run and --eval-only: give one of them", cli.EXIT_UNUSABLE_INPUT
        )
    # SIGTERM/SIGUSR1 end the start-up with an error line (exit 128+N) until
    # the training loop installs its own handlers, which save and stop.
    with cli.stop_signals_raise():
        return check_and_start(args)


def load_and_check(args: argparse.Namespace) -> CfgNode:
    """The validated config, after every check of the launch and the inputs.

    With --print-config only loaded and validated.  Raises ConfigError.
    """
    cfg = merge_cfg(args.cfg_file, args.opts)
    # Loader workers come from a fork server: its imports (torch) overlap
    # this process's own, which start with the validation.
    workers = cfg.TRAIN.WORKERS
    one_process = args.num_procs == 1 and not args.print_config
    if one_process and isinstance(workers, int) and workers > 0:
        worker_server.start_worker_server()
    validate_cfg(cfg)
    preflight.check_choices(cfg)
    cfg.freeze()
    if args.print_config:
        return cfg
    preflight.check_launch(cfg, args.num_procs)
    world_size = job.job_world_size(args.num_procs)
    if not args.eval_only:
        preflight.check_layout(cfg, world_size)
        preflight.check_model(cfg)
        preflight.check_trackers(cfg)
    preflight.check_inputs(
        cfg,
        keep_out_dir=not args.dry_run,
        eval_only=args.eval_only,
        world_size=world_size,
        dry_run=args.dry_run,
    )
    return cfg


def check_and_start(args: argparse.Namespace) -> int:
    """Load and check the config, then run it; return the exit code."""
    checked: list[CfgNode] = []
    code = cli.run_tool(
        lambda: checked.append(load_and_check(args)),
        args.debug,
        (RANK_ZERO_REFUSED, *cli.train_startup_rules(args.eval_only, args.dry_run)),
    )
    if code != cli.EXIT_OK:
        return code
    (cfg,) = checked
    if args.print_config:
        print(format_cfg(cfg), end="")
        return cli.EXIT_OK
    if args.num_procs > 1:  # the parent only waits: a signal ends it, as before
        cli.default_stop_signals()
    rules = cli.train_run_rules(args.num_procs, args.eval_only, args.dry_run)
    try:
        return cli.run_tool(
            lambda: run_checked_job(cfg, args), args.debug, (*rules, RANK_ZERO_REFUSED)
        )
    finally:  # the run is over: OUT_DIR's lock (and its descriptor) goes
        run_lock.release_out_dir_locks()


def run_checked_job(cfg: CfgNode, args: argparse.Namespace) -> int:
    """Run ``cfg`` in this process or ``--num-procs`` ones; return the exit code."""
    try:
        job.run_job(cfg, args.num_procs, args.eval_only, args.dry_run)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return cli.EXIT_INTERRUPTED
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
