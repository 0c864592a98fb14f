"""Data sets, transforms and the exact evaluation sampler."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from distribuuuu.config import get_cfg, load_cfg, resolve_data_name
from distribuuuu.data import (
    SeededDataset,
    build_dataset,
    build_normalizer,
    build_test_loader,
    build_test_transform,
    build_train_loader,
    eval_sizes,
    flip_probability,
    image_reader,
)
from distribuuuu.data.datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SyntheticDataset,
    load_mnist5k,
)
from distribuuuu.data.samplers import (
    ExactShardSampler,
    ResumableTrainSampler,
    sample_seed,
)
from distribuuuu.engine.specs import data_spec, loader_spec, transform_spec


def test_mnist5k_split_is_fixed_balanced_and_disjoint():
    train_x, train_y = load_mnist5k(train=True)
    val_x, val_y = load_mnist5k(train=False)
    assert train_x.shape == (4000, 1, 28, 28) and val_x.shape == (1000, 1, 28, 28)
    assert train_x.dtype == torch.uint8
    assert torch.bincount(val_y).tolist() == [100] * 10
    assert torch.bincount(train_y).tolist() == [400] * 10
    train_rows = {bytes(x.flatten().tolist()) for x in train_x}
    assert not any(bytes(x.flatten().tolist()) in train_rows for x in val_x[:200])
    again_x, _ = load_mnist5k(train=False)
    assert torch.equal(val_x, again_x)


def test_mnist5k_samples_are_three_channel_uint8_normalised_on_the_device():
    cfg = load_cfg()
    image, label = build_dataset(data_spec(cfg), train=False)[0]
    assert image.shape == (3, 28, 28) and image.dtype == torch.uint8
    assert 0 <= label < 10
    normalize = build_normalizer(
        data_spec(cfg), torch.device("cpu"), channels_last=True
    )
    batch = normalize(torch.stack([image, image]))
    assert batch.dtype == torch.float32 and batch.shape == (2, 3, 28, 28)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    # MNIST's mean and std: a blank pixel is -0.42, ink 2.8.
    expected = (image.float() / 255 - 0.1307) / 0.3081
    assert torch.allclose(batch[1], expected, atol=1e-5)
    assert torch.equal(normalize(image), batch[0])  # one image, or a batch
    with pytest.raises(TypeError, match="uint8"):
        normalize(batch)


def test_uint8_pipeline_matches_torchvisions_float_one_with_erasing():
    """Crop, flip and erasing on uint8 in the workers, then normalisation on the
    device, give torchvision's reference order (erase after Normalize) from
    the same random numbers; erased pixels differ by the mean's rounding."""
    words = ["MODEL.DUMMY_INPUT", "True", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"]
    cfg = load_cfg(None, [*words, "DATA.RANDOM_ERASING", "1.0"])
    dataset = build_dataset(data_spec(cfg), train=True)
    raw = SyntheticDataset(len(dataset), 32, cfg.MODEL.NUM_CLASSES)
    reference = v2.Compose([
        v2.RandomCrop(32, padding=4),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        v2.RandomErasing(p=1.0),
    ])  # fmt: skip
    normalize = build_normalizer(data_spec(cfg), torch.device("cpu"))
    for index in range(4):
        torch.manual_seed(index)
        ours = normalize(dataset[index][0])
        torch.manual_seed(index)
        expected = reference(raw[index][0])
        erased = expected == 0
        assert 0.02 < erased.float().mean() < 0.34  # erasing covers 2-33%
        assert torch.allclose(ours[~erased], expected[~erased], atol=1e-5)
        assert ours[erased].abs().max() < 0.01


def test_test_transform_takes_a_pil_image_to_the_models_input():
    cfg = load_cfg()
    image, _ = build_dataset(data_spec(cfg), train=False)[5]
    picture = Image.fromarray(image[0].numpy(), mode="L").convert("RGB")
    expected = build_normalizer(data_spec(cfg), torch.device("cpu"))(image)
    assert torch.equal(build_test_transform(data_spec(cfg))(picture), expected)


@pytest.mark.parametrize("size", [7, 10, 1000, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_sampler_visits_every_index_once(size, world):
    seen = []
    for rank in range(world):
        sampler = ExactShardSampler(size, rank, world)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        seen += indices
    assert sorted(seen) == list(range(size))


def test_loaders_shard_without_overlap():
    cfg = load_cfg(
        None,
        [
            "MODEL.DUMMY_INPUT",
            "True",
            "DATA.SYNTHETIC_SIZE",
            "[40, 11]",
            "TRAIN.BATCH_SIZE",
            "4",
            "TEST.BATCH_SIZE",
            "4",
        ],
    )
    train_set = build_dataset(data_spec(cfg), train=True)
    val_set = build_dataset(data_spec(cfg), train=False)
    cpu = torch.device("cpu")
    counts = [
        len(build_test_loader(loader_spec(cfg), val_set, r, 3, cpu).sampler)
        for r in range(3)
    ]
    assert sum(counts) == 11
    loader = build_train_loader(
        loader_spec(cfg),
        train_set,
        rank=1,
        world_size=2,
        seed=3,
        device=cpu,
        batch_size=4,
    )
    loader.sampler.set_epoch(0)
    first = list(loader.sampler)
    loader.sampler.set_epoch(1)
    assert list(loader.sampler) != first
    assert len(loader) == 20 // 4


@pytest.mark.parametrize("size", [12, 13, 40])
def test_train_order_resumes_on_any_world_size(size):
    def shard(world: int, start: int) -> list[int]:
        order = []
        for rank in range(world):
            sampler = ResumableTrainSampler(size, rank, world, seed=5)
            sampler.set_epoch(2, start)
            assert len(list(sampler)) == len(sampler)
            order += [index for index, _ in sampler]
        return order

    full = shard(1, 0)
    assert sorted(full) == list(range(size))
    # 2 processes consume the first 6 positions, 3 processes continue: together
    # they see every sample of the epoch once (up to the padding).
    seen = full[:6] + shard(3, 6)
    assert set(seen) == set(range(size)) and len(seen) <= size + 2
    assert set(shard(2, 0)) == set(range(size))


def test_augmentation_depends_on_seed_epoch_and_index_only():
    cfg = load_cfg()
    dataset = SeededDataset(build_dataset(data_spec(cfg), train=True))
    a = dataset[(7, sample_seed(1, 0, 7))][0]
    torch.rand(100)  # disturbing the global generator changes nothing
    assert torch.equal(a, dataset[(7, sample_seed(1, 0, 7))][0])
    assert not torch.equal(a, dataset[(7, sample_seed(1, 1, 7))][0])


def test_synthetic_images_are_deterministic():
    cfg = load_cfg(
        None, ["MODEL.DUMMY_INPUT", "True", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"]
    )
    a = build_dataset(data_spec(cfg), train=False)
    b = build_dataset(data_spec(cfg), train=False)
    assert torch.equal(a[3][0], b[3][0]) and a[3][1] == b[3][1]
    assert a[3][0].shape == (3, 32, 32)


def test_imagefolder_reads_each_split_from_its_own_key(tmp_path):
    for split, count in (("train", 3), ("val", 2)):
        for name in ("cat", "dog"):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (50, 40), (i * 40, 10, 200)).save(folder / f"{i}.png")
    cfg = load_cfg(
        None,
        [
            "TRAIN.DATASET",
            str(tmp_path),
            "TEST.DATASET",
            str(tmp_path),
            "TRAIN.IM_SIZE",
            "32",
            "TEST.IM_SIZE",
            "36",
            "MODEL.NUM_CLASSES",
            "2",
        ],
    )
    train_set, val_set = (
        build_dataset(data_spec(cfg), train=True),
        build_dataset(data_spec(cfg), train=False),
    )
    assert (len(train_set), len(val_set)) == (6, 4)
    assert train_set.classes == ["cat", "dog"]
    assert train_set[0][0].shape == (3, 32, 32) and val_set[0][0].shape == (3, 32, 32)


def _jpeg_folder(root) -> None:
    """Two classes of two 120 x 90 JPEGs: smooth colour ramps with a sine wave."""
    y, x = torch.meshgrid(torch.arange(90.0), torch.arange(120.0), indexing="ij")
    for label in range(2):
        folder = root / f"class{label}"
        folder.mkdir(parents=True)
        for i in range(2):
            red = 2 * x + 40 * torch.sin(y / (7 + i))
            pixels = torch.stack([red, 2.5 * y, 120 + 60 * torch.cos(x / 9)], dim=-1)
            array = pixels.clamp(0, 255).to(torch.uint8).numpy()
            Image.fromarray(array).save(folder / f"{i}.jpg", quality=95)


def _folder_cfg(root, decoder: str):
    words = f"TRAIN.DATASET {root} TEST.DATASET {root} TEST.SPLIT train "
    words += (
        f"TRAIN.IM_SIZE 48 TEST.IM_SIZE 56 MODEL.NUM_CLASSES 2 DATA.DECODER {decoder}"
    )
    return load_cfg(None, words.split())


def test_tensor_decoder_draws_the_same_augmentation_as_pil(tmp_path):
    _jpeg_folder(tmp_path / "train")
    tensor_cfg, pil_cfg = _folder_cfg(tmp_path, "tensor"), _folder_cfg(tmp_path, "pil")
    fast = SeededDataset(build_dataset(data_spec(tensor_cfg), train=True))
    classic = SeededDataset(build_dataset(data_spec(pil_cfg), train=True))
    for index in range(4):
        seed = sample_seed(3, 0, index)
        image, label = fast[(index, seed)]
        reference, reference_label = classic[(index, seed)]
        assert image.dtype == reference.dtype == torch.uint8
        assert label == reference_label
        # Same crop and flip; the pixels differ by decoder and resize rounding
        # only (about a level of 255).
        assert (image.float() - reference.float()).abs().mean() < 1.2
        other = classic[(index, sample_seed(3, 1, index))][0]
        assert (other.float() - reference.float()).abs().mean() > 12  # another crop
    val_fast = build_dataset(data_spec(tensor_cfg), train=False)[1][0]
    val_classic = build_dataset(data_spec(pil_cfg), train=False)[1][0]
    assert (val_fast.float() - val_classic.float()).abs().mean() < 1.2


@pytest.mark.parametrize("decoder", ["fused", "tensor", "pil"])
def test_predict_pipeline_gives_the_evaluation_input(tmp_path, decoder):
    """A file read and transformed for prediction is the model input of its
    evaluation, bit for bit, with either decoder."""
    _jpeg_folder(tmp_path / "train")
    cfg = _folder_cfg(tmp_path, decoder)
    val_set = build_dataset(data_spec(cfg), train=False)
    normalize = build_normalizer(data_spec(cfg), torch.device("cpu"))
    read, transform = (
        image_reader(data_spec(cfg).decoder),
        build_test_transform(data_spec(cfg)),
    )
    for (path, _), (image, _) in zip(val_set.samples, val_set):
        assert torch.equal(transform(read(path)), normalize(image))


def test_tensor_decoder_reads_other_formats_and_names_a_damaged_file(tmp_path):
    from distribuuuu.data.image_files import decode_image_file, load_image
    from distribuuuu.errors import DataError

    image = Image.new("RGB", (30, 20), (200, 30, 90))
    image.putpixel((3, 4), (0, 255, 0))
    image.save(tmp_path / "a.bmp")  # a format torchvision.io does not decode
    decoded = decode_image_file(str(tmp_path / "a.bmp"))
    assert decoded.shape == (3, 20, 30) and decoded.dtype == torch.uint8
    assert decoded[:, 4, 3].tolist() == [0, 255, 0]
    assert torch.equal(
        decoded, v2.functional.pil_to_tensor(load_image(str(tmp_path / "a.bmp")))
    )
    garbage = tmp_path / "bad.jpg"
    garbage.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DataError, match="bad.jpg"):
        decode_image_file(str(garbage))


# --- evaluation geometry, interpolation and the flip ------------------------ #
def _cfg(*keys: str):
    """The default config with ``keys`` merged, unvalidated (no image folder
    needs to exist for a transform)."""
    cfg = get_cfg()
    cfg.merge_from_list(list(keys))
    return cfg


def _picture(width: int = 400, height: int = 300) -> Image.Image:
    """An RGB picture whose columns differ, so a flip or a crop shows."""
    ramp = torch.linspace(0, 255, width).to(torch.uint8).expand(height, width)
    pixels = torch.stack([ramp, ramp.flip(1), torch.full_like(ramp, 90)], -1)
    return Image.fromarray(pixels.numpy())


def test_fixres_evaluates_a_larger_crop_than_training():
    """torchvision's ResNet-50 recipe: train 176, evaluate 224 crops of 232."""
    keys = ["DATA.NAME", "imagefolder", "TRAIN.IM_SIZE", "176", "TEST.IM_SIZE"]
    cfg = _cfg(*keys, "232", "TEST.CROP_SIZE", "224")
    assert eval_sizes(transform_spec(cfg)) == (232, 224)
    assert build_test_transform(data_spec(cfg))(_picture()).shape == (3, 224, 224)
    cfg = _cfg(*keys, "232")  # no crop size: the training size
    assert build_test_transform(data_spec(cfg))(_picture()).shape == (3, 176, 176)


def test_crop_pct_gives_the_resize():
    keys = ["DATA.NAME", "imagefolder", "TRAIN.IM_SIZE", "224", "TEST.IM_SIZE"]
    cfg = _cfg(*keys, "224", "TEST.CROP_PCT", "0.875")
    assert eval_sizes(transform_spec(cfg)) == (
        256,
        224,
    )  # floor(224 / 0.875), TEST.IM_SIZE unused
    same = _cfg(*keys, "256")
    picture = _picture()
    assert torch.equal(build_test_transform(data_spec(cfg))(picture),
                       build_test_transform(data_spec(same))(picture))  # fmt: skip


def test_bicubic_and_bilinear_resample_differently():
    keys = ["DATA.NAME", "imagefolder", "TRAIN.IM_SIZE", "64", "TEST.IM_SIZE", "72"]
    noise = torch.randint(0, 256, (300, 400, 3), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
    picture = Image.fromarray(noise.numpy())
    bilinear = build_test_transform(data_spec(_cfg(*keys)))(picture)
    bicubic = _cfg(*keys, "TEST.INTERPOLATION", "bicubic")
    assert not torch.equal(build_test_transform(data_spec(bicubic))(picture), bilinear)


def test_digits_evaluate_at_the_crop_size():
    cfg = load_cfg(None, ["TEST.CROP_SIZE", "32", "TEST.IM_SIZE", "32"])
    image, _ = build_dataset(data_spec(cfg), train=False)[0]
    assert image.shape == (3, 32, 32)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ([], 0.0),  # the digits: a mirrored 2 is not a 2
        (["MODEL.DUMMY_INPUT", "True"], 0.5),
        (["DATA.NAME", "imagefolder"], 0.5),
        (["TRAIN.HFLIP", "0"], 0.0),
        (["TRAIN.HFLIP", "0.25"], 0.25),
    ],
)
def test_hflip_probability(keys, expected):
    cfg = load_cfg(None, keys) if "imagefolder" not in keys else _cfg(*keys)
    assert flip_probability(transform_spec(cfg), resolve_data_name(cfg)) == expected


def test_hflip_one_always_mirrors_the_training_images():
    keys = ["DATA.NAME", "imagefolder", "TRAIN.IM_SIZE", "300", "TEST.IM_SIZE"]
    cfg = _cfg(*keys, "300", "TRAIN.HFLIP", "1.0")
    from distribuuuu.data.transforms import imagenet_transforms

    mirrored = imagenet_transforms(True, 300, 300, IMAGENET_MEAN, flip=1.0)
    kept = imagenet_transforms(True, 300, 300, IMAGENET_MEAN, flip=0.0)
    for seed in range(3):
        torch.manual_seed(seed)
        a = mirrored(_picture(300, 300))
        torch.manual_seed(seed)
        b = kept(_picture(300, 300))
        assert torch.equal(a, b.flip(-1))
    assert flip_probability(transform_spec(cfg), "imagefolder") == 1.0
