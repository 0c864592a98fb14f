#!/usr/bin/env python3
"""Write an image data set as WebDataset shards for ``DATA.NAME webdataset``.

    python tools/make_shards.py /data/imagenet /data/shards --samples 1000
    python tools/make_shards.py /data/imagenet /data/shards --bytes 500000000 \\
        --max-side 256 --quality 90
    python tools/make_shards.py mnist5k /data/digit-shards

SOURCE is an ImageFolder root holding ``<split>/<class>/<image>`` for each
``--splits`` name (train and val by default; the labels are those of
``DATA.NAME imagefolder``), or ``mnist5k`` for the embedded digits.  OUT (new
or empty) receives ``<split>-000000.tar`` ... (samples in an order shuffled
from ``--seed``, a new shard when ``--samples`` or ``--bytes`` would be
exceeded), ``classes.txt`` and ``index.json`` (each shard's samples and
bytes).  ``--max-side S`` re-encodes as JPEG (``--quality``) the images whose
shorter side exceeds S, resized to S; the others are copied byte for byte.
The same input and options give the same files.  The patterns to train on
are printed last.  Exit codes: 0 done; 1 any other failure; 2 unusable input
(no such folder, no classes, OUT not empty, a class name with a newline or
another control character, a file that is not an image, a link out of SOURCE
or its class folder).  A run that fails removes the shards it wrote.
"""

from __future__ import annotations

import argparse
import os
import sys

from distribuuuu import cli
from distribuuuu.data.shard_writing import (
    ShardLimits,
    digits_source,
    folder_source,
    pattern_of,
    remove_unfinished,
    write_index,
    write_split,
)
from distribuuuu.errors import DataError

DIGITS = "mnist5k"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="make_shards.py",
        description="Write an image data set as WebDataset tar shards.",
    )
    parser.add_argument("source", help=f"ImageFolder root, or {DIGITS}")
    parser.add_argument("out", help="folder for the shards (new or empty)")
    parser.add_argument(
        "--splits",
        nargs="+",
        default=["train", "val"],
        help="sub-folders of SOURCE to write (default: train val)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=1000,
        help="at most this many samples a shard (0: no limit)",
    )
    parser.add_argument(
        "--bytes",
        type=int,
        default=0,
        help="at most this many bytes of samples a shard, their tar headers "
        "included (the end of a tar adds up to 10 KiB; 0: no limit)",
    )
    parser.add_argument(
        "--max-side",
        type=int,
        default=0,
        help="re-encode images whose shorter side exceeds this",
    )
    parser.add_argument(
        "--quality",
        type=int,
        default=90,
        help="JPEG quality of re-encoded images (default 90)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sample order (default 0)"
    )
    cli.add_debug_option(parser)
    args = parser.parse_args(argv)
    if min(args.samples, args.bytes, args.max_side) < 0:
        parser.error("--samples, --bytes and --max-side take counts >= 0")
    if not args.samples and not args.bytes:
        parser.error("give --samples or --bytes, or a shard holds everything")
    if not 1 <= args.quality <= 100:
        parser.error("--quality is from 1 to 100")
    return args


def _source(source: str, split: str):
    """The classes and samples of ``split`` of ``source``."""
    if source == DIGITS:
        if split not in ("train", "val"):
            raise DataError(f"{DIGITS} has the splits train and val, not {split}")
        return digits_source(split == "train")
    root = os.path.join(source, split)
    if not os.path.isdir(root):
        raise DataError(f"{root}: no such folder (SOURCE/<split>/<class>/<image>)")
    return folder_source(root)


def make_shards(args: argparse.Namespace) -> list[str]:
    """Write the shards of every split; their patterns."""
    if os.path.isdir(args.out) and os.listdir(args.out):
        raise DataError(f"{args.out}: not empty; shards go to a new or empty folder")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise DataError(f"{args.out}: exists and is not a folder")
    limits = ShardLimits(args.samples, args.bytes, args.max_side, args.quality)
    sources = {split: _source(args.source, split) for split in args.splits}
    class_lists = {tuple(classes) for classes, _ in sources.values()}
    if len(class_lists) > 1:
        raise DataError(f"{args.source}: the splits have different class folders")
    created = not os.path.isdir(args.out)
    os.makedirs(args.out, exist_ok=True)
    finished = False
    try:
        patterns = _write(sources, args, limits, list(class_lists.pop()))
        finished = True
    finally:  # a refused image mid-way, a full disk, Ctrl-C: no partial output
        if not finished:
            remove_unfinished(args.out, list(sources), created)
    return patterns


def _write(
    sources: dict, args: argparse.Namespace, limits: ShardLimits, classes: list[str]
) -> list[str]:
    """Write the shards of every split, then the index; their patterns."""
    entries, patterns = {}, []
    for split, (_, samples) in sources.items():
        written = write_split(samples, args.out, split, limits, args.seed)
        entries.update(written)
        count = sum(entry["samples"] for entry in written.values())
        pattern = pattern_of(args.out, split, len(written))
        patterns.append(pattern)
        print(f"{split}: {count} samples in {len(written)} shards: {pattern}")
    write_index(args.out, classes, entries)
    return patterns


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)

    def run() -> None:
        patterns = make_shards(args)
        keys = ["TRAIN.DATASET", "TEST.DATASET"]
        if len(patterns) == 2:
            words = " ".join(f"{key} '{p}'" for key, p in zip(keys, patterns))
            print(f"train with: DATA.NAME webdataset {words}")

    return cli.run_tool(run, args.debug, cli.checkpoint_tool_rules())


if __name__ == "__main__":
    sys.exit(main())
