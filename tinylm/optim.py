"""The AdamW optimizer and the cosine learning-rate schedule with linear warmup."""

from __future__ import annotations

import math

import torch


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), the same update as torch.optim.AdamW.

    Per parameter p with gradient g, at step t = 1, 2, ...:
        p   <- p * (1 - lr * weight_decay)                    decay, independent of the gradient
        m   <- beta1 * m + (1 - beta1) * g                    first moment
        v   <- beta2 * v + (1 - beta2) * g^2                  second moment
        p   <- p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

    State per parameter: `step` (float32 0-d tensor, as torch keeps it), `exp_avg` (m) and
    `exp_avg_sq` (v). Each param group may set its own lr, betas, eps and weight_decay. Parameters
    without a gradient are skipped. Works on any subset of a model's parameters.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if eps < 0.0:
            raise ValueError(f"invalid eps: {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            eps = group["eps"]
            weight_decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                t = state["step"].item()

                p.mul_(1 - lr * weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

                bias_correction1 = 1 - beta1**t
                bias_correction2 = 1 - beta2**t
                denom = exp_avg_sq.sqrt().div_(math.sqrt(bias_correction2)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

        return loss


def cos_lr_scheduler(it: int, warmup_iters: int, cos_cycle_iters: int, lr_min: float, lr_max: float) -> float:
    """Learning rate at iteration `it`.

    - it < warmup_iters: linear warmup from 0, lr_max * it / warmup_iters;
    - warmup_iters <= it <= cos_cycle_iters: cosine from lr_max (at warmup_iters) to lr_min
      (at cos_cycle_iters);
    - it > cos_cycle_iters: lr_min.
    """
    if it < warmup_iters:
        return lr_max * it / warmup_iters
    if it > cos_cycle_iters:
        return lr_min
    if cos_cycle_iters == warmup_iters:
        return lr_max
    progress = (it - warmup_iters) / (cos_cycle_iters - warmup_iters)
    return lr_min + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr_max - lr_min)
