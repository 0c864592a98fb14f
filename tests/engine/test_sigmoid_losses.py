"""MODEL.LOSS bce / asl against hand computations, the mixing of multi-hot
targets, MODEL.BCE_THRESHOLD, and the multi-label metrics against scikit-learn."""

import math

import numpy as np
import pytest
import torch

from distribuuuu.config import get_cfg, validate_cfg
from distribuuuu.engine.losses import LossSpec, build_train_loss
from distribuuuu.engine.sigmoid_losses import (
    SigmoidLoss,
    asymmetric_loss,
    dense_targets,
    score_loss_sum,
)
from distribuuuu.engine.tta import tta_logits
from distribuuuu.errors import ConfigError
from distribuuuu.reporting.multilabel import average_precisions, multilabel_metrics


def _bce(logit: float, target: float) -> float:
    p = 1 / (1 + math.exp(-logit))
    return -(target * math.log(p) + (1 - target) * math.log(1 - p))


def test_bce_one_hots_single_labels_and_smooths_them_as_timm():
    """Class 1 of 4 with smoothing 0.2: on 1 - 0.2 + 0.05, off 0.05."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    loss = build_train_loss(
        LossSpec(4, label_smoothing=0.2, sigmoid=SigmoidLoss("bce"))
    )
    got = loss(logits, torch.tensor([1])).item()
    targets = [0.05, 0.85, 0.05, 0.05]
    hand = sum(_bce(x, t) for x, t in zip(logits[0].tolist(), targets)) / 4
    assert got == pytest.approx(hand, rel=1e-6)


def test_the_threshold_binarizes_soft_targets():
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.2, 0.6]])
    dense = dense_targets(soft, 3, threshold=0.25)
    assert dense.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    # Smoothing first, then the threshold (0.1 -> 0.9 * t + 0.0333).
    assert dense_targets(soft, 3, 0.1, 0.25).tolist() == dense.tolist()


def test_asl_matches_the_paper_by_hand():
    """gamma- 4, gamma+ 1, margin 0.05 on one positive and one negative."""
    logits = torch.tensor([[1.0, 0.5]])
    targets = torch.tensor([[1.0, 0.0]])
    got = asymmetric_loss(logits, targets, gamma_neg=4, gamma_pos=1, clip=0.05)
    p_pos, p_neg = 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(-0.5))
    positive = -((1 - p_pos) ** 1) * math.log(p_pos)
    shifted = p_neg - 0.05
    negative = -(shifted**4) * math.log(1 - shifted)
    assert got[0].tolist() == pytest.approx([positive, negative], rel=1e-6)
    # The shift zeroes an easy negative's loss altogether.
    easy = asymmetric_loss(torch.tensor([[-5.0]]), torch.tensor([[0.0]]))
    assert easy.item() == 0.0


def test_asl_without_focusing_or_shift_is_bce_summed_over_classes():
    logits, targets = torch.randn(5, 3), (torch.rand(5, 3) > 0.5).float()
    asl = SigmoidLoss("asl", gamma_neg=0, gamma_pos=0, clip=0).per_sample
    bce = SigmoidLoss("bce").per_sample
    assert torch.allclose(asl(logits, targets), 3 * bce(logits, targets))


def test_mixup_mixes_multi_hot_targets():
    """Image A (ones) carries {0, 1}, image B (zeros) {2}: a mixed sample
    holds A with the weight w its pixels show, and its targets w A + (1 - w) B."""
    loss = build_train_loss(LossSpec(4, mixup_alpha=1.0, sigmoid=SigmoidLoss("bce")))
    label_a, label_b = torch.tensor([1.0, 1, 0, 0]), torch.tensor([0.0, 0, 1, 0])
    images = torch.stack([torch.ones(3, 4, 4), torch.zeros(3, 4, 4)])
    mixed, _, soft = loss.mix(images, torch.stack([label_a, label_b]), seed=3)
    for sample in range(2):
        weight = mixed[sample].mean().item()
        assert 0 < weight < 1
        expected = weight * label_a + (1 - weight) * label_b
        assert torch.allclose(soft[sample], expected, atol=1e-6)


def test_the_evaluation_loss_is_plain():
    logits, targets = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    bce = SigmoidLoss("bce")
    plain = score_loss_sum(logits, targets, bce)
    by_hand = bce.per_sample(logits, torch.eye(3)[targets]).sum()
    assert plain.item() == pytest.approx(by_hand.item())


def test_tta_of_a_sigmoid_run_averages_probabilities():
    model = torch.nn.Flatten()  # logits: the pixels
    images = torch.tensor([[[[0.0, 4.0]]]])
    logits = tta_logits(model, images, "flip", 0, sigmoid=True)
    expected = torch.sigmoid(torch.tensor([0.0, 4.0])).mean()
    assert torch.sigmoid(logits).flatten().tolist() == pytest.approx(
        [expected.item()] * 2, rel=1e-6
    )


def test_the_map_matches_scikit_learn_with_ties_and_an_empty_class():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    targets = (rng.random((60, 5)) > 0.6).astype(np.uint8)
    targets[:, 4] = 0  # a class without positives: AP 0, in the mean
    scores = np.round(rng.random((60, 5)), 1)  # many ties
    ours = multilabel_metrics(scores, targets, 0.5)
    with pytest.warns(UserWarning):
        reference = metrics.average_precision_score(targets, scores, average="macro")
    assert ours["map"] / 100 == pytest.approx(reference, abs=1e-9)
    assert average_precisions(scores, targets)[4] == 0.0
    predicted = scores >= 0.5
    micro = metrics.f1_score(targets, predicted, average="micro")
    macro = metrics.f1_score(targets, predicted, average="macro", zero_division=0)
    assert ours["f1_micro"] / 100 == pytest.approx(micro)
    assert ours["f1_macro"] / 100 == pytest.approx(macro)


def test_distillation_is_refused_with_a_sigmoid_loss(tmp_path):
    cfg = get_cfg()
    teacher = tmp_path / "teacher.pth"
    teacher.write_bytes(b"")
    cfg.MODEL.LOSS = "bce"
    cfg.TRAIN.DISTILL.ARCH, cfg.TRAIN.DISTILL.WEIGHTS = "resnet8", str(teacher)
    with pytest.raises(ConfigError, match="distils softmax"):
        validate_cfg(cfg)
