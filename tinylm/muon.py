"""Muon for the hidden weight matrices, with AdamW beside it for every other parameter.

Muon follows the published algorithm of Keller Jordan, "Muon: An optimizer for hidden layers in
neural networks" (2024, https://kellerjordan.github.io/posts/muon/), as torch.optim.Muon implements
it: per 2-D weight matrix W with gradient G, at every step

    B  <- mu * B + (1 - mu) * G                         momentum (an average of the gradients)
    U  <- (1 - mu) * G + mu * B                          Nesterov: look one momentum step ahead
    O  <- NS5(U)                                         ~ the orthogonal factor of U (see below)
    W  <- W * (1 - lr * weight_decay)                    decoupled weight decay
    W  <- W - lr * scale(shape) * O                      scale: sqrt(max(1, rows / cols)) ("original")
                                                         or 0.2 * sqrt(max(rows, cols)) ("match_rms_adamw")

NS5 is the quintic Newton-Schulz iteration of that post (five steps, coefficients a, b, c below):
it maps U = P S Q^T to roughly P S' Q^T with the singular values S' pushed into about
[0.68, 1.21], cheaply, in bfloat16, without an SVD. An update with all singular values alike moves
the weights by the same amount in every direction the gradient points to, rare ones included.
"""

from __future__ import annotations

import math

import torch

from tinylm.optim import adamw_group_step

# The quintic of Keller Jordan's Muon: coefficients picked for a steep slope at 0, so small singular
# values grow fast, at the price of not converging exactly to 1 (torch.optim.Muon uses the same).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7  # guards the normalisation of an all-zero update
ADJUST_LR_CHOICES = ("original", "match_rms_adamw")


def newton_schulz(
    update: torch.Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Orthogonalise one matrix by the quintic Newton-Schulz iteration, in bfloat16.

    update: [m, n], any float dtype. Returns [m, n] bfloat16: U = P S Q^T becomes about P S' Q^T,
    where each singular value s of U / ||U||_F goes through s -> a s + b s^3 + c s^5 `steps` times;
    with the default five steps every s >= 0.003 lands in [0.68, 1.21] (up to bfloat16 rounding).
    The arithmetic is torch.optim.Muon's, operation for operation: the same bits (tested on the CPU).

    One matrix at a time, on purpose: a batched product of a stack of matrices (torch.baddbmm) is
    another kernel whose bfloat16 results differ from the 2-D one in the last bit now and then, and
    Muon's updates would no longer follow torch's.
    """
    if update.dim() != 2:
        raise ValueError(f"newton_schulz: expected a matrix, got shape {tuple(update.shape)}")
    a, b, c = coefficients
    x = update.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the smaller Gram matrix X X^T
        x = x.T
    x = x / x.norm().clamp(min=eps)  # Frobenius norm >= spectral norm: every singular value in [0, 1]
    for _ in range(steps):
        gram = x @ x.T  # A = X X^T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X: each s -> a s + b s^3 + c s^5
    return x.T if tall else x


def adjusted_lr(lr: float, shape: torch.Size | tuple[int, ...], adjust_lr_fn: str) -> float:
    """The learning rate of a [rows, cols] matrix's orthogonalised update (torch.optim.Muon's options).

    "original" (Keller Jordan's): lr * sqrt(max(1, rows / cols)); "match_rms_adamw" (Moonshot's,
    "Muon is Scalable for LLM Training", 2025): lr * 0.2 * sqrt(max(rows, cols)), an update of about
    AdamW's RMS, so that AdamW's lr and weight decay carry over.
    """
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"adjust_lr_fn: {adjust_lr_fn!r} is not one of {ADJUST_LR_CHOICES}")
    return lr * ratio


class Muon(torch.optim.Optimizer):
    """Muon for the param groups with `use_muon` (the default), AdamW for those with `use_muon=False`.

    One optimizer for both, so that ShardedOptimizer (which runs one optimizer class on each rank's
    share) steps a model trained with both, and one state dict holds everything.

    Muon groups (2-D parameters only): lr, momentum, nesterov, weight_decay, ns_steps,
    ns_coefficients, ns_eps, adjust_lr_fn; state per parameter: `momentum_buffer` (as
    torch.optim.Muon keeps it). Same update as torch.optim.Muon, with torch's `eps` named `ns_eps`
    here (AdamW groups have their own `eps`). The elementwise steps are multi-tensor calls over the
    matrices of one shape, device and dtype; the orthogonalisation runs matrix by matrix.

    AdamW groups (any shape): lr, betas, eps, weight_decay, stepped exactly as `tinylm.optim.AdamW`
    (state `step`, `exp_avg`, `exp_avg_sq`).

    The defaults are torch.optim.Muon's (lr 1e-3, weight decay 0.1, momentum 0.95, Nesterov) and
    torch.optim.AdamW's (betas (0.9, 0.999), eps 1e-8); every group may set its own values.
    Parameters without a gradient are skipped. Works on any subset of a model's parameters.
    """

    # The state's contract (see tinylm.optim.AdamW): Muon's momentum and AdamW's moments are shaped
    # like the parameter, AdamW's step count is one per parameter.
    elementwise_state = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    per_parameter_state = ("step",)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = NS_EPS,
        adjust_lr_fn: str = "original",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        use_muon: bool = True,
    ):
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if ns_steps < 1:
            raise ValueError(f"invalid ns_steps: {ns_steps}")
        if adjust_lr_fn not in ADJUST_LR_CHOICES:
            raise ValueError(f"adjust_lr_fn: {adjust_lr_fn!r} is not one of {ADJUST_LR_CHOICES}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            adjust_lr_fn=adjust_lr_fn,
            betas=betas,
            eps=eps,
            use_muon=use_muon,
        )
        super().__init__(params, defaults)

    @staticmethod
    def needs_whole_parameters(group: dict) -> bool:
        """Whether a group's update needs whole matrices (ShardedOptimizer keeps those whole)."""
        return bool(group.get("use_muon", True))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"Muon steps 2-D parameters only, got one of shape {tuple(p.shape)} "
                        f"(give it a group with use_muon=False: AdamW)"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            else:
                adamw_group_step(group, self.state)
        return loss

    def _muon_group_step(self, group: dict) -> None:
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        for params in _by_kind(p for p in group["params"] if p.grad is not None):
            grads = [p.grad for p in params]
            buffers = [self._momentum_buffer(p) for p in params]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)  # B <- mu B + (1 - mu) G
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            orthogonal = [
                newton_schulz(u, group["ns_steps"], group["ns_coefficients"], group["ns_eps"])
                for u in updates
            ]  # bfloat16
            torch._foreach_mul_(params, 1 - lr * weight_decay)
            # One shape, so one learning-rate adjustment for the whole list.
            torch._foreach_add_(
                params, orthogonal, alpha=-adjusted_lr(lr, params[0].shape, group["adjust_lr_fn"])
            )

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


def _by_kind(params) -> list[list[torch.Tensor]]:
    """Parameters grouped by (device, dtype, shape), in first-seen order: one multi-tensor call each."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype, tuple(p.shape)), []).append(p)
    return list(groups.values())
