"""Softmax, cross-entropy loss, the logit soft-cap and gradient clipping, written out."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x) / sum(exp(x)) along `dim`, any shape.

    The maximum is subtracted first (softmax does not change under a shift), so exp never overflows:
    the largest exponent is exp(0) = 1. Rows that are entirely -inf give NaN, as in torch.softmax.
    """
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = shifted.exp()
    return exp / exp.sum(dim=dim, keepdim=True)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int | None = None, fused: bool | None = None
) -> torch.Tensor:
    """Mean negative log-likelihood of `targets` under softmax(logits), over every position.

    logits: [..., vocab_size] (any leading shape), targets: [...] integer ids. Returns a scalar
    (at least float32, also for bf16 / fp16 logits). Per position the loss is
        -log softmax(z)[y] = logsumexp(z) - z[y],   logsumexp(z) = m + log(sum(exp(z - m))),  m = max(z),
    which stays finite for logits of any size: the largest exponent is exp(0) = 1.
    `chunk_bytes` (default: the logits' device's, `loss_chunk_bytes`) bounds the float32 rows handled
    at once; it changes the memory and the time, never the result.

    `fused` (default: on CUDA): each chunk through torch's log-softmax forward and softmax backward,
    one kernel that reads the logits once and writes float32 instead of the formula's five passes
    forward and seven backward; the same loss and gradients up to float rounding (tests/test_nn_utils.py
    holds it to the formula, which is the reference and the CPU's path). Under torch.compile the
    formula itself is used, which Inductor fuses: its backward is then one pointwise expression,
    exp(z - m - log_sum) minus a one-hot, scaled, one kernel that reads the logits once and writes
    the gradient once.
    """
    if fused is None:
        fused = logits.device.type == "cuda"
    return _CrossEntropy.apply(logits, targets, chunk_bytes, fused)


# Rows of logits handled at once in float32: at most this many bytes of them (row_chunks). Rows are
# independent, so the result does not depend on the chunking, only the time and the memory do.
# On an accelerator, a bound that keeps the float32 temporaries of a large batch and vocabulary in
# check (at batch 32 x 1,024 positions x 32,000 tokens whole rows would take 4 GiB each) in few kernel
# launches. On the CPU, small chunks: each of the loss's passes over a chunk then runs in a core's
# cache, and the allocator reuses the chunk's temporaries, where a large one is mapped fresh from
# the OS each time (glibc maps every allocation above 32 MiB, and the default run's logits are
# 2,048 x 4,096 floats per rank), so the default model's step is shorter than with whole rows
# (bench/RESULTS.md, "The loss in chunks of rows").
LOSS_CHUNK_BYTES = 256 << 20
CPU_LOSS_CHUNK_BYTES = 1 << 20


def loss_chunk_bytes(device_type: str) -> int:
    """The float32 bytes of rows of logits handled at once on a device of this type ("cpu", "cuda")."""
    return CPU_LOSS_CHUNK_BYTES if device_type == "cpu" else LOSS_CHUNK_BYTES


def row_chunks(
    num_rows: int, vocab_size: int, device: torch.device, chunk_bytes: int | None = None
) -> list[slice]:
    """Slices of `num_rows` rows of `vocab_size` floats in order, each at most `chunk_bytes` in
    float32 (default: `loss_chunk_bytes` of `device`), and at least one row."""
    limit = chunk_bytes or loss_chunk_bytes(torch.device(device).type)
    rows = max(1, limit // (4 * vocab_size))
    return [slice(start, start + rows) for start in range(0, num_rows, rows)]


class _CrossEntropy(torch.autograd.Function):
    """cross_entropy with its gradient written by hand.

    d loss / d z = (softmax(z) - onehot(y)) / N for N positions. Autograd through the forward formula
    would keep several [N, vocab_size] temporaries alive (the shifted logits, their exp, the
    scattered one-hot); with the gradient written out, backward needs one such tensor, in the
    logits' dtype, and float32 temporaries of one chunk of rows (row_chunks).
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int | None, fused: bool
    ) -> torch.Tensor:
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
        y = targets.reshape(-1, 1).long()  # [N, 1]
        # Under torch.compile the formula below is fused by Inductor, and backward is one expression.
        ctx.chunk_bytes, ctx.fused = chunk_bytes, fused and not torch.compiler.is_compiling()
        if ctx.fused:  # backward recomputes the softmax whole: nothing but the inputs to keep
            wide = torch.promote_types(flat.dtype, torch.float32)
            losses = [
                -F.log_softmax(flat[rows], dim=-1, dtype=wide).gather(-1, y[rows])
                for rows in row_chunks(*flat.shape, flat.device, chunk_bytes)
            ]
            ctx.save_for_backward(logits, targets)
            return torch.cat(losses).mean()
        m, log_sum, losses = [], [], []
        for rows in row_chunks(*flat.shape, flat.device, chunk_bytes):
            z = _at_least_float32(flat[rows])  # [n, V]
            m.append(z.amax(dim=-1, keepdim=True))  # [n, 1]
            log_sum.append((z - m[-1]).exp_().sum(dim=-1, keepdim=True).log_())  # logsumexp(z) - m
            losses.append(log_sum[-1] - (z.gather(-1, y[rows]) - m[-1]))  # minus z[y] - m
        # m and log_sum are kept apart: adding them would round away digits when |m| is large.
        m, log_sum = torch.cat(m), torch.cat(log_sum)
        ctx.save_for_backward(logits, targets, m, log_sum)
        return torch.cat(losses).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, *stats = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        y = targets.reshape(-1).long()
        scale = grad_loss / y.shape[0]
        if torch.compiler.is_compiling() and stats:
            return _one_pass_gradient(flat, y, *stats, scale).reshape(logits.shape), None, None, None
        grad = torch.empty_like(flat)  # in the logits' dtype
        for rows in row_chunks(*flat.shape, flat.device, ctx.chunk_bytes):
            if ctx.fused:
                chunk = F.softmax(flat[rows], dim=-1, dtype=torch.promote_types(flat.dtype, torch.float32))
            else:
                m, log_sum = stats
                chunk = (_at_least_float32(flat[rows]) - m[rows]).sub_(log_sum[rows]).exp_()  # softmax(z)
            chunk[torch.arange(len(chunk), device=y.device), y[rows]] -= 1.0
            torch.mul(chunk, scale, out=grad[rows])  # scaled and cast to the logits' dtype in one pass
        return grad.reshape(logits.shape), None, None, None


def _one_pass_gradient(
    flat: torch.Tensor, y: torch.Tensor, m: torch.Tensor, log_sum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """(softmax(z) - onehot(y)) * scale in the logits' dtype, as one pointwise expression.

    flat: [N, V] logits, y: [N] targets, m and log_sum: [N, 1] (at least float32) from the forward,
    scale: 0-d. softmax(z) = exp(z - m - log_sum) needs no reduction once they are known, and the
    one-hot is a comparison rather than a scatter, so nothing stops Inductor from making the whole
    expression one kernel: the logits read once, the gradient written once, no [N, V] float32
    temporary. The same float32 operations as the formula's backward, element for element.
    """
    onehot = torch.arange(flat.shape[-1], device=flat.device) == y[:, None]
    p = (_at_least_float32(flat) - m).sub(log_sum).exp()
    return (p - onehot.to(p.dtype)).mul(scale).to(flat.dtype)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), computed in at least float32 and returned in the logits' dtype.

    logits: [..., vocab_size]; the result has their shape and dtype, every value in [-cap, cap].
    The same formula as `(cap * torch.tanh(logits.float() / cap)).to(logits.dtype)` op for op, the
    same bits forward, but worked through a chunk of rows at a time (row_chunks) with its gradient
    written out: on the CPU whole [batch x context, vocab] float32 temporaries made each of the cap's
    passes a trip to memory (bench/RESULTS.md, "The loss in chunks of rows").
    """
    return _SoftCap.apply(logits, cap)


class _SoftCap(torch.autograd.Function):
    """softcap with its gradient written by hand: d/dz cap * tanh(z / cap) = 1 - tanh(z / cap)^2.

    Backward recomputes tanh a chunk at a time from the saved logits, and applies the same float32
    ops in the same order as autograd through the formula (the upcast, x cap, tanh's derivative,
    / cap, the cast back), so the gradient is the same too.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, cap: float) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty_like(flat)
        for rows in row_chunks(*flat.shape, flat.device):
            out[rows] = cap * torch.tanh(_at_least_float32(flat[rows]) / cap)
        ctx.save_for_backward(logits)
        ctx.cap = cap
        return out.view_as(logits)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        flat, grad_flat = logits.reshape(-1, logits.shape[-1]), grad_out.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        for rows in row_chunks(*flat.shape, flat.device):
            tanh = torch.tanh(_at_least_float32(flat[rows]) / ctx.cap)
            upstream = _at_least_float32(grad_flat[rows]) * ctx.cap
            grad[rows] = torch.ops.aten.tanh_backward(upstream, tanh) / ctx.cap
        return grad.view_as(logits), None


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 if it is bf16 / fp16, unchanged if float32 or float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def gradient_clip(parameters: Iterable[torch.Tensor], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients in place so that their global L2 norm is at most `max_norm`.

    The norm is taken over all gradients together, as if they were one vector. If it exceeds
    max_norm every gradient is multiplied by max_norm / (norm + eps), otherwise left unchanged.
    Parameters without a gradient are skipped (they add 0). Returns the norm before clipping (a 0-d
    tensor).
    """
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total_norm = squared_norms([p.grad for p in params], grads[0].device).sum().sqrt()
    scale_to_norm(grads, total_norm, max_norm, eps)
    return total_norm


def squared_norms(
    grads: list[torch.Tensor | None], device: torch.device, fused: bool | None = None
) -> torch.Tensor:
    """[len(grads)] float32 on `device`: the squared L2 norm of each tensor (taken in at least
    float32), 0 for None. One vector of the same length whichever gradients are present, so that a
    sum over it does not depend on where the zeros came from (see ShardedOptimizer.clip_grad_norm_).

    `fused` (default: on CUDA): one multi-tensor norm (`torch._foreach_norm`) per dtype, squared,
    instead of a sum of squares per tensor: a few kernels instead of two per tensor, the same up to
    float rounding. On the CPU, where the multi-tensor norm is itself a loop over the tensors, the
    per-tensor sums keep the runs' bits.
    """
    if fused is None:
        fused = torch.device(device).type == "cuda"
    present = [i for i, g in enumerate(grads) if g is not None]
    if not fused or not present:
        squared = torch.zeros(len(grads), dtype=torch.float32, device=device)
        for i in present:
            squared[i] = grads[i].float().pow(2).sum()
        return squared
    norms = [torch.zeros((), dtype=torch.float32, device=device)] * len(grads)  # 0 without a gradient
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in present:
        by_dtype.setdefault(grads[i].dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        wide = torch.promote_types(dtype, torch.float32)
        for i, norm in zip(
            indices, torch._foreach_norm([grads[i] for i in indices], 2, dtype=wide), strict=True
        ):
            norms[i] = norm.to(device=device, dtype=torch.float32)
    return torch.stack(norms) ** 2  # no index tensor to copy to the device: no host sync


@torch.no_grad()
def scale_to_norm(
    grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float, eps: float = 1e-6
) -> None:
    """Multiply `grads` in place by min(1, max_norm / (total_norm + eps)): the clip of `gradient_clip`."""
    # A tensor factor clamped at 1 rather than an `if`: no device-to-host sync on GPUs.
    scale = (max_norm / (total_norm + eps)).clamp(max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, scale.to(dtype))
