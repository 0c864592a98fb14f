"""DATA.DECODER gpu: JPEG files decoded, cropped and resized on the run's device.

The loader's workers read each file and parse its JPEG header (no pixel is
decoded there), draw the sample's crop and flip from the image size with the
sample's seed (the very draws the CPU decoders make, so a seed gives the same
crop), and hand the bytes on.  The main process decodes each batch on the
device with ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA, batched), applies
the crop and resize of the CPU pipeline there (the same torchvision kernels,
with the same parameters), and normalises with :class:`ToNormalizedFloat`.

Files the device decoder does not take (PNG and the other formats, and JPEGs
that are not 8-bit Huffman-coded grey or YCbCr: CMYK, 12-bit, arithmetic,
lossless) are decoded and transformed in the worker as DATA.DECODER tensor
does, from the same draws, and travel as finished uint8 pixels.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torchvision.transforms import v2

from distribuuuu.data.jpeg import JpegFile
from distribuuuu.data.transforms import ToNormalizedFloat, shape_only
from distribuuuu.errors import DataError

logger = logging.getLogger(__name__)

# Pixels of full-size images decoded in one call: the device memory they hold
# at once (3 bytes a pixel: about 200 MB), whatever the batch size.
DECODE_PIXELS = 2**26


class DeviceGeometry:
    """The crop, resize and flip of a CPU pipeline, split into the draws (in
    the worker, from the image size) and the pixel work (on any device).

    It takes the pipeline's own transform objects, so sizes, scale and ratio
    ranges and interpolation are those of the CPU path by construction:
    training is RandomResizedCrop and an optional RandomHorizontalFlip,
    evaluation Resize then CenterCrop.  Anything else (auto-augment, random
    erasing) needs the pixels in the worker: a ValueError names it.
    """

    def __init__(self, pipeline: v2.Compose):
        steps = [s for s in pipeline.transforms if not isinstance(s, v2.PILToTensor)]
        kinds = [type(step) for step in steps]
        crop, flip = v2.RandomResizedCrop, v2.RandomHorizontalFlip
        if kinds in ([crop], [crop, flip]):
            self.train, self.crop = True, steps[0]
            self.flip = steps[1] if len(steps) > 1 else None
            self.size = tuple(self.crop.size)
        elif kinds == [v2.Resize, v2.CenterCrop]:
            self.train, (self.resize, self.center) = False, steps
            self.size = tuple(self.center.size)
        else:
            names = ", ".join(kind.__name__ for kind in kinds)
            raise ValueError(f"DATA.DECODER gpu cannot run {names} on the device")

    def draw(self, height: int, width: int) -> tuple[tuple[int, ...], bool]:
        """The crop box (top, left, height, width) and flip of one image of
        ``height`` x ``width``, drawn from torch's default generator as the
        CPU pipeline draws them; the whole image and no flip in evaluation."""
        if not self.train:
            return (0, 0, height, width), False
        params = self.crop.make_params([shape_only(height, width)])
        box = (params["top"], params["left"], params["height"], params["width"])
        # RandomHorizontalFlip draws once and leaves the image when rand >= p.
        flip = self.flip is not None and bool(torch.rand(1) < self.flip.p)
        return box, flip

    def apply(self, image: torch.Tensor, box: tuple[int, ...], flip: bool):
        """``image`` (uint8, 3 x H x W, on any device) cropped, resized and
        flipped as the CPU pipeline does for the same draws."""
        if not self.train:
            return self.center(self.resize(image))
        top, left, height, width = box
        params = {"top": top, "left": left, "height": height, "width": width}
        image = self.crop.transform(image, params)
        if flip and self.flip is not None:
            return self.flip.transform(image, {})
        return image


@dataclass
class EncodedSample:
    """One sample as a worker serves it: JPEG bytes with the crop box and flip
    drawn for it, or the finished pixels of a file decoded in the worker
    (``ready``)."""

    geometry: DeviceGeometry
    data: torch.Tensor
    path: str = ""
    box: tuple[int, ...] = ()
    flip: bool = False
    pixels: int = 0  # of the decoded image, from the header
    ready: bool = False


class DeferredTransform:
    """The worker's side of a CPU pipeline: draws for JPEG bytes, the whole
    pipeline for an image decoded in the worker.  Both take the same numbers
    from the generator, so either way a sample's seed fixes its crop."""

    def __init__(self, pipeline: v2.Compose):
        self.pipeline = pipeline
        self.geometry = DeviceGeometry(pipeline)

    def __call__(self, image: JpegFile | torch.Tensor) -> EncodedSample:
        if isinstance(image, torch.Tensor):
            return EncodedSample(self.geometry, self.pipeline(image), ready=True)
        height, width = image.header.height, image.header.width
        box, flip = self.geometry.draw(height, width)
        return EncodedSample(
            self.geometry,
            torch.frombuffer(image.data, dtype=torch.uint8),
            path=image.name,
            box=box,
            flip=flip,
            pixels=height * width,
        )


@dataclass
class EncodedBatch:
    """A batch of :class:`EncodedSample`: the JPEG samples and their places in
    the batch, and the finished pixels of the others (stacked) and theirs."""

    geometry: DeviceGeometry
    size: int
    encoded: list[EncodedSample] = field(default_factory=list)
    encoded_places: list[int] = field(default_factory=list)
    ready: torch.Tensor | None = None
    ready_places: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return self.size

    def pin_memory(self) -> EncodedBatch:
        """The batch in pinned memory (the DataLoader's pin thread calls this)."""
        for sample in self.encoded:
            sample.data = sample.data.pin_memory()
        if self.ready is not None:
            self.ready = self.ready.pin_memory()
        return self


def collate_encoded(
    samples: list[tuple[EncodedSample, int]],
) -> tuple[EncodedBatch, torch.Tensor]:
    """The loader's collate for DATA.DECODER gpu: one :class:`EncodedBatch`
    of byte tensors of any lengths, and the labels as a tensor."""
    batch = EncodedBatch(samples[0][0].geometry, len(samples))
    ready = []
    for place, (sample, _) in enumerate(samples):
        if sample.ready:
            ready.append(sample.data)
            batch.ready_places.append(place)
        else:
            batch.encoded.append(sample)
            batch.encoded_places.append(place)
    batch.ready = torch.stack(ready) if ready else None
    labels = [label for _, label in samples]
    if labels and isinstance(labels[0], torch.Tensor):  # multi-hot rows
        return batch, torch.stack(labels)
    return batch, torch.tensor(labels)


def empty_batch(sample: EncodedSample) -> EncodedBatch:
    """A batch of no images shaped as ``sample``'s (an evaluation pads with it)."""
    return EncodedBatch(sample.geometry, 0)


def decode_jpegs(samples: list[EncodedSample], device: torch.device) -> list:
    """The JPEG bytes of ``samples`` (on the CPU) as RGB uint8 images on
    ``device``.

    On CUDA one batched nvJPEG call, made once the host has waited for the
    device's current stream to run all it has queued: one host
    synchronization per call (per batch, unless a batch's images exceed
    DECODE_PIXELS), beside torchvision's own (it waits for its decode to
    finish before it returns).  Should nvJPEG refuse the batch, each image is
    decoded on the CPU (libjpeg-turbo, as DATA.DECODER tensor) and copied
    over; a DataError names a file that neither decodes.

    Why the host waits: torchvision takes the output tensors from the caching
    allocator on the current stream, which hands out a block freed there at
    once, while kernels queued on that stream may still read or write it
    (the previous step's temporaries, or the last run's decoded images).
    nvJPEG writes the outputs from a private stream that never waits for the
    current one, and its hardware engine writes even before work queued on
    its own stream has run (pytorch/vision#9606, meta-pytorch/torchcodec#1634),
    so no wait queued on the GPU (an event) orders those writes; an idle
    stream leaves them nothing to overwrite.  The cost: the decode no longer
    overlaps the work the stream had left (the end of the previous step).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    rgb = ImageReadMode.RGB
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders
        warnings.simplefilter("ignore", DeprecationWarning)
        if samples and device.type == "cuda":
            with torch.cuda.device(device):
                # Outside the try: an error of an earlier kernel surfaces
                # here and is not taken for nvJPEG refusing the batch.
                torch.cuda.current_stream(device).synchronize()
                try:
                    data = [sample.data for sample in samples]
                    return decode_jpeg(data, mode=rgb, device=device)
                except RuntimeError as error:  # one image it does not take
                    _warn_refused_batch(error)
        images = []
        for sample in samples:
            try:
                image = decode_jpeg(sample.data, mode=rgb)
            except RuntimeError as error:
                raise DataError(f"cannot read image {sample.path}: {error}") from error
            images.append(image.to(device, non_blocking=True))
        return images


_refused_batches = [0]  # batches nvJPEG refused in this process


def _warn_refused_batch(error: RuntimeError) -> None:
    """Warn of the first batch nvJPEG refuses in this process (the others
    follow the same path, silently)."""
    _refused_batches[0] += 1
    if _refused_batches[0] == 1:
        logger.warning(
            "nvJPEG refused a batch (%s); its images are decoded on the CPU, "
            "here and in any later batch it refuses",
            error,
        )


def _chunks(pixels: list[int], budget: int) -> list[range]:
    """Consecutive runs of the images of ``pixels`` (counts) holding at most
    ``budget`` pixels each, or a single image above it."""
    runs, start, total = [], 0, 0
    for index, count in enumerate(pixels):
        if index > start and total + count > budget:
            runs.append(range(start, index))
            start, total = index, 0
        total += count
    if start < len(pixels):
        runs.append(range(start, len(pixels)))
    return runs


def decode_batch(
    batch: EncodedBatch, device: torch.device, budget: int = DECODE_PIXELS
) -> torch.Tensor:
    """``batch`` as a uint8 tensor N x 3 x H x W on ``device``: decoded, cropped,
    resized and flipped there (the finished pixels copied in).

    The JPEGs are decoded in runs of at most ``budget`` pixels, each run
    cropped before the next is decoded: full-size images of a batch never
    hold more device memory than that (or one image above it).
    """
    images: list[torch.Tensor | None] = [None] * len(batch)
    geometry, encoded = batch.geometry, batch.encoded
    for run in _chunks([sample.pixels for sample in encoded], budget):
        decoded = decode_jpegs([encoded[i] for i in run], device)
        for i, image in zip(run, decoded):
            sample = encoded[i]
            _check_decoded_size(image, sample)
            image = geometry.apply(image, sample.box, sample.flip)
            images[batch.encoded_places[i]] = image
    if batch.ready is not None:
        ready = batch.ready.to(device, non_blocking=True)
        for place, image in zip(batch.ready_places, ready):
            images[place] = image
    if not images:
        return torch.empty((0, 3, *geometry.size), dtype=torch.uint8, device=device)
    return torch.stack(cast(list[torch.Tensor], images))  # every place filled


def _check_decoded_size(image: torch.Tensor, sample: EncodedSample) -> None:
    """Refuse an image that the device decoder read at another size than the
    header the worker drew its crop from and checked the pixel limit on (its
    own parser, not libjpeg's): a DataError names the file."""
    height, width = image.shape[-2:]
    if height * width != sample.pixels:
        raise DataError(
            f"cannot read image {sample.path}: decoded as {width} x {height} "
            f"pixels, where its header gives {sample.pixels} pixels"
        )


class DeviceDecoder(nn.Module):
    """The input step of DATA.DECODER gpu: an :class:`EncodedBatch` decoded
    and transformed on the device of ``normalize`` (:func:`decode_batch`),
    then normalised by it; a uint8 tensor (one image, or a batch) goes to
    ``normalize`` alone."""

    def __init__(self, normalize: ToNormalizedFloat):
        super().__init__()
        self.normalize = normalize

    @property
    def mean(self) -> tuple[float, float, float]:
        """The mean of ``normalize`` (what exported models record)."""
        return self.normalize.mean

    @property
    def std(self) -> tuple[float, float, float]:
        """The std of ``normalize``."""
        return self.normalize.std

    def forward(self, images: EncodedBatch | torch.Tensor) -> torch.Tensor:
        if isinstance(images, EncodedBatch):
            images = decode_batch(images, self.normalize.shift.device)
        return self.normalize(images)
