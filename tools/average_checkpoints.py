#!/usr/bin/env python3
"""Average the weights of checkpoints into one weights file.

    python tools/average_checkpoints.py --out avg.pth CKPT CKPT [CKPT ...]
    python tools/average_checkpoints.py --out avg.pth --run OUT_DIR --last 5
    python tools/average_checkpoints.py --out avg.pth --run OUT_DIR --best 3 [--loss]

``--best`` picks by the scores CHECKPOINT.KEEP_BEST records (top-1, or the
validation loss with ``--loss``).  The result is a plain weights file that
``--eval-only``, ``MODEL.WEIGHTS``, inspect, export and predict read; see
distribuuuu/inference/average.py for how BatchNorm statistics are treated.  Each
checkpoint counts once: a file given twice (or through a link) is refused, and
so is an --out that is a checkpoint, a link or no regular file.  Exit codes:
0 done; 1 any other failure; 2 a file this does not read (missing, not a
checkpoint, holding pickled code), checkpoints of different models, or paths
refused.
"""

from __future__ import annotations

import argparse
import sys

from distribuuuu import checkpoint as cp
from distribuuuu import cli
from distribuuuu.inference.average import average_checkpoints, select_checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="average_checkpoints.py",
        description="Average the weights of distribuuuu checkpoints.",
    )
    parser.add_argument("paths", nargs="*", help="checkpoints to average")
    parser.add_argument("--out", required=True, help="the weights file to write")
    parser.add_argument("--run", help="OUT_DIR of a run to pick checkpoints from")
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--last", type=int, default=0, help="its newest N")
    pick.add_argument("--best", type=int, default=0, help="its best N (scores)")
    parser.add_argument("--loss", action="store_true", help="--best by val loss")
    cli.add_debug_option(parser)
    args = parser.parse_args(argv)
    if bool(args.run) == bool(args.paths):
        parser.error("give checkpoint paths, or --run OUT_DIR with --last or --best")
    if args.run and not (args.last or args.best):
        parser.error("--run needs --last N or --best N")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)

    def average_and_write() -> None:
        """Pick the checkpoints, average them and write the result."""
        paths = args.paths or select_checkpoints(
            args.run, args.last, args.best, args.loss
        )
        cp.check_tool_paths(
            outputs=[("--out", args.out)], inputs=[("checkpoint", p) for p in paths]
        )
        cp.save_weights(args.out, average_checkpoints(paths))
        print(f"averaged {len(paths)} checkpoints into {args.out}: " + ", ".join(paths))

    return cli.run_tool(average_and_write, args.debug, cli.checkpoint_tool_rules())


if __name__ == "__main__":
    sys.exit(main())
