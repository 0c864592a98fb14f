"""Preparing a model for the run: one ordered chain of steps.

:data:`CHAIN` turns the plain model the trainer built into what this process
runs, each step behind its own switch:

1. activation checkpointing (MODEL.ACT_CKPT): blocks recompute in backward;
2. channels-last (MODEL.CHANNELS_LAST), where the strategy keeps it;
3. tensor parallelism (DIST.TENSOR_PARALLEL > 1): the blocks split over
   the ``tp`` axis (:mod:`distribuuuu.strategies.tensor`);
4. the strategy's wrapping or sharding (``Strategy.prepare_model``);
5. compilation (MODEL.COMPILE), of the module inside the wrapper.

What the steps refuse is asked here too, for pre-flight: the strategy's
declarations with those of tensor parallelism (:func:`check_choices`), and
the layout checks (:func:`check_layout`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from distribuuuu.models.recompute import enable_activation_checkpointing
from distribuuuu.strategies.base import Strategy
from distribuuuu.strategies.registry import STRATEGIES, strategy_class
from distribuuuu.strategies.spec import FP16, StrategySpec, check_value

logger = logging.getLogger(__name__)

Step = Callable[[Strategy, nn.Module], nn.Module]


def checkpoint_activations(strategy: Strategy, model: nn.Module) -> nn.Module:
    """MODEL.ACT_CKPT: the model's blocks recompute their activations."""
    if strategy.spec.activation_checkpointing:
        blocks = enable_activation_checkpointing(model)
        if blocks:
            logger.info("activation checkpointing: %d blocks recompute", blocks)
    return model


def runs_channels_last(strategy: Strategy) -> bool:
    """Whether the model runs channels-last: asked, and kept by the strategy."""
    return strategy.spec.channels_last and not strategy.contiguous_only


def to_channels_last(strategy: Strategy, model: nn.Module) -> nn.Module:
    """MODEL.CHANNELS_LAST, where the strategy keeps the layout.

    Convolutions give outputs in the layout of their weights, so the whole
    network runs channels-last; the normaliser writes the input batches in
    that layout too, which saves the first convolution a copy.
    """
    if runs_channels_last(strategy):
        return model.to(memory_format=torch.channels_last)
    if strategy.spec.channels_last:
        logger.info(
            "channels-last: off under %s: %s",
            strategy.name,
            strategy.contiguous_only,
        )
    return model


def split_tensors(strategy: Strategy, model: nn.Module) -> nn.Module:
    """DIST.TENSOR_PARALLEL: the blocks split over the ``tp`` axis."""
    return strategy.split_tensors(model)


def wrap(strategy: Strategy, model: nn.Module) -> nn.Module:
    """The strategy's own step: wrapped, sharded or cut into stages."""
    model = strategy.prepare_model(model)
    if strategy.tensor_parallel is not None:
        logger.info("%s", strategy.describe(model))
    return model


def compile_model(strategy: Strategy, model: nn.Module) -> nn.Module:
    """MODEL.COMPILE: the module inside the wrapper compiled in place."""
    if strategy.spec.compile_model:
        spec = strategy.spec
        static = spec.train_sizes > 1  # TRAIN.PROGRESSIVE: a graph per size
        compile_in_place(strategy.plain_model(model), spec.compile_mode, static)
        allow_recompiles(spec.train_sizes)
    return model


def allow_recompiles(sizes: int) -> None:
    """Let dynamo compile a graph ``sizes`` - 1 more times than its limit
    (``recompile_limit``, 8 in torch 2.14), beyond which it runs eagerly.

    Each training crop of TRAIN.PROGRESSIVE compiles the model once more
    (:func:`compile_in_place` with ``static``): a size marked dynamic does not
    stay so, since resnet8 specializes it (``torch._dynamo.mark_dynamic``
    fails, "your code specialized it to be a constant"), and torch's
    automatic dynamic shapes compiled it again at each size all the same.
    """
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8 + sizes - 1)


def compile_in_place(model: nn.Module, mode: str, static: bool = False) -> None:
    """``torch.compile`` the forward of ``model`` in place (``nn.Module.compile``):
    the module and its state_dict keys stay as they are, so checkpoints carry
    no compiler prefix, and the wrapper around it (DDP) calls the compiled
    forward in training as evaluation does.  Compilation happens at the first
    forward; a graph that fails to compile runs eagerly, with torch's warning
    (``torch._dynamo.config.suppress_errors``).

    ``static`` compiles a graph of static shapes for each input shape
    (``dynamic=False``) instead of torch's one graph of dynamic shapes after
    the second: on a CPU, resnet8's training step at sizes 16, 24, 32 took
    33, 19 and 21 s to compile so, against 41, 34 and 15 s.
    """
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    dynamic = False if static else None  # None: torch's automatic dynamic shapes
    model.compile(mode=None if mode == "default" else mode, dynamic=dynamic)
    logger.info(
        "MODEL.COMPILE: torch.compile (mode %s) at the first forward; what fails "
        "to compile runs eagerly",
        mode,
    )


CHAIN: tuple[Step, ...] = (
    checkpoint_activations,
    to_channels_last,
    split_tensors,
    wrap,
    compile_model,
)


def prepare_model(strategy: Strategy, model: nn.Module) -> nn.Module:
    """``model`` through every step of :data:`CHAIN`, in order."""
    for step in CHAIN:
        model = step(strategy, model)
    return model


# --- what the chain takes, asked before the run ---------------------------- #
def refusals(spec: StrategySpec) -> dict[str, str]:
    """The features the run's steps refuse -> why (the strategy's first, then
    tensor parallelism's; the first reason of a feature is kept)."""
    refused = dict(strategy_class(spec.name).refusals(spec))
    if spec.tensor_parallel > 1:
        from distribuuuu.strategies.tensor import TensorParallel

        for feature, why in TensorParallel.refused.items():
            refused.setdefault(feature, why)
    return refused


def takes_fp16(spec: StrategySpec) -> bool:
    """Whether the run's steps take fp16 (for what ``auto`` may pick)."""
    return FP16 not in refusals(spec)


def compiles(spec: StrategySpec) -> bool:
    """Whether MODEL.COMPILE may compile the run's model: one module, under a
    strategy that keeps it one, without tensor parallelism."""
    return strategy_class(spec.name).compiles and spec.tensor_parallel == 1


def check_layout(
    spec: StrategySpec, world_size: int, skeleton: Callable[[], nn.Module]
) -> None:
    """ValueError for a layout that cannot work on ``world_size`` processes:
    the axes' sizes, tensor parallelism's plan for the model (``skeleton()``
    builds it without memory), then the strategy's own checks."""
    cls = strategy_class(spec.name)
    cls.parallel_dims(spec, world_size).check()
    if spec.tensor_parallel > 1:
        from distribuuuu.strategies.tensor import TensorParallel

        TensorParallel.check_layout(spec, skeleton)
    cls.check_layout(spec, world_size, skeleton)


def check_comm_hook(spec: StrategySpec, cls: type[Strategy]) -> None:
    """DIST.DDP.COMM_HOOK only where DDP reduces the gradients."""
    hook = spec.comm_hook.name
    if hook == "none" or (cls.takes_comm_hook and spec.tensor_parallel == 1):
        return
    names = listed(names_where(lambda each: each.takes_comm_hook), "and")
    where = spec.name
    if cls.takes_comm_hook:
        where += " with DIST.TENSOR_PARALLEL > 1"
    check_value(
        False,
        "DIST.DDP.COMM_HOOK",
        hook,
        f"applies to DIST.STRATEGY {names} (DDP's gradients), not {where}",
    )


def names_where(test: Callable[[type[Strategy]], bool]) -> list[str]:
    """The registered strategies (in the config's order) that pass ``test``."""
    return [name for name, cls in STRATEGIES.items() if test(cls)]


def listed(names: list[str], last: str) -> str:
    """``a, b and c`` (``last``: the word before the last name)."""
    if len(names) < 2:
        return "".join(names)
    return f"{', '.join(names[:-1])} {last} {names[-1]}"


def check_choices(spec: StrategySpec, turned_on: Mapping[str, tuple[str, Any]]) -> None:
    """ValueError, in the config's words, for what the run's steps do not
    take: a value of the strategy's own keys, a feature turned on that a step
    refuses (``turned_on``: feature -> the key that turns it on and its value,
    for those on), tensor parallelism under a strategy that does not split
    its replicas' blocks, compilation of a model that is not one module."""
    cls = strategy_class(spec.name)
    cls.check_config(spec)
    for feature, why in refusals(spec).items():
        if feature in turned_on:
            key, value = turned_on[feature]
            check_value(False, key, value, f"is not supported with {why}")
    if spec.tensor_parallel > 1 and not cls.takes_tensor_parallel:
        over = listed(names_where(lambda each: each.takes_tensor_parallel), "or")
        check_value(False, "DIST.STRATEGY", spec.name,
                    "cannot be combined with DIST.TENSOR_PARALLEL > 1: choose "
                    f"{over} over the replicas")  # fmt: skip
    check_comm_hook(spec, cls)
    if spec.compile_model and not compiles(spec):
        names = listed(names_where(lambda each: each.compiles), "and")
        check_value(False, "MODEL.COMPILE", True,
                    f"is supported with DIST.STRATEGY {names}, not {spec.name} "
                    "(or tensor parallelism)")  # fmt: skip
