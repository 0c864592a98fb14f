"""Synchronized BatchNorm for any backend, CPU/gloo included; precise BatchNorm
statistics (:func:`recompute_bn_statistics`).

``torch.nn.SyncBatchNorm`` refuses CPU modules ("SyncBatchNorm layers only work
with GPU modules"), so CPU runs use :class:`GroupSyncBatchNorm`, built on
``torch.distributed.all_reduce`` only:

* forward: every rank sums, per channel, its values, their squares and its
  sample count; one all-reduce gives the global mean and (biased) variance
  used to normalise, and the running statistics are updated as
  ``nn.BatchNorm`` does, with the unbiased variance of the global batch;
* backward: one all-reduce of the per-channel sums of ``dy`` and
  ``dy * x_hat`` makes the input gradient that of a single process over the
  global batch (whose loss is the sum of the ranks' losses, which DDP then
  averages).  Weight and bias gradients stay local; DDP reduces them.

Ranks may hold different batch sizes.  Outside training, or without a process
group of more than one rank, it is plain BatchNorm.  State-dict keys are those
of ``nn.BatchNorm*d``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _channel_view(t: torch.Tensor, dims: int) -> torch.Tensor:
    """Shape a per-channel vector to broadcast over an ``N x C x ...`` input."""
    return t.view(1, -1, *([1] * (dims - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):
        channels, dims = x.shape[1], x.dim()
        reduce_dims = [0, *range(2, dims)]
        x64 = x.double()
        stats = torch.cat(
            [
                x64.sum(reduce_dims),
                (x64 * x64).sum(reduce_dims),
                x.new_full((1,), x.numel() // channels, dtype=torch.float64),
            ]
        )
        dist.all_reduce(stats, group=group)
        total, squares, count = stats[:channels], stats[channels:-1], stats[-1]
        mean = total / count
        var = (squares / count - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)
        x_hat = (x - _channel_view(mean, dims).to(x.dtype)) * _channel_view(
            invstd, dims
        ).to(x.dtype)
        ctx.save_for_backward(x_hat, weight, invstd.to(x.dtype))
        ctx.group, ctx.count = group, count
        out = x_hat
        if weight is not None:
            out = out * _channel_view(weight, dims) + _channel_view(bias, dims)
        # The batch statistics, for the running averages (not differentiated).
        batch_stats = (mean.to(x.dtype), var.to(x.dtype), count.to(x.dtype))
        ctx.mark_non_differentiable(*batch_stats)
        return (out, *batch_stats)

    @staticmethod
    def backward(ctx, grad_out, _mean, _var, _count):
        x_hat, weight, invstd = ctx.saved_tensors
        dims = grad_out.dim()
        reduce_dims = [0, *range(2, dims)]
        sum_dy = grad_out.sum(reduce_dims)
        sum_dy_xhat = (grad_out * x_hat).sum(reduce_dims)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight, grad_bias = sum_dy_xhat.clone(), sum_dy.clone()
        sums = torch.cat([sum_dy, sum_dy_xhat]).double()
        dist.all_reduce(sums, group=ctx.group)
        channels = sum_dy.numel()
        mean_dy = (sums[:channels] / ctx.count).to(grad_out.dtype)
        mean_dy_xhat = (sums[channels:] / ctx.count).to(grad_out.dtype)
        scale = invstd if weight is None else invstd * weight
        grad_x = (
            grad_out
            - _channel_view(mean_dy, dims)
            - x_hat * _channel_view(mean_dy_xhat, dims)
        ) * _channel_view(scale, dims)
        return grad_x, grad_weight, grad_bias, None, None


class GroupSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every rank of a process group."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            num_features,
            eps=eps,
            momentum=momentum,
            affine=affine,
            track_running_stats=track_running_stats,
            device=device,
            dtype=dtype,
        )
        self.process_group = process_group
        # The class it was converted from, for revert_sync_batchnorm.
        self.original_class: type = nn.BatchNorm2d

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or self._world_size() == 1:
            return super().forward(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        # Statistics in float32 at least, also under bf16/fp16 autocast.
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        out, mean, var, count = _SyncBatchNormFunction.apply(
            x.float() if low_precision else x,
            self.weight,
            self.bias,
            self.eps,
            self.process_group,
        )
        out = out.to(x.dtype)
        # The buffers are None only without track_running_stats.
        if (
            self.track_running_stats
            and self.running_mean is not None
            and self.running_var is not None
        ):
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp(min=1))
                self.running_mean.lerp_(mean.detach(), factor)
                self.running_var.lerp_(unbiased.detach(), factor)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` (same parameters and buffers)."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            sync = cls(
                module.num_features,
                eps=module.eps,
                momentum=module.momentum,
                affine=module.affine,
                track_running_stats=module.track_running_stats,
                process_group=process_group,
            )
            sync.original_class = type(module)
            _copy_state(module, sync)
            return sync
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return module

    @classmethod
    def revert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """Turn every :class:`GroupSyncBatchNorm` back into its original BatchNorm."""
        if isinstance(module, cls):
            plain = module.original_class(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
            )
            _copy_state(module, plain)
            return plain
        for name, child in module.named_children():
            module.add_module(name, cls.revert_sync_batchnorm(child))
        return module


def _copy_state(source: _BatchNorm, target: _BatchNorm) -> None:
    with torch.no_grad():
        if source.affine:
            target.weight = source.weight
            target.bias = source.bias
        if source.track_running_stats:
            target.running_mean = source.running_mean
            target.running_var = source.running_var
            target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)


@torch.no_grad()
def recompute_bn_statistics(module: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Replace BatchNorm running statistics by their true average over ``batches``.

    The running averages of training weight recent batches most and lag
    behind the weights; recomputing them with the final weights, each batch
    weighted equally, gives better statistics for evaluation (the "precise
    BN" of fvcore's ``fvcore/nn/precise_bn.py:update_bn_stats`` and pycls's
    ``pycls/core/net.py:compute_precise_bn_stats``).  Each rank runs its
    batches in training mode with ``momentum=None`` (PyTorch's cumulative
    average: the mean of the batch means and of the batch variances), then
    the statistics are averaged across ranks, so every rank holds the same
    ones.  Momentum, ``num_batches_tracked`` and the training flag are
    restored.  Returns the number of batches this rank ran.

    Args:
        module: the model to run, not a DDP wrapper (whose forward would
            broadcast rank 0's statistics at every batch).  Under FSDP a
            forward pass is a collective: every rank must pass as many batches.
        batches: input batches on the model's device (images only).
    """
    norms = [
        m
        for m in module.modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats
    ]
    if not norms:
        return 0
    saved = [(m.momentum, m.get_buffer("num_batches_tracked").clone()) for m in norms]
    was_training = module.training
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    module.train()
    count = 0
    try:
        for images in batches:
            module(images)
            count += 1
    finally:
        module.train(was_training)
        for norm, (momentum, tracked) in zip(norms, saved):
            norm.momentum = momentum
            norm.get_buffer("num_batches_tracked").copy_(tracked)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for norm in norms:
            for stat in (
                norm.get_buffer("running_mean"),
                norm.get_buffer("running_var"),
            ):
                dist.all_reduce(stat)
                stat /= dist.get_world_size()
    return count
