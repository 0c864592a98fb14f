#!/usr/bin/env python3
"""Describe a checkpoint, best.pth or state_dict file without running anything.

    python tools/inspect_ckpt.py PATH [--json]

Prints the kind of file, the architecture, the training progress, the classes,
the config values that differ from the current defaults, and the tensors.
Exit codes: 0 done; 1 any other failure; 2 not a file this reads (missing,
not a checkpoint, or holding pickled code, which weights-only loading
refuses); each error is one ``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from distribuuuu import cli
from distribuuuu.inference.inspect import format_summary, summarize
from distribuuuu.inference.read import read_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="inspect_ckpt.py",
        description="Describe a distribuuuu checkpoint, best.pth or state_dict.",
    )
    parser.add_argument("path", help="checkpoint, best.pth or state_dict file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    cli.add_debug_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)

    def inspect_and_print() -> None:
        """Read the file and print its summary (text or JSON)."""
        info = summarize(read_checkpoint(args.path))
        print(json.dumps(info) if args.json else format_summary(info))

    return cli.run_tool(inspect_and_print, args.debug, cli.checkpoint_tool_rules())


if __name__ == "__main__":
    sys.exit(main())
