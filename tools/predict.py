#!/usr/bin/env python3
"""Classify image files with trained weights: the top-k classes of each image.

    python tools/predict.py --weights W [--cfg C] [--topk K] [--json]
        [KEY VALUE ...] IMAGE_OR_FOLDER ...
    python tools/predict.py --onnx MODEL.onnx [--topk K] [--json]
        IMAGE_OR_FOLDER ...

Folders are searched recursively for image files (regular files, by
extension: a FIFO or a device is skipped), in sorted order; links to folders
are followed, but no folder is searched twice (a link loop ends at once).  The
model, its classes and the evaluation transforms come from the cfg saved in W,
overridden by --cfg and KEY VALUE (KEY: an upper-case config key such as
TRAIN.IM_SIZE).  One line per image: ``path  name (prob) ...``, or one JSON
object per line with --json.  Runs on CUDA when available (``--device cpu``
forces the CPU).  With --onnx, a model that ``tools/export.py --onnx`` wrote
runs in ONNX Runtime on the CPU, with the classes and transforms saved in its
metadata.  Exit codes: 0 done; 1 any other failure; 2 unusable weights, ONNX
file, config or image (missing, not a regular file, unreadable, too many
pixels or bytes, none found), or the onnx packages missing; each error is one
``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys

import torch

from distribuuuu import cli
from distribuuuu.inference.predict import (
    classify_images,
    classify_images_onnx,
    format_line,
)

# A config key on the command line: MODEL.ARCH, OUT_DIR, TRAIN.IM_SIZE, ...
_KEY = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Z][A-Z0-9_]*)*$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line: ``opts`` (KEY VALUE pairs) and ``inputs`` (paths)."""
    parser = argparse.ArgumentParser(
        prog="predict.py",
        description="Print the top-k classes of image files.",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--weights", help="checkpoint or weights file")
    model.add_argument("--onnx", metavar="FILE", help="ONNX model from export.py")
    parser.add_argument("--cfg", dest="cfg_file", help="yaml config overriding W's")
    parser.add_argument("--topk", type=int, default=3, help="classes per image")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run the model (auto: CUDA when available)",
    )
    cli.add_debug_option(parser)
    parser.add_argument(
        "words",
        nargs="+",
        metavar="[KEY VALUE ...] IMAGE_OR_FOLDER",
        help="config overrides, then image files or folders",
    )
    args = parser.parse_intermixed_args(argv)
    if args.topk < 1 or args.batch_size < 1:
        parser.error("--topk and --batch-size take a number >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and not args.onnx else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    args.opts, args.inputs = split_overrides(args.words)
    if not args.inputs:
        parser.error("give at least one image file or folder")
    if args.onnx and (args.cfg_file or args.opts or args.device == "cuda"):
        parser.error(
            "--onnx takes no --cfg, KEY VALUE or --device cuda: its metadata "
            "sets the transforms and it runs on the CPU"
        )
    return args


def split_overrides(words: list[str]) -> tuple[list[str], list[str]]:
    """Split ``words`` into KEY VALUE pairs and paths (an existing path is a path)."""
    opts, paths = [], []
    remaining = iter(words)
    for word in remaining:
        if _KEY.match(word) and not os.path.exists(word):
            opts += [word, *itertools.islice(remaining, 1)]  # odd: an error later
        else:
            paths.append(word)
    return opts, paths


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)

    def classify_and_print() -> None:
        """Print one line per image as soon as its batch is classified."""
        if args.onnx:
            classified = classify_images_onnx(
                args.onnx, args.inputs, args.topk, args.batch_size
            )
        else:
            classified = classify_images(
                args.weights,
                args.inputs,
                device=args.device,
                topk=args.topk,
                batch_size=args.batch_size,
                cfg_file=args.cfg_file,
                opts=args.opts,
            )
        for path, top in classified:
            print(format_line(path, top, args.json), flush=True)

    return cli.run_tool(classify_and_print, args.debug, cli.checkpoint_tool_rules())


if __name__ == "__main__":
    sys.exit(main())
