#!/usr/bin/env python3
"""Export trained weights: a plain state_dict, TorchScript, a torch.export program.

    python tools/export.py --weights W --out FILE [--torchscript FILE]
        [--torch-export FILE] [--cfg C] [KEY VALUE ...]

The architecture, NUM_CLASSES and TRAIN.IM_SIZE come from the cfg saved in W,
overridden by --cfg and KEY VALUE.  Every file is written atomically, then
loaded again and run on a random batch of another size than the one traced;
its outputs must match the eager model within 1e-5.  Exit codes: 0 done;
1 an export failed or its outputs differ; 2 unusable weights or config; each
error is one ``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.config import ConfigError
from distribuuuu.inference import CheckpointError, load_for_inference
from distribuuuu.models import build_model
from distribuuuu.tools.train_net import describe_error

# Largest accepted difference between an artefact's outputs and the eager model's.
ATOL = 1e-5
# Batch sizes of the traced example and of the check (different on purpose).
EXAMPLE_BATCH, CHECK_BATCH = 2, 3


class MismatchError(RuntimeError):
    """An exported artefact whose outputs differ from the eager model's."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="export.py",
        description="Export a checkpoint's model as a plain state_dict and, "
        "optionally, TorchScript and torch.export files.",
    )
    parser.add_argument("--weights", required=True, help="checkpoint or weights file")
    parser.add_argument("--out", required=True, help="the state_dict file to write")
    parser.add_argument("--torchscript", metavar="FILE", help="also write TorchScript")
    parser.add_argument(
        "--torch-export",
        metavar="FILE",
        help="also write a torch.export program (.pt2) with a dynamic batch size",
    )
    parser.add_argument("--cfg", dest="cfg_file", help="yaml config overriding W's")
    parser.add_argument(
        "opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides"
    )
    return parser.parse_args(argv)


def random_batch(batch: int, im_size: int, seed: int) -> torch.Tensor:
    """A reproducible batch of normal noise, ``batch x 3 x im_size x im_size``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, im_size, im_size, generator=generator)


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as compact, contiguous CPU copies, keys without prefix."""
    return {
        key: value.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for key, value in model.state_dict().items()
    }


def write_state_dict(model: nn.Module, path: str, arch: str, num_classes: int):
    """Write the state_dict; return a fresh ``arch`` model that loaded the file."""
    cp.save_weights(path, plain_state_dict(model))
    reloaded = build_model(arch, num_classes)
    reloaded.load_state_dict(cp.load_file(path))
    return reloaded.eval()


def write_torchscript(model: nn.Module, path: str, example: torch.Tensor):
    """Trace the model on ``example``, write it; return the file loaded again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still useful
        traced = torch.jit.trace(model, example, check_trace=False)  # checked below
        cp.atomic_write(path, lambda f: torch.jit.save(traced, f))
        return torch.jit.load(path, map_location="cpu")


def write_exported_program(model: nn.Module, path: str, example: torch.Tensor):
    """Export the model (dynamic batch size), write it; return the loaded module."""
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    cp.atomic_write(path, lambda f: torch.export.save(program, f))
    return torch.export.load(path).module()


def max_difference(expected: torch.Tensor, module: Callable, batch: torch.Tensor):
    """The largest absolute difference between ``module(batch)`` and ``expected``."""
    with torch.no_grad():
        return (module(batch) - expected).abs().max().item()


def export(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """Write and check every artefact asked for: ``(kind, path, max difference)``.

    Raises MismatchError at the first artefact whose outputs differ.
    """
    model, cfg, _ = load_for_inference(args.weights, args.cfg_file, args.opts)
    size = cfg.TRAIN.IM_SIZE
    example = random_batch(EXAMPLE_BATCH, size, seed=0)
    check = random_batch(CHECK_BATCH, size, seed=1)
    with torch.no_grad():
        expected = model(check)
    arch, num_classes = cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES
    writers = [
        (
            "state_dict",
            args.out,
            partial(write_state_dict, model, arch=arch, num_classes=num_classes),
        ),
        (
            "TorchScript",
            args.torchscript,
            partial(write_torchscript, model, example=example),
        ),
        (
            "torch.export",
            args.torch_export,
            partial(write_exported_program, model, example=example),
        ),
    ]
    written = []
    for kind, path, write in writers:
        if not path:
            continue
        difference = max_difference(expected, write(path), check)
        if not difference <= ATOL:  # also catches NaN
            raise MismatchError(
                f"{kind} {path}: outputs differ from the model's by up to "
                f"{difference:.3g} (allowed {ATOL:g})"
            )
        written.append((kind, path, difference))
    return written


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)
    try:
        written = export(args)
    except (CheckpointError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except MismatchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # tracing or exporting failed
        print(f"error: {describe_error(error)}", file=sys.stderr)
        return 1
    for kind, path, difference in written:
        print(f"wrote {path} ({kind}); max abs difference {difference:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
