"""The training loss: Mixup / CutMix of the batch, label smoothing, cross-entropy
(softmax, or a sigmoid per class: :mod:`distribuuuu.engine.sigmoid_losses`).

Mixup and CutMix mix multi-hot targets (N x C) as they mix one-hot ones.

Mixing happens on the device, after the copy of the micro-batch: a few
element-wise operations on tensors already there, instead of work in every
data loader worker.  Its random draws (which mix, the Beta weight, the CutMix
box, the pairing) come from torch's CPU generator seeded with :func:`mix_seed`
of the micro-batch's place in the epoch, inside ``fork_rng``: like the
per-sample augmentation, they depend on (RNG_SEED, epoch, position) only, so a
resumed run mixes exactly as the uninterrupted one, for any number of loader
workers, and switching mixing on leaves the rest of the run's random stream
(dropout, ...) as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from distribuuuu.data.samplers import sample_seed
from distribuuuu.engine.sigmoid_losses import SigmoidLoss, dense_targets

# Flipped in a sample seed to make a mixing seed: the two sets of seeds never
# meet (they would need sample seeds exactly 2**62 apart).
_MIX_SALT = 1 << 62


def mix_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the mixing of the micro-batch starting at global ``position``."""
    return sample_seed(seed, epoch, position) ^ _MIX_SALT


def build_mixer(
    num_classes: int,
    mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
    mix_prob: float = 1.0,
    switch_prob: float = 0.5,
) -> v2.Transform | None:
    """torchvision's Mixup and/or CutMix of a batch; None when mixing is off.

    The transform maps ``(images, labels)`` to ``(mixed images, soft labels)``
    (N x num_classes).  With both on, a mixed batch uses CutMix with
    probability ``switch_prob``; a batch is mixed at all with ``mix_prob``.
    """
    mixers, weights = [], []
    if cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        weights.append(switch_prob)
    if mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        weights.append(1.0 - switch_prob)
    if not mixers or mix_prob <= 0:
        return None
    mixer = mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers, p=weights)
    return mixer if mix_prob >= 1 else v2.RandomApply([mixer], p=mix_prob)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor``, just made on the host, on ``device`` without waiting for it.

    A copy to CUDA from pageable memory is synchronous; from page-locked
    (pinned) memory with ``non_blocking=True`` it is queued on the stream.  The
    pinned copy is made afresh at each call and handed to no one else: the
    CUDA caching host allocator records the copy's stream and gives its block
    out again only once the copy is done, so freeing it early is safe (what
    must not happen is writing into a pinned tensor that is still being
    copied).  Only CUDA has pinned memory; other devices get a plain copy.
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class Distilled(NamedTuple):
    """The loss targets of a distilled micro-batch: the labels (or soft mixed
    ones) and the teacher's logits of the same images."""

    targets: torch.Tensor
    teacher_logits: torch.Tensor


@dataclass(frozen=True)
class Distillation:
    """TRAIN.DISTILL: how the teacher's logits enter the loss."""

    kind: str = "soft"  # soft (KL at temperature tau) | hard (its argmax)
    tau: float = 1.0
    alpha: float = 0.5  # the weight of the teacher's term

    def loss(self, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """The teacher's term: KL(teacher || student) of the softened
        distributions times tau**2 (Hinton et al. 2015, averaged over the
        batch), or the cross-entropy against the teacher's argmax (DeiT's
        hard distillation, Touvron et al. 2021)."""
        if self.kind == "hard":
            return F.cross_entropy(logits, teacher.argmax(dim=1))
        tau = self.tau
        student = F.log_softmax(logits.float() / tau, dim=1)
        target = F.log_softmax(teacher.float() / tau, dim=1)
        divergence = F.kl_div(student, target, reduction="batchmean", log_target=True)
        return divergence * tau * tau


class TrainLoss:
    """Mixes a training micro-batch and computes its loss.

    Without mixing and label smoothing it is ``F.cross_entropy(logits,
    targets)``, bit for bit.  With ``sigmoid`` (MODEL.LOSS bce or asl) it is
    that loss against dense targets (:func:`dense_targets`: one-hot, smoothed,
    binarized above ``threshold``), averaged over the batch.
    """

    def __init__(
        self,
        num_classes: int,
        label_smoothing: float = 0.0,
        mixer: v2.Transform | None = None,
        distillation: Distillation | None = None,
        sigmoid: SigmoidLoss | None = None,
        threshold: float = 0.0,
    ):
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.mixer = mixer
        self.distillation = distillation
        self.sigmoid = sigmoid
        self.threshold = threshold

    def mix(
        self, images: torch.Tensor, targets: torch.Tensor, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(images, labels, loss targets)`` to train on; unchanged without mixing.

        The batch is first put in a random order, because torchvision pairs
        each sample with its neighbour and repeated augmentation may place
        copies of one image side by side; ``labels`` are the original labels
        in that order (for top-1), ``loss targets`` the soft mixed ones.

        No host synchronization on CUDA: the order is copied from pinned memory
        (:func:`host_to_device`), and torchvision's v2 MixUp / CutMix draw
        their Beta weight, box and choice on the CPU generator and hand the
        device Python floats and slices; their ``one_hot`` (with
        ``num_classes``) skips its range check on CUDA and relies on a
        device-side assert (aten/src/ATen/native/Onehot.cpp).
        """
        if self.mixer is None:
            return images, targets, targets
        with torch.random.fork_rng(devices=[]):  # the CPU generator only
            torch.default_generator.manual_seed(seed)
            order = host_to_device(torch.randperm(len(targets)), targets.device)
            images, targets = images[order], targets[order]
            mixed, soft = self.mixer(images, targets)
        return mixed, targets, soft

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor | Distilled
    ) -> torch.Tensor:
        """Mean cross-entropy against class indices or soft targets (N x C).

        Label smoothing mixes every target with the uniform distribution,
        ``(1 - eps) * target + eps / C``, soft targets included; as smoothing
        and cross-entropy are linear in the target, the loss of a mixed batch
        is the mixture of the smoothed losses of its two labels.
        """
        if self.sigmoid is not None:  # distillation is refused with it
            assert not isinstance(targets, Distilled)
            dense = dense_targets(
                targets, self.num_classes, self.label_smoothing, self.threshold
            )
            return self.sigmoid.per_sample(logits, dense).mean()
        if not isinstance(targets, Distilled):
            return F.cross_entropy(
                logits, targets, label_smoothing=self.label_smoothing
            )
        own = F.cross_entropy(
            logits, targets.targets, label_smoothing=self.label_smoothing
        )
        assert self.distillation is not None  # a teacher's logits come with it
        alpha = self.distillation.alpha
        taught = self.distillation.loss(logits, targets.teacher_logits)
        return (1 - alpha) * own + alpha * taught


@dataclass(frozen=True)
class LossSpec:
    """The training loss asked for: label smoothing, Mixup / CutMix, distillation."""

    num_classes: int
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0  # the share of batches mixed at all
    switch_prob: float = 0.5  # with both on: the share mixed by CutMix
    distillation: Distillation | None = None  # None: no teacher
    sigmoid: SigmoidLoss | None = None  # MODEL.LOSS bce / asl; None: ce
    threshold: float = 0.0  # MODEL.BCE_THRESHOLD (sigmoid losses); 0: off


def build_train_loss(spec: LossSpec) -> TrainLoss:
    """The training loss that ``spec`` asks for."""
    mixer = build_mixer(
        spec.num_classes,
        mixup_alpha=spec.mixup_alpha,
        cutmix_alpha=spec.cutmix_alpha,
        mix_prob=spec.mix_prob,
        switch_prob=spec.switch_prob,
    )
    return TrainLoss(
        spec.num_classes,
        label_smoothing=spec.label_smoothing,
        mixer=mixer,
        distillation=spec.distillation,
        sigmoid=spec.sigmoid,
        threshold=spec.threshold,
    )
