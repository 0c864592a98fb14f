"""Gradients after backward: averaged over replicas where no wrapper does it,
their global norm (before clipping, as ``clip_grad_norm_`` measures it, also
where they are DTensors on several meshes), clipping, and the optimizer step
under a GradScaler."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def average_gradients(params: list[nn.Parameter], group, size: int) -> None:
    """Average the gradients (this rank's shards of DTensor ones) over the
    ``size`` ranks of ``group``, in one all-reduce."""
    if size == 1:
        return
    grads = []
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(_local(param.grad))
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    flat /= size
    torch._foreach_copy_(
        grads, list(torch._utils._unflatten_dense_tensors(flat, grads))
    )


def _by_mesh(params: list[nn.Parameter]) -> dict:
    """The parameters that have gradients, by their gradients' device mesh
    (None: plain tensors)."""
    groups: dict = {}
    for param in params:
        if param.grad is not None:
            grad = param.grad
            mesh = grad.device_mesh if isinstance(grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    return groups


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm of DTensors (a DTensor, which torch types a Tensor) made whole."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _norm_of_meshes(groups: dict) -> torch.Tensor:
    norms = [
        _whole(torch.nn.utils.get_total_norm([p.grad for p in group]))
        for group in groups.values()
    ]
    return torch.linalg.vector_norm(torch.stack(norms))


def gradient_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params``, as
    :func:`clip_gradients` measures it (on the device: no host sync; a
    collective where the gradients are DTensors)."""
    groups = _by_mesh(params)
    if not groups:
        return torch.zeros(())
    if len(groups) == 1:
        (group,) = groups.values()
        return _whole(torch.nn.utils.get_total_norm([p.grad for p in group]))
    return _norm_of_meshes(groups)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients by their global norm, where they may be DTensors on
    different meshes (tensor-parallel blocks, FSDP x TP) beside plain tensors
    that every rank holds alike: torch's ``clip_grad_norm_`` mixes neither.
    Returns the norm before clipping (``clip_grad_norm_``'s)."""
    groups = _by_mesh(params)
    if len(groups) <= 1:
        return _whole(torch.nn.utils.clip_grad_norm_(params, max_norm))
    total = _norm_of_meshes(groups)
    for group in groups.values():  # parameters, whose .grad is scaled
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Stepped(NamedTuple):
    """What :func:`step_optimizer` did."""

    taken: bool  # False when a GradScaler skipped the step
    grad_norm: torch.Tensor | None  # before clipping, where measured (on device)


def step_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clip_grad_norm: float,
    check_skip: bool = False,
    norm_of: Callable[[list[nn.Parameter]], torch.Tensor] | None = None,
) -> Stepped:
    """Step (with loss scaling and clipping); with ``check_skip``, the step
    is reported not taken if the GradScaler skipped it.  The gradients' global
    norm before clipping is clipping's, else ``norm_of(parameters)`` where
    given (None otherwise).

    The gradients stay until the next step's backward replaces them.
    """
    norm = None
    if clip_grad_norm > 0 or norm_of is not None:
        scaler.unscale_(optimizer)  # the true gradients, not scaled ones
        params = list(model.parameters())
        if clip_grad_norm > 0:
            norm = clip_gradients(params, clip_grad_norm)
        else:
            norm = cast(Callable, norm_of)(params)
    if not (check_skip and scaler.is_enabled()):
        scaler.step(optimizer)
        scaler.update()
        return Stepped(True, norm)
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        # A fused optimizer (fused=True; we build none) always gets step() and
        # skips on the device. The scaler backs off (lowers its scale) exactly
        # when it skips: reading the scale before and after costs two syncs.
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return Stepped(scaler.get_scale() >= scale, norm)
    # GradScaler.step calls optimizer.step only if the gradients are finite, a
    # decision it reads on the host anyway (one .item() per step, in
    # GradScaler._maybe_opt_step of torch/amp/grad_scaler.py): a step post-hook
    # hears it without another synchronization.
    stepped = []
    hook = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    try:
        scaler.step(optimizer)
    finally:
        hook.remove()
    scaler.update()
    return Stepped(bool(stepped), norm)
