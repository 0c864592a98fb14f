"""DATA.DECODER gpu: JPEG bytes out of the workers, decoded and cropped on the
device (issue 22).

The CPU part runs here: the header parser, the workers' bytes and draws, the
collate, and the device-side decode, crop and resize run on CPU tensors,
compared with DATA.DECODER tensor.  Tests that need CUDA skip without it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import random

import pytest
import torch
import torchvision
from helpers import assert_ok, call_main, read_metrics, refused, train_net
from PIL import Image

from distribuuuu import preflight
from distribuuuu.config import load_cfg, validation
from distribuuuu.data import (
    SeededDataset,
    build_dataset,
    build_normalizer,
    build_test_loader,
    build_train_loader,
    empty_batch,
    gpu_decode,
)
from distribuuuu.data.gpu_decode import (
    EncodedBatch,
    EncodedSample,
    collate_encoded,
    decode_batch,
    decode_jpegs,
)
from distribuuuu.data.jpeg import jpeg_header, read_or_defer
from distribuuuu.data.samplers import sample_seed
from distribuuuu.engine.specs import data_spec, loader_spec
from distribuuuu.errors import DataError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CPU = torch.device("cpu")


def _picture(width: int, height: int, label: int, seed: int) -> Image.Image:
    """Stripes across (label 0) or down (label 1) over colour ramps and noise:
    crops and flips show in the pixels, and a small network can tell the
    classes apart."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(
        torch.arange(float(height)), torch.arange(float(width)), indexing="ij"
    )
    wave = torch.sin((y if label == 0 else x) / 3.0) * 60
    pixels = torch.stack([x * 200 / width + wave, y * 200 / height, 128 - wave], -1)
    pixels += torch.randn(pixels.shape, generator=g) * 8
    return Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy())


def _image_folder(root, per_class: int = 3, odd_files: bool = True) -> None:
    """Two classes of JPEGs of several sizes (baseline, progressive, grey);
    with ``odd_files`` also a PNG and a CMYK JPEG, which the workers decode."""
    for label in range(2):
        folder = root / "train" / f"class{label}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            width, height = 90 + 17 * i, 70 + 11 * ((i + label) % 3)
            image = _picture(width, height, label, 10 * label + i)
            if i % 3 == 2:
                image = image.convert("L")
            image.save(folder / f"{i}.jpg", quality=90, progressive=i % 2 == 1)
        if odd_files:
            _picture(80, 64, label, 99).save(folder / "p.png")
            cmyk = _picture(72, 60, label, 98).convert("CMYK")
            cmyk.save(folder / "q.jpg", quality=90)


def _cfg(root, decoder: str, *keys: str):
    words = f"TRAIN.DATASET {root} TEST.DATASET {root} TEST.SPLIT train "
    words += "TRAIN.IM_SIZE 48 TEST.IM_SIZE 56 MODEL.NUM_CLASSES 2 TRAIN.HFLIP 0.5 "
    words += f"DATA.DECODER {decoder} DEVICE auto TRAIN.WORKERS 0"
    return load_cfg(None, [*words.split(), *keys])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    _image_folder(root)
    return root


# --- the JPEG header ---------------------------------------------------------


def _jpeg_bytes(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", **options)
    return out.getvalue()


def test_header_gives_the_size_and_what_the_device_takes():
    picture = _picture(123, 77, 0, 1)
    cases = [
        (picture, {}, 3, True),
        (picture, {"progressive": True}, 3, True),
        (picture.convert("L"), {}, 1, True),
        (picture.convert("CMYK"), {}, 4, False),
        # A large EXIF segment before the frame header is skipped, not read.
        (picture, {"exif": b"Exif\x00\x00" + bytes(60000)}, 3, True),
    ]
    for image, options, components, on_device in cases:
        header = jpeg_header(_jpeg_bytes(image, **options))
        assert (header.width, header.height) == (123, 77)
        assert header.components == components and header.precision == 8
        assert header.plain_8bit is on_device


def test_header_refuses_garbage_and_truncations_quickly():
    data = _jpeg_bytes(_picture(40, 30, 1, 2))
    sof = data.index(b"\xff\xc0")
    # Every prefix that ends before the frame header is complete is refused.
    for cut in range(sof + 2 + 8 + 3 * 3):
        assert jpeg_header(data[:cut]) is None, cut
    assert jpeg_header(data[: sof + 2 + 8 + 3 * 3]).width == 40
    png = io.BytesIO()
    _picture(8, 8, 0, 0).save(png, format="PNG")
    soi = b"\xff\xd8"
    hostile = [
        b"",
        png.getvalue(),
        soi + b" not really a jpeg",
        soi + b"\xff\xe0\x00\x00",  # a length below 2
        soi + b"\xff\xe0\x00\x01",
        soi + b"\xff\xe0\xff\xff" + bytes(100),  # a length past the end
        soi + b"\xff\xda\x00\x08" + bytes(6),  # a scan before any frame
        soi + b"\xff\xc0\x00\x11\x08\x00\x00\x00\x10\x03" + bytes(9),  # height 0
        soi + b"\xff\xc0\x00\x11\x08\x00\x10\x00\x10\x03" + bytes(3),  # cut short
        soi + b"\xff" * 200_000,  # fill bytes to the end: one pass
        soi + b"\xff\xd0" * 50_000,  # restart markers, no lengths
    ]
    for data in hostile:
        assert jpeg_header(data) is None, data[:24]
    noise = random.Random(5)
    for _ in range(2000):
        junk = soi + bytes(noise.randrange(256) for _ in range(noise.randrange(40)))
        header = jpeg_header(junk)
        assert header is None or (header.width > 0 and header.height > 0)


def test_pixel_limit_is_checked_from_the_header(tmp_path, monkeypatch):
    path = tmp_path / "big.jpg"
    _picture(300, 200, 0, 3).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300 * 200 - 1)
    with pytest.raises(DataError, match=r"big\.jpg: 300 x 200 pixels"):
        read_or_defer(str(path))
    garbage = tmp_path / "bad.jpg"
    garbage.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DataError, match="bad.jpg"):  # named, as tensor names it
        read_or_defer(str(garbage))


# --- workers, collate, and the device side on CPU tensors --------------------


def test_workers_serve_the_files_bytes_with_the_cpu_decoders_draws(folder):
    encoded = SeededDataset(build_dataset(data_spec(_cfg(folder, "gpu")), train=True))
    decoded = SeededDataset(
        build_dataset(data_spec(_cfg(folder, "tensor")), train=True)
    )
    normalize = build_normalizer(data_spec(_cfg(folder, "gpu")), CPU)
    reference = build_normalizer(data_spec(_cfg(folder, "tensor")), CPU)
    flips, samples = set(), []
    for index in range(len(encoded)):
        for epoch in range(3):
            seed = sample_seed(7, epoch, index)
            sample, label = encoded[(index, seed)]
            image, reference_label = decoded[(index, seed)]
            assert label == reference_label and isinstance(sample, EncodedSample)
            path = encoded.dataset.samples[index][0]
            if not sample.ready:
                with open(path, "rb") as f:
                    assert bytes(sample.data.numpy()) == f.read()
                assert sample.path == path and sample.box[2] <= 200
                flips.add(sample.flip)
            samples.append((sample, label))
            # The same crop, resize and flip, decoded here: the same pixels.
            batch, _ = collate_encoded([(sample, label)])
            assert torch.equal(normalize(batch), reference(image[None]))
    assert flips == {False, True}
    ready = sum(sample.ready for sample, _ in samples)
    assert ready == 2 * 2 * 3  # the PNG and the CMYK JPEG of each class


def test_collate_keeps_every_sample_in_its_place(folder):
    dataset = SeededDataset(build_dataset(data_spec(_cfg(folder, "gpu")), train=True))
    samples = [dataset[(index, index)] for index in range(len(dataset))]
    batch, labels = collate_encoded(samples)
    assert isinstance(batch, EncodedBatch) and len(batch) == len(samples) == 10
    assert labels.tolist() == [label for _, label in samples]
    lengths = [len(sample.data) for sample in batch.encoded]
    assert len(set(lengths)) == len(lengths) == 6  # bytes of any length
    assert sorted(batch.encoded_places + batch.ready_places) == list(range(10))
    assert batch.ready.shape == (4, 3, 48, 48) and batch.ready.dtype == torch.uint8
    images = decode_batch(batch, CPU)
    for place, (sample, _) in enumerate(samples):
        alone = decode_batch(collate_encoded([(sample, 0)])[0], CPU)[0]
        assert torch.equal(images[place], alone)
    # Decoded in runs of one or two images (at most 15,000 pixels): the same.
    assert torch.equal(decode_batch(batch, CPU, budget=15_000), images)


def _model_inputs(folder, decoder: str, train: bool, device, *keys: str) -> list:
    """(normalised images on the CPU, labels) of every batch of the train
    (epoch 1, batches of 4) or evaluation loader of ``folder``."""
    cfg = _cfg(folder, decoder, *keys)
    dataset = build_dataset(data_spec(cfg), train)
    if train:
        loader = build_train_loader(
            loader_spec(cfg),
            dataset,
            rank=0,
            world_size=1,
            seed=11,
            device=device,
            batch_size=4,
        )
        loader.sampler.set_epoch(1)
    else:
        loader = build_test_loader(loader_spec(cfg), dataset, 0, 1, device)
    normalize = build_normalizer(data_spec(cfg), device)
    return [(normalize(images).cpu(), labels) for images, labels in loader]


@pytest.mark.parametrize("train", [True, False])
def test_loader_batches_decode_to_the_tensor_decoders_input(folder, train):
    """Through the loaders: the device-side path on the CPU gives the input of
    DATA.DECODER tensor bit for bit (the bound on the CPU is 0)."""
    inputs = _model_inputs(folder, "gpu", train, CPU)
    references = _model_inputs(folder, "tensor", train, CPU)
    for (image, label), (reference, reference_label) in zip(
        inputs, references, strict=True
    ):
        assert image.shape[1:] == (3, 48, 48) and image.dtype == torch.float32
        assert torch.equal(image, reference) and torch.equal(label, reference_label)


def test_an_empty_evaluation_batch_has_the_crops_shape(folder):
    cfg = _cfg(folder, "gpu")
    sample = build_dataset(data_spec(cfg), train=False)[0][0]
    empty = build_normalizer(data_spec(cfg), CPU)(empty_batch(sample))
    assert empty.shape == (0, 3, 48, 48) and empty.dtype == torch.float32


def test_a_file_damaged_after_its_header_is_named_when_decoded(tmp_path, folder):
    data = _jpeg_bytes(_picture(64, 48, 0, 4))
    path = tmp_path / "bad.jpg"
    path.write_bytes(data[: data.index(b"\xff\xda") + 200])  # cut in the scan
    encoded = read_or_defer(str(path))
    assert encoded.header.width == 64  # the header passes the worker
    transform = build_dataset(data_spec(_cfg(folder, "gpu")), train=False).transform
    batch, _ = collate_encoded([(transform(encoded), 0)])
    with pytest.raises(DataError, match=r"bad\.jpg: .*truncated"):
        decode_batch(batch, CPU)


def test_an_image_decoded_at_another_size_than_its_header_is_refused(tmp_path, folder):
    """The device decoder parses the file again: should it read another size
    than the one the crop was drawn for (a frame header the worker's parser
    did not see, 16 x 16 here), a DataError names the file."""
    path = tmp_path / "other.jpg"
    path.write_bytes(_jpeg_bytes(_picture(64, 48, 0, 4)))
    transform = build_dataset(data_spec(_cfg(folder, "gpu")), train=False).transform
    sample = transform(read_or_defer(str(path)))
    sample.pixels = 16 * 16
    batch, _ = collate_encoded([(sample, 0)])
    with pytest.raises(DataError, match=r"other\.jpg: decoded as 64 x 48 pixels"):
        decode_batch(batch, CPU)


def test_cuda_decodes_wait_for_the_current_stream_first(folder, monkeypatch):
    """nvJPEG writes into blocks the caching allocator took back from the
    current stream while kernels queued there may still use them, and waits
    for none of them (pytorch/vision#9606): each decode call comes after the
    host has waited for that stream, on the device decoded on.  CUDA and the
    decoder are faked; the order of the host's calls is what is checked."""
    dataset = SeededDataset(build_dataset(data_spec(_cfg(folder, "gpu")), train=True))
    samples = [dataset[(index, index)] for index in range(len(dataset))]
    batch, _ = collate_encoded([pair for pair in samples if not pair[0].ready])
    expected = decode_batch(batch, CPU)
    device, calls = torch.device("cuda", 1), []
    current = [torch.device("cuda", 0)]  # the device torch.cuda.device sets

    @contextlib.contextmanager
    def on_device(where):
        calls.append(("device", torch.device(where)))
        current.append(torch.device(where))
        yield
        current.pop()
        calls.append(("device left",))

    class Stream:
        def __init__(self, where=None):
            self.where = current[-1] if where is None else torch.device(where)

        def synchronize(self):
            calls.append(("stream waited for", self.where))

    decode_on_cpu = torchvision.io.decode_jpeg

    def decode_on_gpu(data, mode, device):
        calls.append(("decode", torch.device(device), len(data)))
        return [decode_on_cpu(image, mode=mode) for image in data]

    monkeypatch.setattr(torch.cuda, "device", on_device)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_on_gpu)
    # Runs of one or two images (at most 15,000 pixels): one wait each.
    images = decode_batch(batch, device, budget=15_000)
    assert torch.equal(images, expected)
    runs = [call[2] for call in calls if call[0] == "decode"]
    assert len(runs) > 2 and sum(runs) == len(batch.encoded) == 6
    one_run = [("device", device), ("stream waited for", device)]
    assert calls == [
        call
        for images_in_run in runs
        for call in [*one_run, ("decode", device, images_in_run), ("device left",)]
    ]


def test_a_run_takes_the_encoded_batches_end_to_end(folder, tmp_path, monkeypatch):
    """Training, precise BN, evaluation and the logged grid of training images
    all take the encoded batches: DATA.DECODER gpu run on the CPU, its CUDA
    refusals lifted."""
    monkeypatch.setattr(validation, "_validate_gpu_decoder", lambda cfg, name: None)
    monkeypatch.setattr(preflight, "check_launch", lambda cfg, num_procs=1: None)
    out = str(tmp_path / "out")
    words = f"TRAIN.DATASET {folder} TEST.DATASET {folder} TEST.SPLIT train "
    words += "MODEL.ARCH resnet8 MODEL.NUM_CLASSES 2 TRAIN.IM_SIZE 32 "
    words += "TEST.IM_SIZE 36 DATA.DECODER gpu DEVICE cpu TRAIN.BATCH_SIZE 4 "
    words += "TEST.BATCH_SIZE 4 OPTIM.MAX_EPOCH 1 TRAIN.PRECISE_BN 1 "
    words += f"TRAIN.WORKERS 0 TRAIN.PRINT_FREQ 1 OUT_DIR {out}"
    assert_ok(call_main(*words.split()))
    (val,) = read_metrics(out, "val")
    assert val["samples"] == 10
    assert len(read_metrics(out, "train")) == 2


# --- the configuration -------------------------------------------------------


def test_gpu_decoder_is_refused_where_it_cannot_run(folder, tmp_path):
    base = ["TRAIN.DATASET", str(folder), "TEST.DATASET", str(folder)]
    base += ["TEST.SPLIT", "train", "MODEL.NUM_CLASSES", "2", "DATA.DECODER", "gpu"]
    out = str(tmp_path / "out")
    error = refused(out, *base, "DEVICE", "cpu")
    assert "DATA.DECODER" in error and "DEVICE is cpu" in error
    error = refused(out, *base, "DEVICE", "cuda", "DATA.AUTO_AUGMENT", "randaugment")
    assert "DATA.AUTO_AUGMENT" in error and "DATA.DECODER gpu" in error
    error = refused(out, "DATA.DECODER", "gpu", "DATA.NAME", "synthetic")
    assert "imagefolder" in error
    if not torch.cuda.is_available():
        error = refused(out, *base, "DEVICE", "auto")
        assert "CUDA is not available" in error


# --- on CUDA ----------------------------------------------------------------
# nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's, and torchvision
# resizes uint8 images on CUDA through float32 (on the CPU with its own uint8
# kernel); both move pixels by a few levels.  Bound: a mean difference under 2
# levels of 255 per pixel.  Not measured on a GPU yet.
GPU_MEAN_LEVELS = 2.0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("train", [True, False])
def test_cuda_batches_match_the_tensor_decoder_within_the_bound(folder, train):
    cuda, pinned = torch.device("cuda"), ("TRAIN.PIN_MEMORY", "True")
    inputs = _model_inputs(folder, "gpu", train, cuda, *pinned)
    references = _model_inputs(folder, "tensor", train, cuda, *pinned)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1) * 255
    for (image, label), (reference, reference_label) in zip(
        inputs, references, strict=True
    ):
        levels = ((image - reference) * std).abs()
        assert levels.mean() < GPU_MEAN_LEVELS, levels.mean()
        assert torch.equal(label, reference_label)


@pytest.mark.cuda
@needs_cuda
def test_cuda_decodes_stay_intact_behind_a_busy_stream(monkeypatch):
    """pytorch/vision#9606 through our decoder: before each of 40 batches of
    mixed sizes, kernels queued behind a long one write and read blocks that
    the host has already freed, as a training step leaves them.  Every image
    matches libjpeg-turbo's within the bound (baseline JPEGs take nvJPEG's
    hardware path on an A100 or H100, progressive ones its software path),
    and every queued sum is exact: the decoder wrote over neither."""

    def fail_on_refusal(error):
        pytest.fail(f"nvJPEG refused a batch, which was decoded on the CPU: {error}")

    monkeypatch.setattr(gpu_decode, "_warn_refused_batch", fail_on_refusal)
    cuda, draws, samples = torch.device("cuda"), random.Random(9), []
    for i in range(16):
        image = _picture(64 + 37 * i, 48 + 23 * (5 * i % 11), i % 2, 100 + i)
        if i % 5 == 4:
            image = image.convert("L")
        data = _jpeg_bytes(image, quality=70 + i, progressive=i % 4 == 3)
        data = torch.tensor(list(data), dtype=torch.uint8)
        samples.append(EncodedSample(None, data, f"{i}.jpg"))
    references = decode_jpegs(samples, CPU)
    for step in range(40):
        chosen = draws.sample(range(len(samples)), 6)
        value = 3 + step  # doubled, still a uint8
        sources = [
            torch.full(references[i].shape, value, dtype=torch.uint8, device=cuda)
            for i in chosen
        ]
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # about 10 ms: what follows waits behind it
        sums = []
        for source in sources:
            doubled = source * 2  # the same size as a decoded image; freed at once
            sums.append(doubled.sum(dtype=torch.int64))
        del doubled, sources
        images = decode_jpegs([samples[i] for i in chosen], cuda)
        for i, image in zip(chosen, images, strict=True):
            levels = (image.cpu().float() - references[i].float()).abs().mean()
            assert levels < GPU_MEAN_LEVELS, (step, i, levels)
        expected = [2 * value * math.prod(references[i].shape) for i in chosen]
        assert [int(total) for total in sums] == expected, step


@pytest.mark.slow
@pytest.mark.cuda
@needs_cuda
def test_a_short_cuda_run_with_the_gpu_decoder_learns(tmp_path):
    root = tmp_path / "images"
    _image_folder(root, per_class=24, odd_files=False)
    out = str(tmp_path / "out")
    words = f"TRAIN.DATASET {root} TEST.DATASET {root} TEST.SPLIT train "
    words += "MODEL.ARCH resnet8 MODEL.NUM_CLASSES 2 TRAIN.IM_SIZE 48 "
    words += "TEST.IM_SIZE 56 DATA.DECODER gpu DEVICE cuda TRAIN.BATCH_SIZE 8 "
    words += f"TEST.BATCH_SIZE 16 OPTIM.MAX_EPOCH 6 TRAIN.WORKERS 2 OUT_DIR {out}"
    assert_ok(train_net(*words.split()))
    val = read_metrics(out, "val")
    assert val[-1]["samples"] == 48
    # Stripes across or down: 100% after 4 epochs when run on the CPU.
    assert val[-1]["top1"] >= 80.0
    assert os.path.isfile(os.path.join(out, "config.yaml"))
