"""Models as chains of steps, the units a pipeline cuts between.

A pipeline stage runs a contiguous run of a model's layers, so the model must
be seen as a sequence: :func:`model_chain` lists the steps of the forward pass
of the registry's model families (the small ResNets and lenet5, torchvision's
ResNet, RegNet, EfficientNet, MobileNet, ConvNeXt and ViT).  Each step owns
modules or parameters by their names in the whole model and runs on a module
tree that holds (at least) those names, so a stage keeps the whole model's
``state_dict`` keys.  The functional glue of a ``forward`` (flatten, the ViT's
class token) belongs to the step that follows it.

A step that starts with a module without parameters (an activation, a
pooling layer) is merged into the step before: a stage never begins with an
in-place activation applied to its received input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distribuuuu.errors import UnsplittableModelError
from distribuuuu.models import small, vit

# step(root, x) -> x: root is a module tree holding the step's names.
Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Step:
    """One piece of a forward pass: the names it owns and how it runs."""

    owns: tuple[str, ...]  # module or parameter names in the whole model
    run: Run

    @property
    def name(self) -> str:
        """The first name it owns (where a stage beginning here begins)."""
        return self.owns[0]


def _call(path: str, before: Callable | None = None) -> Step:
    """The step running module ``path`` (after ``before`` on its input)."""

    def run(root: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if before is not None:
            x = before(x)
        return root.get_submodule(path)(x)

    return Step((path,), run)


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return torch.flatten(x, 1)


def _children(model: nn.Module, path: str, expand: tuple[type, ...] = ()) -> list:
    """Steps for the children of the Sequential at ``path``; children that are
    Sequentials of blocks (``expand``) give a step per block."""
    steps = []
    for name, child in model.get_submodule(path).named_children():
        full = f"{path}.{name}"
        blocks = list(child.children())
        if expand and blocks and all(isinstance(b, expand) for b in blocks):
            steps += [_call(f"{full}.{block}") for block, _ in child.named_children()]
        else:
            steps.append(_call(full))
    return steps


def _resnet(model: nn.Module) -> list[Step]:
    steps = [_call(name) for name in ("conv1", "bn1", "relu", "maxpool")]
    for layer in ("layer1", "layer2", "layer3", "layer4"):
        steps += _children(model, layer)
    return steps + [_call("avgpool"), _call("fc", _flatten)]


def _small_resnet(model: nn.Module) -> list[Step]:
    steps = [_call("stem")]
    for stage, _ in model.get_submodule("stages").named_children():
        steps += _children(model, f"stages.{stage}")
    return steps + [_call("pool"), _call("fc", _flatten)]


def _lenet(model: nn.Module) -> list[Step]:
    steps = _children(model, "features")
    classifier = _children(model, "classifier")
    first = classifier[0].owns[0]
    return steps + [_call(first, _flatten), *classifier[1:]]


def _regnet(model: nn.Module) -> list[Step]:
    steps = [_call("stem")]
    for stage, _ in model.get_submodule("trunk_output").named_children():
        steps += _children(model, f"trunk_output.{stage}")
    return steps + [_call("avgpool"), _call("fc", _flatten)]


def _features_model(model: nn.Module, blocks: tuple[type, ...]) -> list[Step]:
    """EfficientNet, MobileNet V2/V3, ConvNeXt: features, pooling, classifier."""
    steps = _children(model, "features", blocks)
    if hasattr(model, "avgpool"):
        steps.append(_call("avgpool"))
        # ConvNeXt's classifier starts with a norm and flattens itself.
        glue = None if _is_convnext(model) else _flatten
    else:  # MobileNetV2 pools in its forward

        def glue(x: torch.Tensor) -> torch.Tensor:
            return _flatten(F.adaptive_avg_pool2d(x, (1, 1)))

    return steps + [_call("classifier", glue)]


def _is_convnext(model: nn.Module) -> bool:
    from torchvision.models import convnext

    return isinstance(model, convnext.ConvNeXt)


def _vit(model: nn.Module) -> list[Step]:
    """torchvision's VisionTransformer: patches + class token + position, the
    encoder layers, then the final norm and the head on the class token.
    The steps read the ViT's names as attributes of their root (Any: torch
    types a module's attribute as a tensor or a module)."""

    def embed(root: Any, x: torch.Tensor) -> torch.Tensor:
        x = root.conv_proj(x)
        x = x.flatten(2).transpose(1, 2)  # (n, patches, hidden)
        token = root.class_token.expand(x.shape[0], -1, -1)
        x = torch.cat([token, x], dim=1) + root.encoder.pos_embedding
        return root.encoder.dropout(x)

    def head(root: Any, x: torch.Tensor) -> torch.Tensor:
        return root.heads(root.encoder.ln(x)[:, 0])

    owns = ("conv_proj", "class_token", "encoder.pos_embedding", "encoder.dropout")
    steps = [Step(owns, embed)]
    for name, _ in model.get_submodule("encoder.layers").named_children():
        steps.append(_call(f"encoder.layers.{name}"))
    return steps + [Step(("encoder.ln", "heads"), head)]


def _our_vit(model: nn.Module) -> list[Step]:
    """vit_tiny_patch4: the embedding, the blocks, the norm and head (the
    steps read its names as attributes of their root, as :func:`_vit`'s)."""

    def head(root: Any, x: torch.Tensor) -> torch.Tensor:
        return root.head(root.norm(x)[:, 0])

    def embed(root: Any, x: torch.Tensor) -> torch.Tensor:
        return vit.embed_patches(root.patch_embed, root.cls_token, x)

    embedding = Step(("patch_embed", "cls_token"), embed)
    blocks = _children(model, "blocks")
    return [embedding, *blocks, Step(("norm", "head"), head)]


def _families() -> list[tuple[type, Callable[[nn.Module], list[Step]]]]:
    from torchvision.models import (
        convnext,
        efficientnet,
        mobilenetv2,
        mobilenetv3,
        regnet,
        resnet,
        vision_transformer,
    )

    def features(blocks: tuple[type, ...]):
        return lambda model: _features_model(model, blocks)

    return [
        (small.SmallResNet, _small_resnet),
        (small.LeNet5, _lenet),
        (vit.VisionTransformer, _our_vit),
        (resnet.ResNet, _resnet),
        (regnet.RegNet, _regnet),
        (
            efficientnet.EfficientNet,
            features((efficientnet.MBConv, efficientnet.FusedMBConv)),
        ),
        (mobilenetv2.MobileNetV2, features((mobilenetv2.InvertedResidual,))),
        (mobilenetv3.MobileNetV3, features((mobilenetv3.InvertedResidual,))),
        (convnext.ConvNeXt, features((convnext.CNBlock,))),
        (vision_transformer.VisionTransformer, _vit),
    ]


def _merge_parameterless(model: nn.Module, steps: list[Step]) -> list[Step]:
    """Each step that owns no parameters joined to the step before it."""
    merged: list[Step] = []
    for step in steps:
        if merged and not _parameter_count(model, step):
            merged[-1] = _joined(merged[-1], step)
        else:
            merged.append(step)
    return merged


def _joined(first: Step, second: Step) -> Step:
    def run(root: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return second.run(root, first.run(root, x))

    return Step(first.owns + second.owns, run)


def _owned_tensors(model: nn.Module, name: str) -> list[torch.Tensor]:
    """The parameters and buffers under ``name`` (a module or a tensor)."""
    parent, _, leaf = name.rpartition(".")
    holder = model.get_submodule(parent)
    if leaf in holder._modules:
        module = holder.get_submodule(leaf)
        return [*module.parameters(), *module.buffers()]
    tensor = getattr(holder, leaf)
    return [tensor] if isinstance(tensor, torch.Tensor) else []


def _parameter_count(model: nn.Module, step: Step) -> int:
    return sum(
        t.numel()
        for name in step.owns
        for t in _owned_tensors(model, name)
        if isinstance(t, nn.Parameter)
    )


def step_sizes(model: nn.Module, steps: list[Step]) -> list[int]:
    """The parameter count of each step."""
    return [_parameter_count(model, step) for step in steps]


def model_chain(model: nn.Module) -> list[Step]:
    """The forward pass of ``model`` as a chain of steps that own, together,
    every parameter and buffer once.

    Raises UnsplittableModelError for a model of another family.
    """
    for family, chain in _families():
        if isinstance(model, family):
            steps = _merge_parameterless(model, chain(model))
            _check_ownership(model, steps)
            return steps
    raise UnsplittableModelError(
        f"the pipeline cannot run {type(model).__name__} as a chain of stages: it "
        "knows the small ResNets, lenet5 and torchvision's ResNet, RegNet, "
        "EfficientNet, MobileNet, ConvNeXt and ViT (DIST.PIPELINE.SPLIT picks "
        "among their layers); use another DIST.STRATEGY"
    )


def _check_ownership(model: nn.Module, steps: list[Step]) -> None:
    """Every parameter and buffer owned by exactly one step (a chain that
    misses one would silently train without it)."""
    owned = [
        id(t) for step in steps for n in step.owns for t in _owned_tensors(model, n)
    ]
    every = {id(t) for t in [*model.parameters(), *model.buffers()]}
    if len(owned) != len(set(owned)) or set(owned) != every:
        raise UnsplittableModelError(
            f"the pipeline's chain of {type(model).__name__} does not own each of "
            "its parameters and buffers once (this model's layout is not the one "
            "the pipeline knows); use another DIST.STRATEGY"
        )


# --- cutting a chain into stages ------------------------------------------- #
def balanced_bounds(sizes: list[int], pieces: int) -> list[int]:
    """The first step of each of ``pieces`` contiguous runs of ``sizes`` that
    make the largest run as small as it can be (each run holds a step)."""
    count = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest largest run when steps [0, i) form k runs.
    best = [[inf] * (count + 1) for _ in range(pieces + 1)]
    cut = [[0] * (count + 1) for _ in range(pieces + 1)]
    best[0][0] = 0
    for k in range(1, pieces + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], count
    for k in range(pieces, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def named_bounds(steps: list[Step], names: list[str], pieces: int) -> list[int]:
    """The first step of each piece, pieces after the first beginning at the
    modules ``names`` (DIST.PIPELINE.SPLIT).  Raises ValueError."""
    if len(names) != pieces - 1:
        raise ValueError(
            f"DIST.PIPELINE.SPLIT names {len(names)} stage starts; the {pieces} "
            f"stages need {pieces - 1} (or [] for an automatic split)"
        )
    starts = [step.name for step in steps]
    bounds = [0]
    for name in names:
        found = [
            i
            for i, start in enumerate(starts)
            if start == name or start.startswith(name + ".")
        ]
        if not found:
            shown = ", ".join(starts[1:13]) + (", ..." if len(starts) > 13 else "")
            raise ValueError(
                f"DIST.PIPELINE.SPLIT {name!r} is not a module where a stage can "
                f"begin; choose among: {shown}"
            )
        if found[0] <= bounds[-1]:
            raise ValueError(
                f"DIST.PIPELINE.SPLIT {name!r}: the names must follow the model's "
                "order, each after the one before (and not the first layer)"
            )
        bounds.append(found[0])
    return bounds


def _adopt(root: nn.Module, model: nn.Module, name: str) -> None:
    """Register ``model``'s module or tensor ``name`` in ``root`` under the same
    name, creating empty containers on the way."""
    parent, _, leaf = name.rpartition(".")
    holder = model.get_submodule(parent)
    container = root
    for part in parent.split(".") if parent else ():
        if part not in container._modules:
            container.add_module(part, nn.Module())
        container = container.get_submodule(part)
    if leaf in holder._modules:
        container.add_module(leaf, holder._modules[leaf])
    elif leaf in holder._parameters:
        container.register_parameter(leaf, holder._parameters[leaf])
    else:
        persistent = leaf not in holder._non_persistent_buffers_set
        container.register_buffer(leaf, holder._buffers[leaf], persistent)


class StagePart(nn.Module):
    """Steps of a model over the modules and tensors they own, under the whole
    model's names (so its state_dict is the whole model's, restricted)."""

    def __init__(self, model: nn.Module, steps: list[Step]):
        super().__init__()
        self._chain = list(steps)  # not modules: the tree below holds those
        for step in steps:
            for name in step.owns:
                _adopt(self, model, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # its gradient leaves a pipeline stage contiguous
            x.register_hook(torch.Tensor.contiguous)
        for step in self._chain:
            x = step.run(self, x)
        # A channels-last stage hands on contiguous activations: what the
        # pipeline sends between processes (a no-op for contiguous ones).
        return x.contiguous()


class ShapesUncounted(nn.Module):
    """A stage's piece as its PipelineStage runs it.  torch 2.11's stage infers
    its shapes by running the piece on zeros under ``no_grad`` in training
    mode, which BatchNorm counted in its running statistics: once per
    schedule, so once more in a resumed run than in an uninterrupted one.
    Such a pass runs in eval mode here; a training pass has gradients on."""

    def __init__(self, piece: StagePart):
        super().__init__()
        self.piece = piece

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not self.piece.training:
            return self.piece(x)
        self.piece.eval()
        try:
            return self.piece(x)
        finally:
            self.piece.train()
