"""Export trained weights: a plain state_dict, TorchScript, a torch.export
program, an ONNX model.

Every file is written atomically, then loaded again and run on a random batch
of another size than the one traced; its outputs must match the eager model
within :data:`ATOL`.  The ONNX model is run by ONNX Runtime instead, on
batches of the run's validation images (of other sizes than the exported
example's), within a tolerance of its own (:data:`onnx_model.ATOL`).
``tools/export.py`` is the command line.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from torchvision.transforms import v2

from distribuuuu import checkpoint as cp
from distribuuuu.data import build_dataset, build_normalizer, eval_sizes
from distribuuuu.data.spec import DataSpec
from distribuuuu.errors import MismatchError
from distribuuuu.inference import onnx as onnx_model
from distribuuuu.inference.read import load_for_inference
from distribuuuu.models import build_model

# Largest accepted difference between an artefact's outputs and the eager model's.
ATOL = 1e-5
# Batch sizes of the traced example and of the check (different on purpose).
EXAMPLE_BATCH, CHECK_BATCH = 2, 3
# Batch sizes of the ONNX Runtime check on validation images: none is the
# example's, so they prove the dynamic batch axis, down to a single image.
ONNX_CHECK_BATCHES = (32, 31, 1)


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


def validation_batches(
    data: DataSpec, sizes: tuple[int, ...]
) -> tuple[list[torch.Tensor], str]:
    """Batches of ``sizes`` normalised validation images of the data set
    ``data``, spread evenly over it, and what they are; random images (and
    why) when the data set cannot be read here.  Nothing is downloaded."""
    data = dataclasses.replace(data, download=False)
    count, crop = sum(sizes), eval_sizes(data.transform)[1]
    try:
        dataset = build_dataset(data, train=False)
        indices = torch.linspace(0, len(dataset) - 1, count).long().unique().tolist()
        if len(indices) < count:
            raise ValueError(f"it has {len(dataset)} images, fewer than {count}")
        # TEST.TTA's crop views are served at the resize: crop them to the input.
        images = torch.stack([dataset[i][0] for i in indices])
        images = build_normalizer(data, torch.device("cpu"))(
            v2.functional.center_crop(images, [crop, crop])
        )
        source = f"validation images of {data.name}"
    except Exception as error:  # a data set elsewhere, or unreadable, or small
        images = random_batch(count, crop, seed=1)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        source = f"random images (the validation set is not readable here: {reason})"
    return list(images.split(list(sizes))), source


def write_onnx(
    model: nn.Module, data: DataSpec, proto, path: str, atol: float
) -> tuple[str, str, float, str]:
    """Write the exported ONNX model, check it with ONNX Runtime on validation
    images of ``data``; return ``("ONNX", path, max difference, what was
    compared)``."""
    onnx_model.write_model(proto, path)
    session, _ = onnx_model.load_session(path)
    batches, source = validation_batches(data, ONNX_CHECK_BATCHES)
    difference, agree = onnx_model.compare(model, session, batches)
    count = sum(len(images) for images in batches)
    sizes = ", ".join(str(len(images)) for images in batches)
    checked = f"{count} {source} in batches of {sizes}"
    if not difference <= atol:  # also catches NaN
        raise MismatchError(
            f"ONNX {path}: ONNX Runtime's outputs differ from PyTorch's by up to "
            f"{difference:.3g} (allowed {atol:g}) on {checked}; top-1 agreement "
            f"{agree}/{count}"
        )
    return "ONNX", path, difference, f" on {checked}; top-1 agreement {agree}/{count}"


def max_difference(expected: torch.Tensor, module: Callable, batch: torch.Tensor):
    """The largest absolute difference between ``module(batch)`` and ``expected``."""
    with torch.no_grad():
        return (module(batch) - expected).abs().max().item()


def write_and_compare(
    writers: Sequence[tuple[str, str | None, Callable]],
    expected: torch.Tensor,
    check: torch.Tensor,
) -> list[tuple[str, str, float, str]]:
    """Call each ``(kind, path, write)`` that has a path; compare what ``write``
    returns with ``expected`` on ``check``; raise MismatchError above ATOL."""
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
        checked = f" on a random batch of {len(check)}"
        written.append((kind, path, difference, checked))
    return written


def export_weights(
    weights: str,
    out: str | None,
    *,
    torchscript: str | None = None,
    torch_export: str | None = None,
    cfg_file: str | None = None,
    opts: list[str] | None = None,
    onnx: str | None = None,
    onnx_atol: float = onnx_model.ATOL,
) -> list[tuple[str, str, float, str]]:
    """Write and check every artefact asked for: ``(kind, path, max difference,
    what it was compared on)``.

    Args:
        weights: the checkpoint or weights file to export.
        out: write the plain state_dict there.
        torchscript: write a traced TorchScript file there.
        torch_export: write a torch.export program (.pt2) there.
        cfg_file, opts: a yaml file and KEY VALUE pairs overriding the cfg that
            ``weights`` carries.
        onnx: write an ONNX model there, checked with ONNX Runtime within
            ``onnx_atol``.

    Raises MismatchError at the first artefact whose outputs differ; an
    OnnxError (missing package, unsupported operator) before writing anything.
    """
    model, spec, classes = load_for_inference(weights, cfg_file, opts)
    size = eval_sizes(spec.data.transform)[1]  # the images inference sees
    example = random_batch(EXAMPLE_BATCH, size, seed=0)
    check = random_batch(CHECK_BATCH, size, seed=1)
    with torch.no_grad():
        expected = model(check)
    arch, num_classes = spec.arch, spec.num_classes
    if onnx:  # first: the errors it may raise come before any file is written
        metadata = onnx_model.OnnxMetadata.from_spec(spec, classes)
        proto = onnx_model.export_program(model, example, metadata)
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
    written = write_and_compare(writers, expected, check)
    if onnx:
        written.append(write_onnx(model, spec.data, proto, onnx, onnx_atol))
    return written
