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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    try:
        cfg = load_cfg(args.cfg_file, args.opts)
    except ConfigError as error:
        if _is_rank_zero():
            print(f"error: {error}", file=sys.stderr)
        return 2

    from distribuuuu import trainer  # after the config checks: imports torch

    try:
        if args.eval_only:
            stats = trainer.test_model(cfg)
            if _is_rank_zero():
                k = stats["topk_k"]
                print(
                    f"top1 {stats['top1']:.2f}  top{k} {stats['topk']:.2f}  "
                    f"loss {stats['loss']:.4f}  samples {stats['samples']}"
                )
        else:
            trainer.train_model(cfg)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
