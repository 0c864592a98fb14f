"""TRAIN.DISTILL: the teacher's term of the loss, the teacher never saved,
distillation under DDP and FSDP, and teachers that cannot be used."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import TINY, assert_ok, refused, torchrun

from distribuuuu.engine.losses import Distillation, Distilled, TrainLoss
from distribuuuu.models import build_model

STUDENT = torch.tensor([[1.0, 0.0]])
TEACHER = torch.tensor([[0.0, 1.0]])
OWN = math.log(1 + math.exp(-1))  # cross-entropy of the student against class 0


@pytest.mark.parametrize(
    "kind, tau, taught",
    [
        # KL(teacher || student): both softmaxes are (0.7311, 0.2689) mirrored,
        # so KL = (e - 1) / (e + 1) = 0.4621172
        ("soft", 1.0, (math.e - 1) / (math.e + 1)),
        # at tau 2 the logits halve: KL = 0.5 tanh(0.25) x 2 = 0.1224593, x tau**2
        ("soft", 2.0, 4 * 0.5 * math.tanh(0.25)),
        # the teacher's top class is 1: log(1 + e)
        ("hard", 1.0, math.log(1 + math.e)),
    ],
)
def test_the_teachers_term_worked_by_hand(kind, tau, taught):
    loss = TrainLoss(2, distillation=Distillation(kind, tau, alpha=0.25))
    value = loss(STUDENT, Distilled(torch.tensor([0]), TEACHER)).item()
    assert value == pytest.approx(0.75 * OWN + 0.25 * taught, abs=1e-6)
    assert loss(STUDENT, torch.tensor([0])).item() == pytest.approx(OWN, abs=1e-6)


def test_a_teacher_that_agrees_adds_nothing_at_alpha_one():
    loss = TrainLoss(2, distillation=Distillation("soft", 3.0, alpha=1.0))
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.25]])
    assert loss(logits, Distilled(torch.tensor([0, 1]), logits)).item() == 0.0


def _teacher(tmp_path, classes: int = 10) -> str:
    torch.manual_seed(0)
    path = str(tmp_path / "teacher.pth")
    torch.save(build_model("resnet8", classes).state_dict(), path)
    return path


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distillation_trains_on_2_ranks_and_never_saves_the_teacher(tmp_path, strategy):
    out = str(tmp_path / "run")
    keys = [
        "TRAIN.DISTILL.ARCH",
        "resnet8",
        "TRAIN.DISTILL.WEIGHTS",
        _teacher(tmp_path),
    ]
    result = torchrun(2, *TINY, *keys, "DIST.STRATEGY", strategy, "OUT_DIR", out)
    assert_ok(result)
    assert "distillation: teacher resnet8" in result.stdout
    best = torch.load(os.path.join(out, "best.pth"), weights_only=True)
    assert best["model"].keys() == build_model("lenet5", 10).state_dict().keys()


def test_teachers_that_cannot_be_used_are_refused(tmp_path):
    out = str(tmp_path / "out")
    other = _teacher(tmp_path, classes=7)
    line = refused(out, "TRAIN.DISTILL.ARCH", "resnet8", "TRAIN.DISTILL.WEIGHTS", other)
    assert line.startswith("error: TRAIN.DISTILL.WEIGHTS") and "(7," in line
    line = refused(out, "TRAIN.DISTILL.ARCH", "resnet8")
    assert "TRAIN.DISTILL.WEIGHTS: no such file" in line
    keys = ["TRAIN.DISTILL.ARCH", "resnet8", "TRAIN.DISTILL.WEIGHTS", other]
    line = refused(out, *keys, "TRAIN.DISTILL.TYPE", "feature")
    assert "TRAIN.DISTILL.TYPE 'feature' is invalid" in line
    line = refused(out, *keys, "DIST.STRATEGY", "pipeline")
    assert "not supported with DIST.STRATEGY pipeline" in line
