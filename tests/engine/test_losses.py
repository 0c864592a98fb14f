"""The training loss: label smoothing, Mixup / CutMix with soft targets, and
training and resuming with them."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_ok,
    keep_only_checkpoint,
    last_checkpoint_weights,
    read_metrics,
    read_text,
    train_net,
)

from distribuuuu.config import get_cfg, load_cfg
from distribuuuu.engine.losses import TrainLoss, build_mixer, build_train_loss, mix_seed
from distribuuuu.engine.specs import loss_spec
from distribuuuu.engine.trainer import train_model
from distribuuuu.logger import setup_logging

NUM_CLASSES = 5


def _batch(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(size, 3, 8, 8, generator=generator)
    return images, torch.arange(size) % NUM_CLASSES


def test_defaults_are_plain_cross_entropy_bit_for_bit():
    spec = dataclasses.replace(loss_spec(get_cfg()), num_classes=NUM_CLASSES)
    loss_fn = build_train_loss(spec)
    images, labels = _batch()
    mixed, hard, soft = loss_fn.mix(images, labels, seed=3)
    assert mixed is images and hard is labels and soft is labels
    logits = torch.randn(8, NUM_CLASSES, requires_grad=True)
    ours, plain = loss_fn(logits, labels), F.cross_entropy(logits, labels)
    assert torch.equal(ours, plain)
    ours_grad = torch.autograd.grad(ours, logits)[0]
    assert torch.equal(ours_grad, torch.autograd.grad(plain, logits)[0])


def test_label_smoothing_loss_value():
    eps = 0.1
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5, 0.0]])
    label = torch.tensor([0])
    log_p = logits.log_softmax(dim=1)[0]
    # (1 - eps) on the label's cross-entropy, eps spread evenly over the classes.
    expected = -(1 - eps) * log_p[0] - eps * log_p.mean()
    loss = TrainLoss(NUM_CLASSES, label_smoothing=eps)(logits, label)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() != pytest.approx(F.cross_entropy(logits, label).item())


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_soft_target_loss_is_the_mixture_of_the_two_losses(eps):
    lam = 0.7
    logits = torch.randn(4, NUM_CLASSES, generator=torch.Generator().manual_seed(1))
    first, second = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 1, 0, 2])
    soft = lam * F.one_hot(first, NUM_CLASSES) + (1 - lam) * F.one_hot(second, 5)
    loss_fn = TrainLoss(NUM_CLASSES, label_smoothing=eps)
    expected = lam * loss_fn(logits, first) + (1 - lam) * loss_fn(logits, second)
    assert loss_fn(logits, soft.float()).item() == pytest.approx(expected.item())


def test_mixup_targets_match_the_mixed_images():
    images, labels = _batch(NUM_CLASSES)  # one image of each class
    loss_fn = TrainLoss(NUM_CLASSES, mixer=build_mixer(NUM_CLASSES, mixup_alpha=1.0))
    mixed, hard, soft = loss_fn.mix(images, labels, seed=5)
    assert soft.shape == (NUM_CLASSES, NUM_CLASSES)
    assert sorted(hard.tolist()) == labels.tolist()  # reordered, not changed
    assert hard.tolist() != labels.tolist()  # pairs are drawn at random
    # Image i is lam * x_i + (1 - lam) * x_{i-1}; its target mixes the labels alike.
    source = images[hard]  # image j has label j
    lam = soft[0, hard[0]].item()
    expected = lam * source + (1 - lam) * source.roll(1, 0)
    assert 0 < lam < 1 and torch.allclose(mixed, expected, atol=1e-6)
    one_hot = F.one_hot(hard, NUM_CLASSES)
    assert torch.allclose(soft, lam * one_hot + (1 - lam) * one_hot.roll(1, 0))


@pytest.mark.parametrize("switch, cutmix", [(1.0, True), (0.0, False)])
def test_switch_prob_chooses_cutmix_or_mixup(switch, cutmix):
    images, labels = _batch()
    mixer = build_mixer(NUM_CLASSES, 1.0, 1.0, switch_prob=switch)
    for seed in range(4):
        mixed, hard, _ = TrainLoss(NUM_CLASSES, mixer=mixer).mix(images, labels, seed)
        # CutMix pastes pixels: each one is from one of the two images; Mixup blends.
        pasted = torch.isin(mixed, images).all().item()
        assert pasted == cutmix


def test_mix_prob_zero_or_alphas_zero_turn_mixing_off():
    assert build_mixer(NUM_CLASSES, 0.2, 1.0, mix_prob=0.0) is None
    assert build_mixer(NUM_CLASSES, 0.0, 0.0) is None
    half = build_mixer(NUM_CLASSES, 0.2, 0.0, mix_prob=0.5)
    images, labels = _batch()
    unmixed = sum(
        torch.isin(TrainLoss(5, mixer=half).mix(images, labels, s)[0], images).all()
        for s in range(40)
    )
    assert 8 <= unmixed <= 32  # about half of the batches pass unmixed


def test_mixing_depends_on_its_seed_only_and_leaves_the_rng_alone():
    images, labels = _batch()
    loss_fn = TrainLoss(NUM_CLASSES, mixer=build_mixer(NUM_CLASSES, 0.2, 1.0))
    state = torch.get_rng_state()
    first = loss_fn.mix(images, labels, mix_seed(1, 0, 64))
    assert torch.equal(torch.get_rng_state(), state)
    torch.rand(10)  # moving the global generator changes nothing
    again = loss_fn.mix(images, labels, mix_seed(1, 0, 64))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = loss_fn.mix(images, labels, mix_seed(1, 0, 128))
    assert not torch.equal(first[0], other[0])
    assert (
        len({mix_seed(1, epoch, pos) for epoch in range(3) for pos in range(50)}) == 150
    )


# Tiny in-process runs: 96 synthetic images, batches of 8, a checkpoint every 3
# steps, every recipe of the training half on.
_RECIPE = [
    "MODEL.ARCH",
    "lenet5",
    "MODEL.DUMMY_INPUT",
    "True",
    "DATA.SYNTHETIC_SIZE",
    "[96,16]",
    "TRAIN.IM_SIZE",
    "28",
    "TEST.IM_SIZE",
    "28",
    "TRAIN.BATCH_SIZE",
    "8",
    "OPTIM.MAX_EPOCH",
    "1",
    "CHECKPOINT.PERIOD_ITERS",
    "3",
    "CHECKPOINT.KEEP",
    "0",
    "TRAIN.PRINT_FREQ",
    "4",
    "TRAIN.MIXUP_ALPHA",
    "0.2",
    "TRAIN.CUTMIX_ALPHA",
    "1.0",
    "TRAIN.MIX_PROB",
    "0.8",
    "TRAIN.LABEL_SMOOTHING",
    "0.1",
    "DATA.AUTO_AUGMENT",
    "randaugment",
    "DATA.RANDOM_ERASING",
    "0.5",
    "DATA.REPEATED_AUG",
    "2",
]


def _train_in_process(out_dir: str, *opts: str) -> dict:
    try:
        train_model(load_cfg(None, [*_RECIPE, "OUT_DIR", out_dir, *opts]))
    finally:
        setup_logging(None, 1)  # close the log file, leave no handler behind
    return last_checkpoint_weights(out_dir)


def test_resume_with_mixing_is_bitwise_identical_for_any_worker_count(tmp_path):
    reference, resumed = str(tmp_path / "reference"), str(tmp_path / "resumed")
    expected = _train_in_process(reference)
    # Resume from the checkpoint after 6 of the 12 steps, loading in a worker.
    shutil.copytree(reference, resumed)
    keep_only_checkpoint(resumed, "ckpt_ep_0000_it_0006.pth")
    actual = _train_in_process(resumed, "TRAIN.WORKERS", "1")
    assert "resumed from" in read_text(resumed, "log.txt")
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} differs"
    unmixed = _train_in_process(str(tmp_path / "unmixed"), "TRAIN.MIX_PROB", "0.0")
    assert any(not torch.equal(unmixed[key], expected[key]) for key in expected)


@pytest.mark.slow
def test_mixup_cutmix_run_trains_and_evaluates(tmp_path):
    out = str(tmp_path)
    args = [
        *["MODEL.ARCH", "resnet8", "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "10"],
        *[
            "TRAIN.MIXUP_ALPHA",
            "0.2",
            "TRAIN.CUTMIX_ALPHA",
            "1.0",
            "TRAIN.LABEL_SMOOTHING",
            "0.1",
        ],
        *["DATA.AUTO_AUGMENT", "trivialaugment", "DATA.RANDOM_ERASING", "0.25"],
        *["DATA.REPEATED_AUG", "3", "DATA.NAME", "synthetic"],
        *["DATA.SYNTHETIC_SIZE", "[640,100]", "OUT_DIR"],
        out,
    ]
    assert_ok(train_net(*args))
    train, val = read_metrics(out, "train"), read_metrics(out, "val")
    assert [record["iter"] for record in train] == [10]
    for record in train + val:
        assert math.isfinite(record["loss"]) and record["loss"] > 0
        assert 0 <= record["top1"] <= record["topk"] <= 100
    assert train[0]["samples"] == 640
    # Evaluation counts the hard labels of every validation image once.
    assert val[0]["samples"] == 100 and val[0]["train_samples"] == 640
