#!/usr/bin/env python3
"""Classify image files with trained weights: the top-k classes of each image.

    python tools/predict.py --weights W [--cfg C] [--topk K] [--json]
        [KEY VALUE ...] IMAGE_OR_FOLDER ...

Folders are searched recursively for image files (by extension), in sorted
order; links to folders are followed, but no folder is searched twice (a link
loop ends at once).  The model, its classes and the evaluation transforms come
from the cfg saved in W, overridden by --cfg and KEY VALUE (KEY: an upper-case
config key such as TRAIN.IM_SIZE).  One line per image: ``path  name (prob)
...``, or one JSON object per line with --json.  Runs on CUDA when available
(``--device cpu`` forces the CPU).  Exit codes: 0 done; 2 unusable weights,
config or image (missing, unreadable, too many pixels, none found), with one
``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from collections.abc import Iterator

import torch
from torch import nn

from distribuuuu.config import ConfigError
from distribuuuu.data import (
    DataError,
    build_test_transform,
    find_image_files,
    image_reader,
)
from distribuuuu.inference import CheckpointError, load_for_inference

# A config key on the command line: MODEL.ARCH, OUT_DIR, TRAIN.IM_SIZE, ...
_KEY = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Z][A-Z0-9_]*)*$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line: ``opts`` (KEY VALUE pairs) and ``inputs`` (paths)."""
    parser = argparse.ArgumentParser(
        prog="predict.py",
        description="Print the top-k classes of image files.",
    )
    parser.add_argument("--weights", required=True, help="checkpoint or weights file")
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
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    args.opts, args.inputs = split_overrides(args.words)
    if not args.inputs:
        parser.error("give at least one image file or folder")
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


def find_images(inputs: list[str]) -> list[str]:
    """The image files named by ``inputs``, folders expanded recursively and sorted."""
    found = []
    for path in inputs:
        if os.path.isdir(path):
            found += sorted(find_image_files(path))
        elif os.path.isfile(path):
            found.append(path)
        else:
            raise DataError(f"{path}: no such file or folder")
    if not found:
        raise DataError(f"no image files in {', '.join(inputs)}")
    return found


def batches(paths: list[str], size: int) -> Iterator[list[str]]:
    """``paths`` in consecutive chunks of at most ``size``."""
    for start in range(0, len(paths), size):
        yield paths[start : start + size]


def predict(
    model: nn.Module, images: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k probabilities and labels of a batch of transformed images."""
    with torch.no_grad():
        probabilities = model(images).float().softmax(dim=1)
    return probabilities.topk(min(topk, probabilities.shape[1]), dim=1)


def format_line(path: str, top: list[tuple[str, float]], as_json: bool) -> str:
    """One output line: ``path  name (prob)  ...``, or a JSON object."""
    if as_json:
        classes = [{"class": name, "prob": prob} for name, prob in top]
        return json.dumps({"path": path, "top": classes})
    return "  ".join([path] + [f"{name} ({prob:.2f})" for name, prob in top])


def run(args: argparse.Namespace) -> None:
    """Load the model, then classify and print the images batch by batch."""
    model, cfg, classes = load_for_inference(args.weights, args.cfg_file, args.opts)
    paths = find_images(args.inputs)
    device = torch.device(args.device)
    model.to(device)
    read, transform = image_reader(cfg), build_test_transform(cfg)
    for chunk in batches(paths, args.batch_size):
        images = torch.stack([transform(read(path)) for path in chunk])
        probabilities, labels = predict(model, images.to(device), args.topk)
        for path, probs, ids in zip(chunk, probabilities.tolist(), labels.tolist()):
            top = [(classes[i], p) for i, p in zip(ids, probs)]
            print(format_line(path, top, args.json), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)
    try:
        run(args)
    except (CheckpointError, ConfigError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
