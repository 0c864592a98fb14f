"""What building a run's model needs to know: :class:`ModelSpec`.

The engine fills it from the MODEL section of the config
(:mod:`distribuuuu.engine.specs`); a test or a tool may build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """The architecture, its head and its regularisation.

    A negative rate or BatchNorm value keeps the model's own.
    """

    arch: str  # MODEL.ARCH: a name of the registry
    num_classes: int  # MODEL.NUM_CLASSES: the size of the head
    pretrained: bool  # MODEL.PRETRAINED: torchvision's or timm's weights
    dropout: float  # MODEL.DROPOUT: the classifier's dropout
    drop_path: float  # MODEL.DROP_PATH: stochastic depth
    bn_momentum: float  # MODEL.BN_MOMENTUM of every BatchNorm layer
    bn_eps: float  # MODEL.BN_EPS of every BatchNorm layer
