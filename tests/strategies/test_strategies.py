"""The strategy registry: every DIST.STRATEGY the config accepts has a strategy,
and each one trains a model in one process exactly like a plain loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import strategy_for

from distribuuuu.config import STRATEGIES as CONFIG_CHOICES
from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.models import build_model
from distribuuuu.strategies import STRATEGIES, Strategy, build_strategy


def test_every_config_choice_has_a_strategy_and_no_more():
    assert set(STRATEGIES) == set(CONFIG_CHOICES)
    for name, cls in STRATEGIES.items():
        assert issubclass(cls, Strategy) and cls.name == name


def test_the_config_picks_the_strategy():
    spec = strategy_spec(
        load_cfg(None, ["DIST.STRATEGY", "zero1"]), torch.device("cpu")
    )
    strategy = build_strategy(spec)
    assert strategy.name == "zero1" and strategy.spec is spec


def test_only_dp_drives_more_than_one_device_per_process():
    many = [name for name, cls in STRATEGIES.items() if not cls.one_device_per_process]
    assert many == ["dp"]


# A pipeline needs a process per stage (tests/strategies/test_pipeline.py); DeepSpeed's
# engine owns its optimizer and process group (tests/strategies/test_deepspeed.py).
@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"pipeline", "deepspeed"}))
def test_each_strategy_in_one_process_trains_like_a_plain_loop(name):
    torch.manual_seed(0)
    plain = build_model("lenet5", 10)
    torch.manual_seed(0)
    strategy = strategy_for(name)
    model = strategy.prepare_model(build_model("lenet5", 10))
    images, targets = torch.randn(4, 3, 28, 28), torch.randint(0, 10, (4,))
    for net in (plain, model):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            with strategy.gradient_sync(net, sync=True):
                F.cross_entropy(net(images), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    saved = strategy.model_state_dict(model)
    assert saved.keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(saved[key], value)
    assert strategy.devices(model) == [torch.device("cpu")]
    assert not strategy.forward_is_collective(model)
