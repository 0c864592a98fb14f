"""Ways of spreading one model over devices and processes, one file each.

``DIST.STRATEGY`` picks one by name: each strategy's module registers its
class (:func:`~distribuuuu.strategies.registry.register`) and is imported
when the strategy is first asked for.  Every strategy implements the contract
of :class:`~distribuuuu.strategies.base.Strategy` and takes a
:class:`~distribuuuu.strategies.spec.StrategySpec`; the model goes through the
ordered steps of :mod:`distribuuuu.strategies.chain`.  Adding one means: its
file here, its name in the registry's lazy index and among the config's
choices (``distribuuuu/config``), and its tests.
"""

from __future__ import annotations

from distribuuuu.strategies.base import Strategy, unwrap_model
from distribuuuu.strategies.registry import STRATEGIES, register, strategy_class
from distribuuuu.strategies.spec import StrategySpec


def build_strategy(spec: StrategySpec) -> Strategy:
    """The strategy that ``spec`` names, for the run that ``spec`` describes."""
    return strategy_class(spec.name)(spec)


__all__ = [
    "STRATEGIES",
    "Strategy",
    "StrategySpec",
    "build_strategy",
    "register",
    "strategy_class",
    "unwrap_model",
]
