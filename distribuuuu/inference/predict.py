"""Classify image files with trained weights: the top-k classes of each image
(models of a sigmoid loss, MODEL.LOSS bce or asl: every class whose
probability reaches TEST.THRESHOLD).

The model, its classes and the evaluation transforms come from the cfg saved
in the weights file (see :mod:`distribuuuu.inference.read`), or from the metadata
of an exported ONNX model run by ONNX Runtime (see
:mod:`distribuuuu.inference.onnx`); folders are searched recursively for image
files.  ``tools/predict.py`` is the command line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from distribuuuu.data import build_test_transform, find_image_files, image_reader
from distribuuuu.errors import DataError
from distribuuuu.inference.onnx import load_session, run_session
from distribuuuu.inference.read import load_for_inference


def find_images(inputs: list[str]) -> list[str]:
    """The image files named by ``inputs``, folders expanded recursively and
    sorted; only regular files (a FIFO is never opened, since reading one waits
    for a writer for ever)."""
    found = []
    for path in inputs:
        if os.path.isdir(path):
            found += sorted(find_image_files(path))
        elif os.path.isfile(path):
            found.append(path)
        elif os.path.exists(path):
            raise DataError(f"{path}: not a regular file or a folder")
        else:
            raise DataError(f"{path}: no such file or folder")
    if not found:
        raise DataError(f"no image files in {', '.join(inputs)}")
    return found


def batches(paths: list[str], size: int) -> Iterator[list[str]]:
    """``paths`` in consecutive chunks of at most ``size``."""
    for start in range(0, len(paths), size):
        yield paths[start : start + size]


def top_classes(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k probabilities and labels of a batch of transformed images."""
    with torch.no_grad():
        probabilities = model(images).float().softmax(dim=1)
    return probabilities.topk(min(topk, probabilities.shape[1]), dim=1)


def labels_above(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    threshold: float,
) -> list[list[tuple[int, float]]]:
    """The labels of each image of a sigmoid model (MODEL.LOSS bce, asl):
    every class whose probability is at or above ``threshold``, most
    probable first (none where no class reaches it)."""
    with torch.no_grad():
        probabilities = torch.sigmoid(model(images).float())
    found = []
    for row in probabilities.tolist():
        above = [(i, p) for i, p in enumerate(row) if p >= threshold]
        found.append(sorted(above, key=lambda pair: -pair[1]))
    return found


def format_line(path: str, top: list[tuple[str, float]], as_json: bool) -> str:
    """One output line: ``path  name (prob)  ...``, or a JSON object."""
    if as_json:
        classes = [{"class": name, "prob": prob} for name, prob in top]
        return json.dumps({"path": path, "top": classes})
    return "  ".join([path] + [f"{name} ({prob:.2f})" for name, prob in top])


def classify_images(
    weights: str,
    inputs: list[str],
    *,
    device: str = "cpu",
    topk: int = 3,
    batch_size: int = 64,
    cfg_file: str | None = None,
    opts: list[str] | None = None,
) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """Load the model, then yield ``(path, [(class, probability), ...])`` per image.

    Args:
        weights: the checkpoint or weights file.
        inputs: image files and folders (searched recursively, sorted).
        device: where the model runs.
        topk: classes per image; batch_size: images per forward pass.
        cfg_file, opts: a yaml file and KEY VALUE pairs overriding the cfg that
            ``weights`` carries.
    """
    model, spec, classes = load_for_inference(weights, cfg_file, opts)
    paths = find_images(inputs)
    target = torch.device(device)
    model.to(target)
    read = image_reader(spec.data.decoder)
    transform = build_test_transform(spec.data)

    def classify(images: torch.Tensor) -> torch.Tensor:
        return model(images.to(target))

    shown = Shown(topk, sigmoid_threshold(spec.loss, spec.threshold))
    yield from _classify(classify, (read, transform), classes, paths, shown, batch_size)


def classify_images_onnx(
    path: str, inputs: list[str], topk: int = 3, batch_size: int = 64
) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """As :func:`classify_images`, with an exported ONNX model run by ONNX
    Runtime on the CPU; its classes and transforms come from its metadata."""
    session, metadata = load_session(path)
    paths = find_images(inputs)
    read = image_reader(metadata.data_spec().decoder)
    transform = metadata.eval_transform()

    def classify(images: torch.Tensor) -> torch.Tensor:
        return run_session(session, images)

    shown = Shown(topk, sigmoid_threshold(metadata.loss, metadata.threshold))
    pipeline = (read, transform)
    yield from _classify(classify, pipeline, metadata.classes, paths, shown, batch_size)


class Shown(NamedTuple):
    """What predict prints of an image: its ``topk`` classes, or with
    ``threshold`` (a sigmoid model's) every label at or above it."""

    topk: int
    threshold: float | None


def sigmoid_threshold(loss: str, threshold: float) -> float | None:
    """TEST.THRESHOLD for a model of a sigmoid loss (bce, asl); None for ce."""
    return None if loss == "ce" else threshold


def _classify(
    classify: Callable[[torch.Tensor], torch.Tensor],
    pipeline: tuple[Callable, Callable],
    classes: list[str] | tuple[str, ...],
    paths: list[str],
    shown: Shown,
    batch_size: int,
) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """Read and transform (``pipeline``) and classify ``paths`` in batches;
    yield what ``shown`` asks of each."""
    read, transform = pipeline
    topk, threshold = shown
    for chunk in batches(paths, batch_size):
        images = torch.stack([transform(read(path)) for path in chunk])
        if threshold is not None:
            found = labels_above(classify, images, threshold)
            for path, labels_of in zip(chunk, found):
                yield path, [(classes[i], p) for i, p in labels_of]
            continue
        probabilities, labels = top_classes(classify, images, topk)
        for path, probs, ids in zip(chunk, probabilities.tolist(), labels.tolist()):
            yield path, [(classes[i], p) for i, p in zip(ids, probs)]
