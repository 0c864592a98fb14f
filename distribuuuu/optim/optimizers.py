"""Optimizers that PyTorch does not ship, each written from its paper's update.

- :class:`RMSpropTF`: RMSProp as TensorFlow computes it (the optimizer of the
  EfficientNet and MobileNet papers): epsilon inside the square root, the mean
  square starting at one, the learning rate inside the momentum buffer.
- :class:`Lamb` (You et al. 2020, "Large Batch Optimization for Deep
  Learning: Training BERT in 76 minutes", Algorithm 2): Adam's update scaled
  per tensor by the trust ratio ``||w|| / ||update||``.
- :class:`Lars` (You et al. 2017, "Large Batch Training of Convolutional
  Networks", Algorithm 1): momentum SGD with a per-tensor local learning rate
  ``eta * ||w|| / (||g|| + wd * ||w||)``.

A parameter group with ``trust_ratio: False`` (normalization layers and
biases, see :func:`distribuuuu.optim.build.build_param_groups`) takes LAMB's and
LARS's plain update, as both papers' reference implementations exclude them.
"""

from __future__ import annotations

import torch


def _trust(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator where both are positive, else 1."""
    ok = (numerator > 0) & (denominator > 0)
    return torch.where(ok, numerator / denominator, torch.ones_like(numerator))


class RMSpropTF(torch.optim.Optimizer):
    """TensorFlow's RMSProp.

    Per step, with gradient ``g`` (plus ``weight_decay * w``, an L2 term as TF
    adds it to the loss)::

        ms  = alpha * ms + (1 - alpha) * g**2          # ms starts at 1
        mom = momentum * mom + lr * g / sqrt(ms + eps)
        w   = w - mom

    torch's RMSprop puts ``eps`` outside the root (``sqrt(ms) + eps``) and
    starts ``ms`` at 0; the two differ most in the first steps and where
    ``ms`` is small, which EfficientNet's recipe (``eps`` 1e-3) depends on.
    """

    def __init__(
        self, params, lr=0.01, alpha=0.9, eps=1e-3, momentum=0.9, weight_decay=0.0
    ):
        defaults = dict(
            lr=lr, alpha=alpha, eps=eps, momentum=momentum, weight_decay=weight_decay
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            alpha, eps, momentum = group["alpha"], group["eps"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.add(param, alpha=group["weight_decay"])
                state = self.state[param]
                if not state:
                    state["square_avg"] = torch.ones_like(param)
                    state["momentum_buffer"] = torch.zeros_like(param)
                square_avg, buffer = state["square_avg"], state["momentum_buffer"]
                square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
                update = grad / square_avg.add(eps).sqrt_()
                buffer.mul_(momentum).add_(update, alpha=group["lr"])
                param.sub_(buffer)
        return loss


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's bias-corrected update plus decoupled weight decay, scaled by
    ``||w|| / ||update||`` per tensor (1 where either norm is 0)::

        m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g**2
        u = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + wd * w
        w = w - lr * trust * u
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust_ratio=True
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                step = state["step"].item()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                mean = exp_avg / (1 - beta1**step)
                root = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
                update = (mean / root).add_(param, alpha=group["weight_decay"])
                if group["trust_ratio"]:
                    update.mul_(_trust(param.norm(), update.norm()))
                param.sub_(update, alpha=group["lr"])
        return loss


class Lars(torch.optim.Optimizer):
    """LARS: momentum SGD whose learning rate is scaled per tensor by the local
    rate ``eta * ||w|| / (||g|| + wd * ||w||)`` (1 where a norm is 0)::

        v = momentum * v + lr * local * (g + wd * w)
        w = w - v
    """

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.0, eta=0.001):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            eta=eta,
            trust_ratio=True,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            decay = group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                scale = torch.ones((), device=param.device)
                if group["trust_ratio"]:
                    weight_norm = param.norm()
                    denominator = grad.norm() + decay * weight_norm
                    scale = _trust(group["eta"] * weight_norm, denominator)
                state = self.state[param]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buffer = state["momentum_buffer"]
                step = grad.add(param, alpha=decay).mul_(scale * group["lr"])
                buffer.mul_(group["momentum"]).add_(step)
                param.sub_(buffer)
        return loss
