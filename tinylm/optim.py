"""The AdamW optimizer, and the learning-rate schedules (cosine or warmup-stable-decay after a warmup)."""

from __future__ import annotations

import math

import torch


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), the same update as torch.optim.AdamW.

    Per parameter p with gradient g, at step t = 1, 2, ...:
        p   <- p * (1 - lr * weight_decay)                    decay, independent of the gradient
        m   <- beta1 * m + (1 - beta1) * g                    first moment
        v   <- beta2 * v + (1 - beta2) * g^2                  second moment
        p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    Each line runs as one multi-tensor (`torch._foreach_*`) call over all parameters of a group that
    share a device and dtype, instead of a few small kernels per parameter. With `fused` (default:
    on CUDA) the whole update is torch's fused AdamW kernel instead, one pass over the parameters
    where the lines above are about twenty: the same update up to float rounding
    (tests/test_optim.py checks it against the lines above, which stay the reference).

    State per parameter: `step` (a float32 0-d tensor on the CPU, as torch keeps it: reading it never
    waits for the GPU), `exp_avg` (m) and `exp_avg_sq` (v), beside the parameter. Each param group
    may set its own lr, betas, eps and weight_decay. Parameters without a gradient are skipped.
    Works on any subset of a model's parameters; the state dict loads into torch.optim.AdamW.
    """

    # The state's contract, which sharding and checkpoints read (tinylm/parallel/sharded.py): the
    # entries shaped like the parameter, and those held once per parameter.
    elementwise_state = ("exp_avg", "exp_avg_sq")
    per_parameter_state = ("step",)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        fused: bool | None = None,
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
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            adamw_group_step(group, self.state, self.fused)
        return loss


@torch.no_grad()
def adamw_group_step(group: dict, state: dict, fused: bool | None = None) -> None:
    """One AdamW update of the parameters of `group` that have a gradient (see `AdamW`).

    `group` is a param group (params, lr, betas, eps, weight_decay); `state` is the optimizer's
    state mapping, parameter -> {"step", "exp_avg", "exp_avg_sq"}, filled in on a parameter's first
    update. `fused`: torch's fused kernel (None: on CUDA), or the multi-tensor lines. Shared by
    `AdamW` and the AdamW groups of `tinylm.muon.Muon`.
    """
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    for params in _by_device_and_dtype(p for p in group["params"] if p.grad is not None):
        grads = [p.grad for p in params]
        states = [_adamw_state(state, p) for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)  # CPU tensors: no device work, no sync
        use_fused = params[0].device.type == "cuda" if fused is None else fused
        if use_fused:
            # The kernel reads the step counts on the parameters' device: one copy of all of them,
            # which does not wait for the device (no sync); the state keeps its counts on the CPU.
            on_device = torch.stack(steps).to(params[0].device, non_blocking=True).unbind()
            torch._fused_adamw_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                list(on_device),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
            continue
        t = [step.item() for step in steps]

        if weight_decay != 0.0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**ti) for ti in t])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / (1 - beta1**ti) for ti in t])


def _adamw_state(state: dict, p: torch.Tensor) -> dict:
    if not state[p]:
        state[p]["step"] = torch.tensor(0.0)
        state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state[p]


def _by_device_and_dtype(params) -> list[list[torch.Tensor]]:
    """Parameters grouped by (device, dtype), in first-seen order: one multi-tensor call per group."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return list(groups.values())


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW param groups: weight decay on matrices (>= 2 dims), none on gains and other vectors.

    Decay pulls weights towards 0; for RMSNorm gains (initialised to 1) that fights the
    normalisation rather than regularising. Parameters keep their registration order in each group.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


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


def wsd_lr_scheduler(
    it: int, warmup_iters: int, decay_iters: int, total_iters: int, lr_min: float, lr_max: float
) -> float:
    """Learning rate at iteration `it` of warmup-stable-decay (Hägele et al. 2024):

    - it < warmup_iters: linear warmup from 0, lr_max * it / warmup_iters;
    - warmup_iters <= it <= total_iters - decay_iters: lr_max;
    - then linear from lr_max down to lr_min, reached at it = total_iters and kept after.
    """
    if it < warmup_iters:
        return lr_max * it / warmup_iters
    decay_start = total_iters - decay_iters
    if it <= decay_start:
        return lr_max
    if it >= total_iters:
        return lr_min
    return lr_max + (lr_min - lr_max) * (it - decay_start) / decay_iters
