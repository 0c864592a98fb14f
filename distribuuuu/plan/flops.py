"""A model's FLOPs per image, counted once with ``FlopCounterMode`` on the
meta device (nothing is allocated or computed), and the achieved TFLOP/s
and MFU of a training window.

The counter counts what dominates a vision model: convolutions, matrix
products and attention (``torch.utils.flop_counter``); element-wise work,
norms and the optimizer are left out, as in every MFU figure (PaLM, Chowdhery
et al. 2022, appendix B; Megatron-LM, Narayanan et al. 2021, sec. 5.1).
The count is of the model's own forward and backward (the input needs no
gradient): activation checkpointing's recomputation is not model FLOPs, and
neither is a distillation teacher's forward.

On the meta device, attention runs as its math form (two batched products,
which the counter sees); on the CPU, torch's fused attention kernel has no
FLOP formula and would count nothing.  BatchNorm on meta is decomposed in
Python at some 20 ms a layer and counts no FLOPs, so the counted copy has
identities in its place.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.flop_counter import FlopCounterMode

from distribuuuu.dist import group as du
from distribuuuu.models import build_model, find_blocks
from distribuuuu.models.spec import ModelSpec
from distribuuuu.plan.devices import device_peak

logger = logging.getLogger(__name__)

CONVOLUTIONS = ("convolution", "convolution_backward")
# What a window's FLOP rate adds to its record (the MFU where a peak is known).
FLOP_KEYS = ("tflops_per_device", "mfu")


@dataclass(frozen=True)
class BlockProfile:
    """One residual / transformer block, per image."""

    forward_flops: float
    parameters: int
    output_numel: int  # elements of its output (a pipeline cut, a TP all-reduce)


@dataclass(frozen=True)
class ModelFlops:
    """What one image costs the model, and how its work is spread."""

    forward: float  # FLOPs of one image's forward pass
    backward: float  # and of its backward pass
    conv_share: float  # the share of those FLOPs in convolutions
    parameters: int
    parameter_tensors: int
    blocks: tuple[BlockProfile, ...]  # in order; () for a model without blocks
    # Every parameter's shape (what DDP's communication hooks compress).
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def per_image(self) -> float:
        """Forward and backward FLOPs of one training image."""
        return self.forward + self.backward


def _without_batch_norm(model: nn.Module) -> None:
    """Put identities in the place of ``model``'s BatchNorm layers."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm):
                setattr(module, name, nn.Identity())


def _profile_blocks(model: nn.Module, counter: FlopCounterMode, batch: int):
    """Forward hooks on the blocks that record each one's parameters, FLOPs
    and output size while ``counter`` counts; returns the records and the
    handles."""
    records: list[dict] = []
    handles = []
    for block in find_blocks(model):
        record = {"parameters": sum(p.numel() for p in block.parameters())}
        records.append(record)

        def before(module, args, record=record) -> None:
            record["start"] = counter.get_total_flops()

        def after(module, args, output, record=record) -> None:
            record["forward_flops"] = (
                counter.get_total_flops() - record["start"]
            ) / batch
            out = output[0] if isinstance(output, tuple) else output
            record["output_numel"] = out.numel() // batch

        handles.append(block.register_forward_pre_hook(before))
        handles.append(block.register_forward_hook(after))
    return records, handles


def count_flops(
    build: Callable[[], nn.Module], image_size: int, batch: int = 2
) -> ModelFlops:
    """Count the FLOPs of the model ``build`` returns (called under the meta
    device) on ``batch`` square RGB images of ``image_size`` pixels, forward
    and backward, per image.

    Raises RuntimeError (or what the model raises) for a model that cannot
    run on the meta device.
    """
    with torch.device("meta"):
        model = build()
    params = list(model.parameters())
    counter = FlopCounterMode(display=False)
    records, handles = _profile_blocks(model, counter, batch)
    _without_batch_norm(model)
    model.train()
    images = torch.empty(batch, 3, image_size, image_size, device="meta")
    try:
        with counter:
            output = model(images)
            forward = counter.get_total_flops()
            output.float().sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    total = counter.get_total_flops()
    by_op = counter.get_flop_counts().get("Global", {})
    conv = sum(n for op, n in by_op.items() if str(op).split(".")[-1] in CONVOLUTIONS)
    return ModelFlops(
        forward=forward / batch,
        backward=(total - forward) / batch,
        conv_share=conv / total if total else 0.0,
        parameters=sum(p.numel() for p in params),
        parameter_tensors=len(params),
        shapes=tuple(tuple(p.shape) for p in params),
        blocks=tuple(
            BlockProfile(r["forward_flops"], r["parameters"], r["output_numel"])
            for r in records
            if "forward_flops" in r
        ),
    )


@dataclass(frozen=True)
class FlopRate:
    """The achieved TFLOP/s per device of a training window, and the MFU where
    a dense peak is known."""

    flops_per_image: float  # forward and backward, counted (:func:`count_flops`)
    devices: int  # the devices of the whole job
    peak_flops: float | None = None  # dense peak of one device; None: unknown
    peak_source: str = ""  # where the peak comes from, in words

    def of_window(self, images: int, seconds: float) -> dict:
        """``tflops_per_device`` of a window that trained ``images`` in
        ``seconds``, and ``mfu`` (its share of the peak) where one is known."""
        achieved = self.flops_per_image * images / max(seconds, 1e-9) / self.devices
        rate = {"tflops_per_device": achieved / 1e12}
        if self.peak_flops:
            rate["mfu"] = achieved / self.peak_flops
        return rate


def format_rate(rate: dict) -> str:
    """``  123 TFLOP/s/device  MFU 41.0%`` for the log line (GFLOP/s below
    0.1 TFLOP/s), from a window's
    figures (those of :meth:`FlopRate.of_window` among others); empty
    without them."""
    if "tflops_per_device" not in rate:
        return ""
    tflops = rate["tflops_per_device"]
    text = f"  {tflops:.3g} TFLOP/s/device"
    if tflops < 0.1:  # a CPU's, or a small model's
        text = f"  {1e3 * tflops:.3g} GFLOP/s/device"
    if "mfu" in rate:
        text += f"  MFU {100 * rate['mfu']:.1f}%"
    return text


def measure_flop_rate(
    model: ModelSpec,
    image_size: int,
    devices: list[torch.device],
    amp_dtype: torch.dtype | None,
    calibrated_peak: float | None = None,
) -> FlopRate | None:
    """The FLOP rate of a run: the FLOPs of ``model`` (its architecture and
    classes), counted on the meta device, over the job's devices (this
    process's ``devices`` on each process) and the dense peak of one of them
    (:func:`~distribuuuu.plan.devices.device_peak`); None, with a line in
    the log, for a model the meta device cannot run."""
    build = functools.partial(build_model, model.arch, model.num_classes)
    try:
        flops = count_flops(build, image_size)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        logger.info(
            "TFLOP/s not shown: the model's FLOPs could not be counted (%s)", error
        )
        return None
    peak, source = device_peak(devices[0], amp_dtype, flops.conv_share, calibrated_peak)
    logger.info(
        "%.4g GFLOP per training image of %d px (forward and backward)%s",
        flops.per_image / 1e9,
        image_size,
        f"; dense peak {peak / 1e12:.4g} TFLOP/s per device ({source})" if peak else "",
    )
    processes = du.get_world_size()
    return FlopRate(flops.per_image, processes * len(devices), peak, source)


class FlopMeter:
    """The TFLOP/s and MFU of a run's training windows.

    It counts the model's FLOPs at an epoch's crop (:func:`measure_flop_rate`,
    0.05-0.5 s on a CPU core) when the first window of that crop is logged,
    after that window's time was taken and before the next one's starts: the
    run's start-up and its measured windows pay nothing for it.  Under
    TRAIN.PROGRESSIVE (``crop_of``: an epoch's crop) each crop of the ramp
    is counted once.
    """

    def __init__(
        self,
        model: ModelSpec,
        image_size: int,
        devices: list[torch.device],
        amp_dtype: torch.dtype | None,
        calibrated_peak: float | None = None,
        crop_of: Callable[[int], int] | None = None,
    ):
        self.count = functools.partial(
            measure_flop_rate,
            model,
            devices=devices,
            amp_dtype=amp_dtype,
            calibrated_peak=calibrated_peak,
        )
        self.crop_of = crop_of or (lambda epoch: image_size)
        self.rates: dict[int, FlopRate | None] = {}

    def count_once(self, epoch: int) -> FlopRate | None:
        """The FLOP rate of ``epoch`` (from 0), counted now if not yet:
        before a profiler starts, so that its trace holds the training
        steps alone."""
        size = self.crop_of(epoch)
        if size not in self.rates:
            self.rates[size] = self.count(image_size=size)
        return self.rates[size]

    def of_window(self, images: int, seconds: float, epoch: int) -> dict:
        """:meth:`FlopRate.of_window` at ``epoch``'s crop, or {} for a model
        not counted."""
        rate = self.count_once(epoch)
        return {} if rate is None else rate.of_window(images, seconds)
