"""MODEL.DROP_PATH and MODEL.DROPOUT on models that have no such layers of
their own: vit_tiny_patch4, the small ResNets, lenet5 and torchvision's
ResNets.  The rates per block, the effect in training only, the dropout's
place before the classifier, checkpoint keys as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import StochasticDepth

from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import model_spec
from distribuuuu.models import build_configured


def _built(arch: str, *keys: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = load_cfg(None, ["MODEL.ARCH", arch, *keys])
    return build_configured(model_spec(cfg))


def _with_plain_weights(arch: str, *keys: str) -> tuple[nn.Module, nn.Module]:
    """The model without and with ``keys``, holding the same weights: the keys
    add no entry to a checkpoint and find every one they had."""
    plain, regularized = _built(arch), _built(arch, *keys)
    assert regularized.state_dict().keys() == plain.state_dict().keys()
    regularized.load_state_dict(plain.state_dict())
    return plain, regularized


def _rising(rate: float, blocks: int) -> list[float]:
    return [rate * index / (blocks - 1) for index in range(blocks)]


@pytest.mark.parametrize(
    ("arch", "size", "rates"),
    [
        ("vit_tiny_patch4", 16, _rising(0.5, 6)),  # each used by both branches
        ("resnet20", 16, _rising(0.5, 9)),
        ("resnet18", 32, _rising(0.5, 8)),  # torchvision's
    ],
)
def test_drop_path_rises_per_block_and_changes_training_outputs_only(arch, size, rates):
    plain, dropped = _with_plain_weights(arch, "MODEL.DROP_PATH", "0.5")
    found = [m.p for m in dropped.modules() if isinstance(m, StochasticDepth)]
    assert found == pytest.approx(rates)
    images = torch.randn(8, 3, size, size)
    with torch.no_grad():
        plain.eval(), dropped.eval()
        torch.testing.assert_close(dropped(images), plain(images), rtol=0, atol=0)
        plain.train(), dropped.train()
        torch.manual_seed(1)
        once = plain(images)
        torch.manual_seed(1)
        assert not torch.allclose(dropped(images), once)
        torch.manual_seed(1)
        assert torch.equal(plain(images), once)  # plain draws nothing


def _classifier(model: nn.Module) -> nn.Linear:
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


@pytest.mark.parametrize(
    ("arch", "size"),
    [("resnet20", 16), ("lenet5", 28), ("vit_tiny_patch4", 16), ("resnet18", 32)],
)
def test_dropout_drops_the_classifier_input_in_training_only(arch, size):
    plain, dropped = _with_plain_weights(arch, "MODEL.DROPOUT", "0.5")
    (dropout,) = [m for m in dropped.modules() if isinstance(m, nn.Dropout)]
    assert dropout.p == 0.5
    seen = []
    dropout.register_forward_hook(lambda module, args, out: seen.append(out))
    images = torch.randn(8, 3, size, size)
    with torch.no_grad():
        plain.eval(), dropped.eval()
        torch.testing.assert_close(dropped(images), plain(images), rtol=0, atol=0)
        plain.train(), dropped.train()
        logits = dropped(images)
        assert not torch.allclose(logits, plain(images))
        classifier = _classifier(dropped)  # multiplies what the dropout gave
        expected = F.linear(seen[-1], classifier.weight, classifier.bias)
        torch.testing.assert_close(logits, expected)
    assert (seen[-1] == 0).float().mean() > 0.3  # about half of it dropped


def test_rates_of_zero_keep_the_model_and_its_outputs():
    """DROP_PATH 0 and DROPOUT 0 are accepted and change nothing."""
    keys = ["MODEL.DROP_PATH", "0", "MODEL.DROPOUT", "0"]
    for arch, size in (("vit_tiny_patch4", 16), ("resnet20", 16)):
        plain, zero = _with_plain_weights(arch, *keys)
        images = torch.randn(4, 3, size, size)
        with torch.no_grad():
            assert torch.equal(zero(images), plain(images))
