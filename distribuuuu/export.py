"""Export trained weights: a plain state_dict, TorchScript, a torch.export program.

Every file is written atomically, then loaded again and run on a random batch
of another size than the one traced; its outputs must match the eager model
within :data:`ATOL`.  ``tools/export.py`` is the command line.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.data import eval_sizes
from distribuuuu.inference import load_for_inference
from distribuuuu.models import build_model

# Largest accepted difference between an artefact's outputs and the eager model's.
ATOL = 1e-5
# Batch sizes of the traced example and of the check (different on purpose).
EXAMPLE_BATCH, CHECK_BATCH = 2, 3


class MismatchError(RuntimeError):
    """An exported artefact whose outputs differ from the eager model's."""


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


def export_weights(
    weights: str,
    out: str,
    torchscript: str | None = None,
    torch_export: str | None = None,
    cfg_file: str | None = None,
    opts: list[str] | None = None,
) -> list[tuple[str, str, float]]:
    """Write and check every artefact asked for: ``(kind, path, max difference)``.

    Args:
        weights: the checkpoint or weights file to export.
        out: the plain state_dict to write.
        torchscript: also write a traced TorchScript file there.
        torch_export: also write a torch.export program (.pt2) there.
        cfg_file, opts: a yaml file and KEY VALUE pairs overriding the cfg that
            ``weights`` carries.

    Raises MismatchError at the first artefact whose outputs differ.
    """
    model, cfg, _ = load_for_inference(weights, cfg_file, opts)
    size = eval_sizes(cfg)[1]  # the size of the images inference sees
    example = random_batch(EXAMPLE_BATCH, size, seed=0)
    check = random_batch(CHECK_BATCH, size, seed=1)
    with torch.no_grad():
        expected = model(check)
    arch, num_classes = cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES
    writers = [
        (
            "state_dict",
            out,
            partial(write_state_dict, model, arch=arch, num_classes=num_classes),
        ),
        (
            "TorchScript",
            torchscript,
            partial(write_torchscript, model, example=example),
        ),
        (
            "torch.export",
            torch_export,
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
