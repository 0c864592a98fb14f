"""BoTNet-50: the paper's size, the relative position logits by hand, a
forward and backward pass at 224 px, learning on small inputs, and inputs
its position encodings do not cover refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import refused

from distribuuuu.models import build_model, find_blocks, zero_init_residual
from distribuuuu.models.botnet import AttentionBottleneck, RelativeSelfAttention


def test_botnet50_has_the_size_of_the_original():
    """20.859 M parameters in the original Distribuuuu's table (20.8 M in the
    paper); ResNet-50's first stages, three attention blocks as c5."""
    with torch.device("meta"):
        model = build_model("botnet50", 1000)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - 20.859e6) / 20.859e6 < 0.01
    blocks = find_blocks(model)
    assert len(blocks) == 16  # 3 + 4 + 6 Bottlenecks, 3 attention blocks
    assert all(isinstance(b, AttentionBottleneck) for b in blocks[-3:])
    assert zero_init_residual(build_model("botnet50", 10)) == 16


def test_relative_logits_are_those_of_each_offset():
    """The logit of query (i, j) and key (k, l) adds q . r_h[k - i] +
    q . r_w[l - j], also on a map smaller than the tables (central rows)."""
    torch.manual_seed(0)
    attention = RelativeSelfAttention(8, 2, (5, 4))
    rows, columns = attention.rel_height, attention.rel_width
    for height, width in ((5, 4), (3, 2)):
        q = torch.randn(2, 2, height * width, 4)
        logits = attention.relative_logits(q, height, width)
        query = q.reshape(2, 2, height, width, 4)
        for i, j, k, m in (
            (0, 0, height - 1, width - 1),
            (height - 1, 1, 0, 0),
            (1, width - 1, 1, 0),
        ):
            expected = query[:, :, i, j] @ (rows[k - i + 4] + columns[m - j + 3])
            torch.testing.assert_close(logits[:, :, i * width + j, k * width + m],
                                       expected)  # fmt: skip


def test_botnet50_forward_and_backward_at_224():
    torch.manual_seed(0)
    model = build_model("botnet50", 10)
    out = model(torch.randn(2, 3, 224, 224))
    assert out.shape == (2, 10)
    out.logsumexp(1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert model.layer4[1].attention.rel_width.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="up to 224 px"):
        RelativeSelfAttention(8, 2, (3, 3))(torch.randn(1, 8, 4, 3))


def test_botnet50_learns_on_32_px_images():
    """12 Adam steps on 32 images of 4 classes: the loss falls by half."""
    torch.manual_seed(0)
    model = build_model("botnet50", 4)
    images, targets = torch.randn(32, 3, 32, 32), torch.arange(32) % 4
    images += targets[:, None, None, None] * 0.5  # brighter by class
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(12):
        loss = F.cross_entropy(model(images), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_botnet50_larger_than_224_px_is_refused(tmp_path):
    line = refused(str(tmp_path / "out"), "MODEL.ARCH", "botnet50",
                   "TRAIN.IM_SIZE", "256", "TEST.IM_SIZE", "292")  # fmt: skip
    assert "TRAIN.IM_SIZE 256" in line and "up to 224 px" in line
