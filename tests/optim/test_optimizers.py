"""TensorFlow's RMSProp, LAMB and LARS against their updates worked by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import optimizer_spec
from distribuuuu.optim.build import build_optimizer
from distribuuuu.optim.optimizers import Lamb, Lars, RMSpropTF


def _steps(optimizer_class, weights, grads, **options) -> list[list[float]]:
    """The weights after each step of ``optimizer_class`` fed ``grads``."""
    param = nn.Parameter(torch.tensor(weights, dtype=torch.float64))
    optimizer = optimizer_class([param], **options)
    seen = []
    for grad in grads:
        param.grad = torch.tensor(grad, dtype=torch.float64)
        optimizer.step()
        seen.append(param.detach().tolist())
    return seen


def test_rmsprop_tf_puts_eps_inside_the_root_and_starts_the_mean_square_at_one():
    # w = 1, g = 0.5, lr 0.1, alpha 0.9, eps 1e-3, momentum 0.9, no decay:
    # ms = 0.9 * 1 + 0.1 * 0.25 = 0.925; mom = 0.1 * 0.5 / sqrt(0.926)
    # = 0.05 / 0.9622889 = 0.0519594459; w = 0.9480405541
    options = dict(lr=0.1, alpha=0.9, eps=1e-3, momentum=0.9)
    (first,), (second,) = _steps(RMSpropTF, [1.0], [[0.5], [-0.2]], **options)
    assert first == pytest.approx(0.9480405541, abs=1e-9)
    # step 2, g = -0.2: ms = 0.9 * 0.925 + 0.1 * 0.04 = 0.8365;
    # mom = 0.9 * 0.0519594 + 0.1 * -0.2 / sqrt(0.8375) = 0.0467635 - 0.0218543
    mom = 0.9 * (0.05 / math.sqrt(0.926)) - 0.02 / math.sqrt(0.8375)
    assert second == pytest.approx(first - mom, abs=1e-12)
    torch_style = torch.optim.RMSprop
    param = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    param.grad = torch.tensor([0.5], dtype=torch.float64)
    torch_style([param], **options).step()
    assert param.item() != pytest.approx(first, abs=1e-3)  # torch's differs


def test_rmsprop_tf_adds_weight_decay_to_the_gradient():
    # g = 0 + 0.1 * 2 = 0.2: ms = 0.9 + 0.1 * 0.04 = 0.904, w = 2 - 0.2 / sqrt(0.905)
    options = dict(lr=1.0, alpha=0.9, eps=1e-3, momentum=0.0, weight_decay=0.1)
    ((weight,),) = _steps(RMSpropTF, [2.0], [[0.0]], **options)
    assert weight == pytest.approx(2 - 0.2 / math.sqrt(0.905), abs=1e-12)


def test_lamb_scales_adams_update_by_the_trust_ratio():
    # w = (3, 4), |w| = 5, g = (1, 0). Step 1: m_hat = (1, 0), v_hat = (1, 0),
    # u = (1 / (1 + 1e-6), 0), |u| = 1 / (1 + 1e-6): trust = 5 (1 + 1e-6),
    # so w = (3 - 0.01 * 5, 4) = (2.95, 4).
    options = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6)
    (step,) = _steps(Lamb, [3.0, 4.0], [[1.0, 0.0]], **options)
    assert step == pytest.approx([2.95, 4.0], abs=1e-12)
    param = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    plain = Lamb([{"params": [param], "trust_ratio": False}], **options)
    param.grad = torch.tensor([1.0, 0.0], dtype=torch.float64)
    plain.step()  # Adam's update alone: w = 3 - 0.01 / (1 + 1e-6)
    assert param.tolist() == pytest.approx([3 - 0.01 / (1 + 1e-6), 4.0], abs=1e-12)


def test_lamb_weight_decay_is_part_of_the_scaled_update():
    # w = (3, 4), g = (0, 0): m = v = 0, u = 0.1 * w = (0.3, 0.4), |u| = 0.5,
    # trust = 5 / 0.5 = 10: w = w - 0.01 * 10 * (0.3, 0.4) = (2.97, 3.96).
    options = dict(lr=0.01, eps=1e-6, weight_decay=0.1)
    (step,) = _steps(Lamb, [3.0, 4.0], [[0.0, 0.0]], **options)
    assert step == pytest.approx([2.97, 3.96], abs=1e-12)


def test_lars_uses_the_local_learning_rate_inside_momentum():
    # w = (3, 4), g = (0.6, 0.8), |g| = 1, eta 0.001, lr 1, momentum 0.9:
    # local = 0.001 * 5 / 1 = 0.005, v = (0.003, 0.004), w = (2.997, 3.996);
    # step 2: |w| = 4.995, local = 0.004995,
    # v = 0.9 v + 0.004995 g = (0.005697, 0.007596), w = (2.991303, 3.988404).
    options = dict(lr=1.0, momentum=0.9, eta=0.001)
    first, second = _steps(Lars, [3.0, 4.0], [[0.6, 0.8]] * 2, **options)
    assert first == pytest.approx([2.997, 3.996], abs=1e-12)
    assert second == pytest.approx([2.991303, 3.988404], abs=1e-12)


def test_lars_weight_decay_enters_gradient_and_local_rate():
    # w = (3, 4), g = (0.6, 0.8), wd 0.2: local = 0.001 * 5 / (1 + 0.2 * 5)
    # = 0.0025; step = 0.0025 * (0.6 + 0.6, 0.8 + 0.8) = (0.003, 0.004).
    options = dict(lr=1.0, momentum=0.9, eta=0.001, weight_decay=0.2)
    (step,) = _steps(Lars, [3.0, 4.0], [[0.6, 0.8]], **options)
    assert step == pytest.approx([2.997, 3.996], abs=1e-12)


def test_a_zero_weight_takes_the_plain_update():
    # |w| = 0: trust ratios are 1 (LAMB: Adam's step; LARS: lr * g).
    (lamb,) = _steps(Lamb, [0.0, 0.0], [[1.0, 0.0]], lr=0.01, eps=1e-6)
    assert lamb == pytest.approx([-0.01 / (1 + 1e-6), 0.0], abs=1e-12)
    (lars,) = _steps(Lars, [0.0, 0.0], [[0.5, 0.0]], lr=0.1, momentum=0.0)
    assert lars == pytest.approx([-0.05, 0.0], abs=1e-12)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_norm_layers_and_biases_get_no_trust_ratio(name):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    cfg = load_cfg(None, ["OPTIM.OPTIMIZER", name])
    optimizer = build_optimizer(model, optimizer_spec(cfg))
    trusted, plain = optimizer.param_groups
    assert trusted["trust_ratio"] and not plain["trust_ratio"]
    assert [p.shape for p in trusted["params"]] == [(3, 4), (2, 3)]
    assert len(plain["params"]) == 4  # two biases, the norm's weight and bias
    assert plain["weight_decay"] == cfg.OPTIM.WEIGHT_DECAY  # decayed unless asked
    cfg = load_cfg(None, ["OPTIM.OPTIMIZER", name, "OPTIM.NO_DECAY_NORM_BIAS", "True"])
    optimizer = build_optimizer(model, optimizer_spec(cfg))
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "name, cls", [("rmsprop", RMSpropTF), ("lamb", Lamb), ("lars", Lars)]
)
def test_each_optimizer_lowers_the_loss_of_a_small_net(name, cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    lr = {"rmsprop": "0.05", "lamb": "0.01", "lars": "5.0"}[name]
    keys = ["OPTIM.OPTIMIZER", name, "OPTIM.BASE_LR", lr, "OPTIM.EPS", "1e-3"]
    optimizer = build_optimizer(model, optimizer_spec(load_cfg(None, keys)))
    assert type(optimizer) is cls
    inputs, targets = torch.randn(64, 8), torch.randint(0, 3, (64,))
    losses = []
    for _ in range(100):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_layer_decay_scales_each_layers_learning_rate():
    from distribuuuu.models import build_model
    from distribuuuu.optim.build import describe_param_groups, set_lr

    model = build_model("vit_tiny_patch4", 10)  # 6 blocks: layers 0 to 7
    cfg = load_cfg(
        None, ["OPTIM.LAYER_DECAY", "0.5", "OPTIM.NO_DECAY_NORM_BIAS", "True"]
    )
    optimizer = build_optimizer(model, optimizer_spec(cfg))
    set_lr(optimizer, 0.1)
    groups = optimizer.param_groups
    rate = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(rate) == len(named)  # every parameter once
    assert rate[id(named["head.weight"])] == pytest.approx(0.1)
    assert rate[id(named["blocks.5.fc1.weight"])] == pytest.approx(0.1 * 0.5)
    assert rate[id(named["blocks.0.attn.q.weight"])] == pytest.approx(0.1 * 0.5**6)
    assert rate[id(named["patch_embed.weight"])] == pytest.approx(0.1 * 0.5**7)
    decays = {
        id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]
    }
    assert decays[id(named["blocks.0.norm1.weight"])] == 0.0  # still no decay
    assert "lr x 0.0078" in describe_param_groups(optimizer)


def test_layer_decay_is_refused_for_a_model_without_layer_ids(tmp_path):
    from helpers import refused

    line = refused(str(tmp_path / "out"), "OPTIM.LAYER_DECAY", "0.7")
    assert "OPTIM.LAYER_DECAY: resnet20 has no layer ids" in line
