"""Host synchronizations of the CUDA training and evaluation steps, checked on
the CPU: each piece of the step that used to wait for the device is driven
with a counter or a fake in place of the CUDA call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distribuuuu.engine import losses
from distribuuuu.engine.losses import TrainLoss, build_mixer, host_to_device
from distribuuuu.models.ema import ModelEma
from distribuuuu.reporting.meters import ConfusionMatrix
from distribuuuu.strategies.gradients import step_optimizer


def test_mixing_order_goes_to_cuda_from_pinned_memory(monkeypatch):
    calls = []

    def pin_memory(tensor):
        calls.append("pin")
        return tensor

    def to(tensor, device, non_blocking=False):
        calls.append(("to", str(device), non_blocking))
        return tensor

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    host_to_device(torch.arange(4), torch.device("cuda", 1))
    assert calls == ["pin", ("to", "cuda:1", True)]
    calls.clear()
    host_to_device(torch.arange(4), torch.device("cpu"))  # nothing to pin
    assert calls == [("to", "cpu", False)]


def test_mixing_order_is_the_seeded_permutation_copied_once(monkeypatch):
    copied = []

    def record(tensor, device):
        copied.append(tensor.clone())
        return tensor.to(device)

    monkeypatch.setattr(losses, "host_to_device", record)
    loss_fn = TrainLoss(5, mixer=build_mixer(5, mixup_alpha=0.2))
    images, labels = torch.randn(8, 3, 4, 4), torch.arange(8) % 5
    _, hard, _ = loss_fn.mix(images, labels, seed=11)
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(11))
    (order,) = copied
    assert torch.equal(order, expected)  # the same order as before, bit for bit
    assert torch.equal(hard, labels[expected])


class _CountedSyncs:
    """Counts ``Tensor.item`` calls and a GradScaler's ``get_scale`` calls."""

    def __init__(self, monkeypatch, scaler: torch.amp.GradScaler):
        self.items = self.scales = 0
        item, get_scale = torch.Tensor.item, scaler.get_scale

        def counted_item(tensor):
            self.items += 1
            return item(tensor)

        def counted_get_scale():
            self.scales += 1
            return get_scale()

        monkeypatch.setattr(torch.Tensor, "item", counted_item)
        monkeypatch.setattr(scaler, "get_scale", counted_get_scale)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_fp16_step_with_ema_reads_the_device_once(monkeypatch, clip):
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    ema = ModelEma(model, decay=0.5, warmup=True)
    average = ema.tensors()["weight"].clone()
    syncs = _CountedSyncs(monkeypatch, scaler)
    scaler.scale(model(torch.full((1, 3), float("inf"))).sum()).backward()
    stepped = step_optimizer(model, optimizer, scaler, clip, check_skip=True).taken
    if stepped:
        ema.step()
    # One read: the GradScaler's own found-inf check inside scaler.step.
    assert (syncs.scales, syncs.items) == (0, 1)
    assert not stepped and ema.counters() == {"steps": 0, "updates": 0}
    assert torch.equal(ema.tensors()["weight"], average)
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    assert step_optimizer(model, optimizer, scaler, clip, check_skip=True).taken
    assert (syncs.scales, syncs.items) == (0, 2)
    ema.step()
    assert ema.counters() == {"steps": 1, "updates": 1}

    # A fused optimizer gets step() even when the scaler skips: the old
    # comparison of the scale still tells.
    fused = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.full((1, 3), float("inf"))).sum()).backward()
    assert not step_optimizer(model, fused, scaler, 0.0, check_skip=True).taken
    assert torch.equal(model.weight, before)


def test_confusion_matrix_counts_as_bincount_without_calling_it(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 7, generator=generator)
    targets = torch.randint(7, (200,), generator=generator)
    pairs = targets * 7 + logits.argmax(dim=1)
    expected = torch.bincount(pairs, minlength=49).view(7, 7)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.bincount reads the device back on CUDA")

    monkeypatch.setattr(torch, "bincount", refuse)
    matrix = ConfusionMatrix(torch.device("cpu"), 7)
    matrix.update(logits[:120], targets[:120])
    matrix.update(logits[120:], targets[120:])
    assert torch.equal(matrix.reduce(), expected)
    with pytest.raises(IndexError):  # a label outside the classes
        matrix.update(logits[:2], torch.tensor([0, 7]))
