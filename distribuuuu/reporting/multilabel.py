"""The metrics of multi-label evaluation: mean average precision and F1.

Ranking metrics need every score at once, so :class:`LabelScores` keeps the
sigmoid probabilities and multi-hot targets of this rank's samples and
gathers them from every rank when read.  The validation sampler hands each
sample to exactly one rank (no padding), and a process that holds no outputs
(a pipeline's earlier stage) adds none, so the gathered rows are the
validation set, each sample once, on any world size.

Average precision follows scikit-learn's ``average_precision_score``: per
class, the sum over the distinct score thresholds (tied scores form one) of
the rise in recall times the precision there, with no interpolation.  A class
without positive samples has AP 0 (scikit-learn sets its recall to 1 at every
threshold and warns) and counts in the macro mean as 0.
"""

from __future__ import annotations

import numpy as np
import torch

from distribuuuu.dist import group as du

MAP = "map"


def class_average_precision(scores: np.ndarray, positives: np.ndarray) -> float:
    """The average precision of one class: ``scores`` and 0/1 ``positives``
    of every sample; 0 without positives."""
    order = np.argsort(-scores, kind="mergesort")
    ranked, hits = scores[order], positives[order].astype(np.float64)
    true_pos = np.cumsum(hits)
    # The last sample of each group of tied scores: one threshold per group.
    ends = np.r_[np.nonzero(np.diff(ranked))[0], len(ranked) - 1]
    true_pos = true_pos[ends]
    total = true_pos[-1] if len(true_pos) else 0.0
    if total == 0:
        return 0.0
    precision = true_pos / (ends + 1)
    recall = true_pos / total
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def average_precisions(scores: np.ndarray, targets: np.ndarray) -> list[float]:
    """The AP of each class (columns of N x C ``scores`` and 0/1 ``targets``)."""
    return [
        class_average_precision(scores[:, c], targets[:, c] > 0.5)
        for c in range(scores.shape[1])
    ]


def f1_scores(
    scores: np.ndarray, targets: np.ndarray, threshold: float
) -> tuple[float, float]:
    """Micro and macro F1 (percent) of predicting a class where its score is at
    or above ``threshold``.  A class never predicted nor present has F1 0 in
    the macro mean (scikit-learn's ``zero_division`` default)."""
    predicted, present = scores >= threshold, targets > 0.5
    true_pos = np.sum(predicted & present, axis=0).astype(np.float64)
    false_pos = np.sum(predicted & ~present, axis=0)
    false_neg = np.sum(~predicted & present, axis=0)
    wrong = false_pos + false_neg
    micro_den = 2 * true_pos.sum() + wrong.sum()
    micro = 2 * true_pos.sum() / micro_den if micro_den else 0.0
    per_class_den = 2 * true_pos + wrong
    per_class = np.divide(
        2 * true_pos,
        per_class_den,
        out=np.zeros_like(true_pos),
        where=per_class_den > 0,
    )
    return 100.0 * float(micro), 100.0 * float(per_class.mean())


def multilabel_metrics(
    scores: np.ndarray, targets: np.ndarray, threshold: float
) -> dict:
    """mAP (percent), micro / macro F1 at ``threshold`` and the AP of each
    class (percent) of N x C probabilities and multi-hot targets."""
    per_class = average_precisions(scores, targets)
    micro, macro = f1_scores(scores, targets, threshold)
    mean = float(np.mean(per_class)) if per_class else 0.0
    return {
        MAP: 100.0 * mean,
        "f1_micro": micro,
        "f1_macro": macro,
        "per_class_ap": [100.0 * ap for ap in per_class],
    }


class LabelScores:
    """The loss sum, probabilities and targets of this rank's evaluated samples.

    ``update`` keeps them on the device; ``reduce`` (a collective: every rank
    calls it at the same point) gathers them from every rank and measures.
    """

    def __init__(self, device: torch.device, num_classes: int, threshold: float):
        self.num_classes, self.threshold = num_classes, threshold
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.scores: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def update(
        self, loss_sum: torch.Tensor, probs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """Add a batch: the summed loss, N x C probabilities and targets."""
        self.loss += loss_sum.double()
        self.scores.append(probs.detach().float())
        self.targets.append(targets.detach().to(torch.uint8))

    def gathered(self) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's probabilities and targets, in rank order (a collective)."""
        empty = torch.zeros(0, self.num_classes)
        mine = (
            torch.cat(self.scores).cpu() if self.scores else empty,
            torch.cat(self.targets).cpu() if self.targets else empty.to(torch.uint8),
        )
        ranks = du.all_gather_object(mine, du.control_group())
        scores = torch.cat([rank[0] for rank in ranks]).double().numpy()
        targets = torch.cat([rank[1] for rank in ranks]).numpy()
        return scores, targets

    def reduce(self) -> dict:
        """Global loss (mean), samples and :func:`multilabel_metrics`."""
        loss = du.all_reduce_sum(self.loss.clone()).item()
        scores, targets = self.gathered()
        samples = len(scores)
        stats = {"loss": loss / max(samples, 1), "samples": samples}
        stats.update(multilabel_metrics(scores, targets, self.threshold))
        return stats


def headline_metric(stats: dict) -> str:
    """The score an evaluation is ranked by: map for multi-label ones, else top1."""
    return MAP if MAP in stats else "top1"
