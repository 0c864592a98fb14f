"""MODEL.LOSS bce and asl: a sigmoid score per class instead of one softmax.

Both take dense targets (N x C, values in [0, 1]): the multi-hot label sets of
multi-label data, the one-hot labels of single-label data, or the soft targets
of a mixed batch.  :func:`dense_targets` makes them, label smoothing and the
binarization of MODEL.BCE_THRESHOLD included, following timm's
``BinaryCrossEntropy`` (timm/loss/binary_cross_entropy.py): a one-hot target
smoothed by ``eps`` is ``eps / C`` off and ``1 - eps + eps / C`` on, and with a
threshold a target becomes 1 where it is above it, else 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SIGMOID_LOSSES = ("bce", "asl")

# The smallest value whose log the asymmetric loss takes (the ASL authors' eps).
_LOG_FLOOR = 1e-8


def dense_targets(
    targets: torch.Tensor,
    num_classes: int,
    smoothing: float = 0.0,
    threshold: float = 0.0,
) -> torch.Tensor:
    """``targets`` as float N x C: class indices one-hot, then smoothed towards
    ``smoothing / C`` (``(1 - smoothing) * t + smoothing / C``), then, with
    ``threshold`` > 0, 1 where above ``threshold`` and 0 elsewhere."""
    if targets.ndim == 1:
        dense = F.one_hot(targets, num_classes).float()
    else:
        dense = targets.float()
    if smoothing > 0:
        dense = dense * (1.0 - smoothing) + smoothing / num_classes
    if threshold > 0:
        dense = (dense > threshold).float()
    return dense


def asymmetric_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    gamma_neg: float = 4.0,
    gamma_pos: float = 0.0,
    clip: float = 0.05,
) -> torch.Tensor:
    """The asymmetric loss of each sample and class (N x C), Ridnik et al. 2021
    ("Asymmetric Loss For Multi-Label Classification", eq. 7 with the shifted
    probability of eq. 3): with ``p = sigmoid(logit)`` and ``m = clip``,

    ``-[y (1 - p)^gamma_pos log p + (1 - y) p_m^gamma_neg log(1 - p_m)]``,
    ``p_m = max(p - m, 0)``.

    A soft target ``y`` weighs the two terms linearly."""
    logits = logits.float()
    probs = torch.sigmoid(logits)
    shifted = (probs - clip).clamp(min=0) if clip > 0 else probs
    log_pos = F.logsigmoid(logits)
    if clip > 0:
        log_neg = torch.log((1.0 - shifted).clamp(min=_LOG_FLOOR))
    else:
        log_neg = F.logsigmoid(-logits)  # log(1 - p), exactly
    positive = targets * (1.0 - probs).pow(gamma_pos) * log_pos
    negative = (1.0 - targets) * shifted.pow(gamma_neg) * log_neg
    return -(positive + negative)


@dataclass(frozen=True)
class SigmoidLoss:
    """MODEL.LOSS bce or asl with its parameters (MODEL.ASL_*)."""

    kind: str = "bce"
    gamma_neg: float = 4.0
    gamma_pos: float = 0.0
    clip: float = 0.05

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of each sample (N) against dense ``targets`` (N x C): bce
        averages over the classes (as ``binary_cross_entropy_with_logits``'s
        mean, over samples and classes), asl sums over them (as its authors)."""
        if self.kind == "bce":
            elements = F.binary_cross_entropy_with_logits(
                logits.float(), targets, reduction="none"
            )
            return elements.mean(dim=1)
        elements = asymmetric_loss(
            logits, targets, self.gamma_neg, self.gamma_pos, self.clip
        )
        return elements.sum(dim=1)


def score_loss_sum(
    logits: torch.Tensor, targets: torch.Tensor, loss: SigmoidLoss | None
) -> torch.Tensor:
    """The summed evaluation loss of a batch: the run's plain loss (no
    smoothing, no threshold) against its labels; softmax cross-entropy where
    ``loss`` is None (MODEL.LOSS ce)."""
    if loss is None:
        return F.cross_entropy(logits, targets, reduction="sum")
    dense = dense_targets(targets, logits.shape[1])
    return loss.per_sample(logits, dense).sum()
