#!/usr/bin/env python3
"""Train or evaluate an image classifier: the single entry point of distribuuuu.

    python tools/train_net.py [--cfg FILE] [--eval-only] [KEY VALUE ...]

Runs as one process, under torchrun / ``python -m torch.distributed.launch``,
or as a Slurm task under srun; see README.md.  Without ``--cfg`` it trains the
embedded default (a small ResNet on 5,000 real MNIST digits).
"""

from __future__ import annotations

import argparse
import os
import sys

from distribuuuu.config import ConfigError, load_cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="train_net.py",
        description="Train (or evaluate) an image classifier with distribuuuu.",
        epilog="example: train_net.py --cfg config/resnet18.yaml OUT_DIR /tmp/r18 "
        "TRAIN.BATCH_SIZE 64",
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


def run(cfg, eval_only: bool) -> None:
    """Train or evaluate ``cfg`` in this process (one rank of the job)."""
    from distribuuuu import trainer  # imports torch: after the config checks

    if not eval_only:
        trainer.train_model(cfg)
        return
    stats = trainer.test_model(cfg)
    if _is_rank_zero():
        k = stats["topk_k"]
        print(
            f"top1 {stats['top1']:.2f}  top{k} {stats['topk']:.2f}  "
            f"loss {stats['loss']:.4f}  samples {stats['samples']}"
        )


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


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
    try:
        cfg = load_cfg(args.cfg_file, args.opts)
    except ConfigError as error:
        return _error(str(error), 2) if _is_rank_zero() else 2

    import torch.multiprocessing as mp

    from distribuuuu.distributed import DistributedSetupError
    from distribuuuu.launch import spawn

    try:
        if args.num_procs > 1:
            spawn(args.num_procs, run, (cfg, args.eval_only))
        else:
            run(cfg, args.eval_only)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    except (DistributedSetupError, FileNotFoundError) as error:
        return _error(str(error), 1)
    except mp.ProcessRaisedException as error:
        last = str(error).strip().splitlines()[-1]
        return _error(
            f"process {error.error_index} of {args.num_procs} failed: {last}", 1
        )
    except mp.ProcessExitedException as error:
        return _error(f"{error}; the other processes were stopped", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
