#!/usr/bin/env python3
"""Export trained weights: a plain state_dict, TorchScript, a torch.export
program, an ONNX model.

    python tools/export.py --weights W [--out FILE] [--torchscript FILE]
        [--torch-export FILE] [--onnx FILE [--atol A]] [--cfg C] [KEY VALUE ...]

The architecture, NUM_CLASSES and TRAIN.IM_SIZE come from the cfg saved in W,
overridden by --cfg and KEY VALUE.  Every file is written atomically, then
loaded again and run on a random batch of another size than the one traced;
its outputs must match the eager model within 1e-5.  The ONNX model (torch's
dynamo-based exporter, dynamic batch size; class names and input pipeline in
its metadata) is run by ONNX Runtime on the CPU on 64 validation images of
the run's data set in batches of 32, 31 and 1; its logits must match within
--atol (1e-4).  At least one output is given; an output must be a new path
or a regular file, not a link, a device (/dev/null), an input or another
output.  Exit codes: 0 done; 1 an
export failed or its outputs differ; 2 unusable weights or config, an output
path refused, an operator ONNX export does not support, or the onnx packages
missing; each error is one ``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import sys

from distribuuuu import checkpoint as cp
from distribuuuu import cli
from distribuuuu.inference import onnx as onnx_model
from distribuuuu.inference.export import export_weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="export.py",
        description="Export a checkpoint's model as a plain state_dict and, "
        "optionally, TorchScript, torch.export and ONNX files.",
    )
    parser.add_argument("--weights", required=True, help="checkpoint or weights file")
    parser.add_argument("--out", metavar="FILE", help="write a plain state_dict")
    parser.add_argument("--torchscript", metavar="FILE", help="write TorchScript")
    parser.add_argument(
        "--torch-export",
        metavar="FILE",
        help="write a torch.export program (.pt2) with a dynamic batch size",
    )
    parser.add_argument(
        "--onnx",
        metavar="FILE",
        help="write an ONNX model (dynamic batch size), checked with "
        "ONNX Runtime on validation images",
    )
    parser.add_argument(
        "--atol",
        type=float,
        help="with --onnx: the largest accepted difference between ONNX "
        f"Runtime's logits and PyTorch's (default {onnx_model.ATOL:g})",
    )
    parser.add_argument("--cfg", dest="cfg_file", help="yaml config overriding W's")
    cli.add_debug_option(parser)
    parser.add_argument(
        "opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides"
    )
    args = parser.parse_args(argv)
    if not (args.out or args.torchscript or args.torch_export or args.onnx):
        parser.error("give at least one output: --out, --torchscript, "
                     "--torch-export or --onnx")  # fmt: skip
    if args.atol is None:
        args.atol = onnx_model.ATOL
    elif not args.onnx:
        parser.error("--atol is the tolerance of the --onnx check: give --onnx")
    if not args.atol > 0:  # also refuses NaN
        parser.error("--atol takes a number > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)

    def export_and_report() -> None:
        """Write and check the artefacts, then say what was written."""
        cp.check_tool_paths(  # before the minutes an export may take
            outputs=[
                ("--out", args.out),
                ("--torchscript", args.torchscript),
                ("--torch-export", args.torch_export),
                ("--onnx", args.onnx),
            ],
            inputs=[("--weights", args.weights), ("--cfg", args.cfg_file)],
        )
        written = export_weights(
            args.weights,
            args.out,
            torchscript=args.torchscript,
            torch_export=args.torch_export,
            cfg_file=args.cfg_file,
            opts=args.opts,
            onnx=args.onnx,
            onnx_atol=args.atol,
        )
        for kind, path, difference, checked in written:
            print(
                f"wrote {path} ({kind}); max abs difference {difference:.2e}{checked}"
            )

    return cli.run_tool(export_and_report, args.debug, cli.checkpoint_tool_rules())


if __name__ == "__main__":
    sys.exit(main())
