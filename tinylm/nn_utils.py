"""Softmax, cross-entropy loss, the logit soft-cap and gradient clipping, written out."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x) / sum(exp(x)) along `dim`, any shape.

    The maximum is subtracted first (softmax does not change under a shift), so exp never overflows:
    the largest exponent is exp(0) = 1. Rows that are entirely -inf give NaN, as in torch.softmax.
    """
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = shifted.exp()
    return exp / exp.sum(dim=dim, keepdim=True)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int | None = None
) -> torch.Tensor:
    """Mean negative log-likelihood of `targets` under softmax(logits), over every position.

    logits: [..., vocab_size] (any leading shape), targets: [...] integer ids. Returns a scalar
    (at least float32, also for bf16 / fp16 logits). Per position the loss is
        -log softmax(z)[y] = logsumexp(z) - z[y],   logsumexp(z) = m + log(sum(exp(z - m))),  m = max(z),
    which stays finite for logits of any size: the largest exponent is exp(0) = 1.
    `chunk_bytes` (default: the logits' device's, `loss_chunk_bytes`) bounds the float32 rows handled
    at once; it changes the memory and the time, never the result.
    """
    return _CrossEntropy.apply(logits, targets, chunk_bytes)


# Rows of logits handled at once in float32: at most this many bytes of them (row_chunks). Rows are
# independent, so the result does not depend on the chunking, only the time and the memory do.
# On an accelerator, a bound that keeps the float32 temporaries of a large batch and vocabulary in
# check (at batch 32 x 1,024 positions x 32,000 tokens whole rows would take 4 GiB each) in few kernel
# launches. On the CPU, small chunks: each of the loss's passes over a chunk then runs in a core's
# cache, and the allocator reuses the chunk's temporaries, where a large one is mapped fresh from
# the OS each time (glibc maps every allocation above 32 MiB, and the default run's logits are
# 2,048 x 4,096 floats per rank): the default model's training step takes 0.775x the time of whole
# rows (bench/RESULTS.md, "The loss in chunks of rows").
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
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int | None) -> torch.Tensor:
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
        y = targets.reshape(-1, 1).long()  # [N, 1]
        m, log_sum, losses = [], [], []
        ctx.chunk_bytes = chunk_bytes
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
        logits, targets, m, log_sum = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        y = targets.reshape(-1).long()
        grad = torch.empty_like(flat)  # in the logits' dtype
        for rows in row_chunks(*flat.shape, flat.device, ctx.chunk_bytes):
            chunk = (_at_least_float32(flat[rows]) - m[rows]).sub_(log_sum[rows]).exp_()  # softmax(z)
            chunk[torch.arange(len(chunk), device=y.device), y[rows]] -= 1.0
            grad[rows] = chunk.mul_(grad_loss / y.shape[0])
        return grad.reshape(logits.shape), None, None


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


def squared_norms(grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """[len(grads)] float32 on `device`: the squared L2 norm of each tensor (summed in float32 at
    least), 0 for None. One vector of the same length whichever gradients are present, so that a
    sum over it does not depend on where the zeros came from (see ShardedOptimizer.clip_grad_norm_)."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([zero if g is None else g.float().pow(2).sum() for g in grads])


@torch.no_grad()
def scale_to_norm(
    grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float, eps: float = 1e-6
) -> None:
    """Multiply `grads` in place by min(1, max_norm / (total_norm + eps)): the clip of `gradient_clip`."""
    # A tensor factor clamped at 1 rather than an `if`: no device-to-host sync on GPUs.
    scale = (max_norm / (total_norm + eps)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
