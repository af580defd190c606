"""Test-only fault injection into a training run, driven by TINYLM_FAULT (see tinylm/parallel/launch.py).

`install_fault_hooks(module, rank, first_step, micro_steps)` does nothing unless TINYLM_FAULT is
set. When it is, hooks on `module` (the DDP wrapper, which runs eagerly even around a compiled
model) count its forward passes (only training forwards go through it), so the training loop itself carries no fault code:
the first forward of step S runs `maybe_inject_fault(rank, S)` (raise, exit, kill or hang), and for
action=nan every output of step S becomes NaN, for action=overflow its gradient is multiplied by
2**100 in backward (finite in float32, an overflow in float16).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tinylm.parallel.launch import FAULT_ENV, maybe_inject_fault

OVERFLOW_FACTOR = 2.0**100


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def install_fault_hooks(module: nn.Module, rank: int, first_step: int, micro_steps: int) -> None:
    """Hook TINYLM_FAULT into `module`'s training forwards; `micro_steps` forwards make one step."""
    if not os.environ.get(FAULT_ENV):
        return
    forwards = 0
    action: str | None = None  # the poison of the step in progress

    def before(mod: nn.Module, args):
        nonlocal forwards, action
        if forwards % micro_steps == 0:
            action = maybe_inject_fault(rank, first_step + forwards // micro_steps)
        forwards += 1

    def after(mod: nn.Module, args, output: torch.Tensor):
        if action == "nan":
            return output * float("nan")
        if action == "overflow":
            return _ScaleGradient.apply(output, OVERFLOW_FACTOR)
        return output

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
